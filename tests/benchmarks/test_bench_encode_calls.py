"""The encode-calls benchmark at a tiny size: it runs, times both ways, never reuses a word."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from kvroute.benchmarks import bench_encode_calls


def test_tiny_encode_calls_run(tmp_path: Path) -> None:
    out = tmp_path / "encode-calls.json"
    argv = ["--words", "1,3", "--calls", "3", "--gaps", "sleep,none", "--out", str(out)]
    assert bench_encode_calls.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["gap"], row["words"]) for row in rows] == [("sleep", 1), ("sleep", 3), ("none", 1), ("none", 3)]
    assert all(row["batch_us"] > 0 and row["each_us"] > 0 for row in rows)


def test_fresh_words_never_repeat() -> None:
    words = list(itertools.islice(bench_encode_calls.fresh_words(), 5000))
    assert len(set(words)) == len(words)
