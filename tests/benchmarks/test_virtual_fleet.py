"""The virtual fleet: the routing engine and the sim's scheduler on one virtual clock."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.benchmarks import bench
from kvroute.benchmarks.fleet import SimSpec
from kvroute.benchmarks.results import read_json
from kvroute.benchmarks.virtual_fleet import VirtualFleet
from kvroute.benchmarks.workloads import Workload, WorkloadOptions, WorkloadRequest, make_workloads
from kvroute.router.config import Settings

CHAT = "/v1/chat/completions"
SPEC = SimSpec(replicas=2, kv_capacity_tokens=16384, prefill_tokens_per_s=10_000.0, decode_tokens_per_s=50.0)


def _chat(text: str, max_tokens: int = 8) -> dict:
    return {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


def _workload(*requests: WorkloadRequest) -> Workload:
    return Workload("hand-made", "test", list(requests))


def test_a_lone_request_takes_its_prefill_then_one_decode_step_per_token() -> None:
    run = VirtualFleet(SPEC).replay(_workload(WorkloadRequest(0.0, CHAT, _chat("word " * 900, 10))), Settings())
    (record,) = run.result.records
    assert record.ok and record.cached_tokens == 0 and record.prompt_tokens is not None
    # Chunked prefill (2,048 tokens a step) costs prompt / rate in all; the step that ends
    # it samples the first token; each later token is one decode step.
    assert record.ttft_s == pytest.approx(record.prompt_tokens / SPEC.prefill_tokens_per_s)
    assert record.latency_s == pytest.approx(record.ttft_s + 9 / SPEC.decode_tokens_per_s)
    assert run.result.duration_s == pytest.approx(record.latency_s)


def test_a_returning_session_finds_its_turn_where_the_router_predicted() -> None:
    first = _chat("tell me about caches " * 40, 20)
    second = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "ok"}]}
    second["messages"].append({"role": "user", "content": "and more"})
    workload = _workload(
        WorkloadRequest(0.0, CHAT, first, session_id="s"),
        WorkloadRequest(0.0, CHAT, second, session_id="s", think_s=0.5),
    )
    run = VirtualFleet(SPEC).replay(workload, Settings(policy="cache_aware"))
    turn_one, turn_two = run.result.records
    assert turn_two.backend == turn_one.backend
    assert turn_two.sent_s == pytest.approx(turn_one.sent_s + turn_one.latency_s + 0.5)  # think time after the answer
    assert turn_two.cached_tokens and turn_two.cached_tokens >= 16 * (turn_one.prompt_tokens // 16) - 16
    assert turn_two.predicted_cached_tokens == turn_two.cached_tokens
    assert run.router.predicted_cached_tokens == turn_two.cached_tokens
    served = {url: counters.requests for url, counters in run.engines.items()}
    assert served[turn_one.backend] == 2 and sum(served.values()) == 2


def test_replays_are_deterministic_and_round_robin_alternates() -> None:
    (workload,) = make_workloads("agent-sessions:4", WorkloadOptions(limit=40, model="sim"))
    fleet = VirtualFleet(SPEC)
    runs = [fleet.replay(workload, Settings(policy="cache_aware")) for _ in range(2)]
    assert runs[0].result.records == runs[1].result.records
    assert runs[0].engines == runs[1].engines
    spread = fleet.replay(workload, Settings(policy="round_robin")).result.records
    by_send = sorted(spread, key=lambda record: record.sent_s)
    assert {record.backend for record in by_send[::2]} != {record.backend for record in by_send[1::2]}


def test_the_client_keeps_at_most_its_bound_in_flight_in_order() -> None:
    workload = _workload(*(WorkloadRequest(0.0, CHAT, _chat(f"question {n} " * 50)) for n in range(7)))
    records = VirtualFleet(SPEC).replay(workload, Settings(), max_in_flight=3).result.records
    ends = sorted(record.sent_s + record.latency_s for record in records)
    for record in records:
        in_flight = sum(other.sent_s <= record.sent_s < other.sent_s + other.latency_s for other in records)
        assert in_flight <= 3
    assert [record.sent_s for record in records[:3]] == [0.0] * 3
    # The rest each go out when a slot frees, in the order they fell due.
    assert [record.sent_s for record in records[3:]] == pytest.approx(ends[:4])
    unbounded = VirtualFleet(SPEC).replay(workload, Settings()).result.records
    assert all(record.sent_s == 0.0 for record in unbounded)


def test_kvroute_bench_engine_virtual(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    argv = ["--engine", "virtual", "--replicas", "2", "--workload", "agent-sessions:4", "--limit", "40"]
    argv += ["--policies", "round_robin,cache_aware", "--peer", "sglang-router", "--repeat", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    assert "modelled engine seconds (virtual time)" in capsys.readouterr().out
    rows = {(row.target, row.repeat): row for row in read_json(out / "results.json")}
    assert rows[("peer:sglang-router", 0)].status == "not in virtual time"
    for repeat in (0, 1):
        row = rows[("cache_aware", repeat)]
        assert row.requests == rows[("round_robin", repeat)].requests > 0 and row.errors == 0
        assert row.of_bound_fleet is not None and 0.5 < row.of_bound_fleet <= 1.0
    # Deterministic: a repeat is the same run.
    assert rows[("cache_aware", 0)].hit_rate_observed == rows[("cache_aware", 1)].hit_rate_observed


def test_kvroute_bench_seeds_runs_each_seed_and_tabulates_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    argv = ["--engine", "virtual", "--replicas", "2", "--workload", "multi-turn", "--conversations", "6"]
    argv += ["--policies", "sticky,cache_aware", "--no-bound", "--seeds", "3-4", "--out", str(out)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "hit obs by seed" in printed and "seed 3" in printed and "seed 4" in printed
    rows = {(row.target, row.seed): row for row in read_json(out / "results.json")}
    assert set(rows) == {(target, seed) for target in ("sticky", "cache_aware") for seed in (3, 4)}
    # Each seed is its own workload: the same policy sees different requests.
    seeded = [rows[("cache_aware", seed)] for seed in (3, 4)]
    assert all(row.requests == 24 and row.errors == 0 for row in seeded)
    assert seeded[0].prompt_tokens != seeded[1].prompt_tokens
    # One seed alone is exactly the --seed run.
    single = tmp_path / "single"
    argv = ["--engine", "virtual", "--replicas", "2", "--workload", "multi-turn", "--conversations", "6"]
    assert bench.main([*argv, "--policies", "cache_aware", "--no-bound", "--seed", "4", "--out", str(single)]) == 0
    (alone,) = read_json(single / "results.json")
    assert alone.seed is None and alone.hit_rate_observed == rows[("cache_aware", 4)].hit_rate_observed


@pytest.mark.parametrize(("text", "seeds"), [("0-3", [0, 1, 2, 3]), ("5", [5]), ("0-1,7,1", [0, 1, 7])])
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    assert bench.parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "3-x", ","])
def test_parse_seeds_refuses_what_is_not_seeds(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_seeds(text)
