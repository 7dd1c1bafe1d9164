"""The Mooncake block mapping: k shared hash ids <=> exactly k*512 shared leading tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvroute.benchmarks import mooncake
from kvroute.benchmarks.workloads import COMPLETIONS_ENDPOINT, WorkloadOptions, make_workloads
from tests.paths import SHARED

TRACES = SHARED / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.jsonl"


def _common_ids(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def _common_tokens(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _write_trace(path: Path, rows: list[tuple[int, int, list[int]]]) -> Path:
    lines = [
        json.dumps({"timestamp": ts, "input_length": n, "output_length": 5, "hash_ids": ids}) for ts, n, ids in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _assert_exact_sharing(records: list[mooncake.MooncakeRecord], mapping) -> None:
    prompts = [mapping.prompt_tokens(record) for record in records]
    for i, record in enumerate(records):
        assert len(prompts[i]) == record.input_length
        for j in range(i):
            k = _common_ids(record.hash_ids, records[j].hash_ids)
            expected = min(k * 512, len(prompts[i]), len(prompts[j]))
            assert _common_tokens(prompts[i], prompts[j]) == expected, (i, j, k)


def test_shared_ids_give_exactly_shared_tokens_on_a_crafted_trace(tmp_path: Path) -> None:
    # Ids chosen so that id-based token values collide: 7700 apart (the default span).
    rows = [
        (0, 1500, [0, 1, 2]),
        (10, 1400, [0, 1, 7702]),
        (20, 1100, [0, 7701, 3]),
        (30, 600, [7700, 5]),
        (40, 1536, [0, 1, 2]),
        (50, 1000, [0, 1]),
    ]
    records = mooncake.load_trace(_write_trace(tmp_path / "t.jsonl", rows))
    _assert_exact_sharing(records, mooncake.BlockMapping())


def test_runs_are_fixed_per_id_and_inside_the_vocabulary() -> None:
    mapping = mooncake.BlockMapping(vocab_size=5000, first_token_id=100)
    first = mapping.runs((0, 9, 12345))
    again = mooncake.BlockMapping(vocab_size=5000, first_token_id=100).runs((0, 9, 12345))
    assert np.array_equal(first, again)
    assert first.min() >= 100 and first.max() < 5000
    blocks = first.reshape(3, 512)
    assert len({tuple(block) for block in blocks}) == 3
    # The run of id 9 does not depend on the request it appears in.
    assert np.array_equal(mapping.runs((0, 9))[512:], blocks[1])


@pytest.mark.skipif(not CONVERSATION.exists(), reason="shared Mooncake traces not present")
def test_shared_ids_give_exactly_shared_tokens_on_the_real_trace() -> None:
    records = mooncake.load_trace(CONVERSATION, limit=250)
    assert len(records) == 250
    _assert_exact_sharing(records, mooncake.BlockMapping())


@pytest.mark.skipif(not CONVERSATION.exists(), reason="shared Mooncake traces not present")
def test_mooncake_workload_sends_token_prompts_at_trace_times() -> None:
    (workload,) = make_workloads(f"mooncake:{CONVERSATION}", WorkloadOptions(limit=20))
    assert workload.name == "mooncake:conversation"
    records = mooncake.load_trace(CONVERSATION, limit=20)
    assert len(workload.requests) == 20
    for request, record in zip(workload.requests, records):
        assert request.endpoint == COMPLETIONS_ENDPOINT
        assert request.arrival_s == record.timestamp_ms / 1000
        assert len(request.body["prompt"]) == record.input_length
        assert request.body["max_tokens"] == record.output_length
        assert request.session_id is None


def test_a_bad_trace_line_is_reported_with_its_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        mooncake.load_trace(path)
