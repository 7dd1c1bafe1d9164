"""The exchange benchmark at a tiny size: every placement crosses to the child process."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.benchmarks import bench_peer_exchange


def test_every_placement_reaches_the_subscriber(tmp_path: Path) -> None:
    out = tmp_path / "exchange.json"
    transports = ["unix", "ipc", "curve"]
    argv = ["--transport", ",".join(transports), "--rate", "500", "--count", "100", "--repeats", "1"]
    assert bench_peer_exchange.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["transport"] for row in rows] == transports  # every one, alternated
    for row in rows:
        assert row["received"] == row["count"] == 100 and row["blocks"] == 32
        assert row["subscriber_us"] > 0
