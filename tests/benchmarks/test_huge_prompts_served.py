"""The served huge-prompt benchmark at a tiny size: every request is answered and counted."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.benchmarks import huge_prompts_served


def test_tiny_served_run(tmp_path: Path) -> None:
    out = tmp_path / "served.json"
    # 40K tokens: a body over the proxy's threshold for preparing in a thread.
    argv = ["--huge-tokens", "40000", "--huge-prompts", "2", "--rounds", "1", "--quiet-s", "0.3"]
    assert huge_prompts_served.main([*argv, "--small-rate", "50", "--out", str(out)]) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["target"] == "cache_aware" and run["huge_errors"] == 0 and len(run["huge_ms"]) == 2
    assert run["before"]["requests"] >= 10 and run["before"]["errors"] == 0
    assert run["during"]["requests"] >= 1 and run["during"]["errors"] == 0
    assert 0 < run["before"]["p50_ms"] <= run["before"]["p99_ms"] <= run["before"]["max_ms"]
