"""Fixed placements of sessions: the candidates, the choice, and their replay in virtual time."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from kvroute.benchmarks import bench
from kvroute.benchmarks.fleet import SimFleet, SimSpec
from kvroute.benchmarks.placement_search import (
    Placement,
    best,
    candidates,
    frontier,
    residents_and_overflow,
    rotation,
    sessions_in_order,
)
from kvroute.benchmarks.results import BEST_PLACEMENT_TARGET, TargetResult, read_json
from kvroute.benchmarks.virtual_fleet import VirtualFleet
from kvroute.benchmarks.workloads import Workload, WorkloadOptions, WorkloadRequest, make_workloads
from kvroute.router.config import Settings

SESSIONS = [f"s{number}" for number in range(7)]


def _result(hit: float, p99: float) -> TargetResult:
    return TargetResult("x", "w", 1, 0, hit, None, None, p99, None)


def test_sessions_are_numbered_by_their_first_request() -> None:
    requests = [WorkloadRequest(0.0, "/v1/chat/completions", {}, session_id=key) for key in ("b", "a", "b", "c")]
    assert sessions_in_order(requests) == ["b", "a", "c"]
    with pytest.raises(ValueError, match="session id"):
        sessions_in_order([*requests, WorkloadRequest(0.0, "/v1/chat/completions", {})])


def test_rotation_and_residents_with_an_overflow() -> None:
    assert list(rotation(SESSIONS, 3).replica_of.values()) == [0, 1, 2, 0, 1, 2, 0]
    split = residents_and_overflow(SESSIONS, 4, per_replica=2, overflow=2)
    assert residents_and_overflow(SESSIONS, 4, per_replica=3, overflow=1).label == "3 on 3"
    # Two residents on each of replicas 0 and 1; the other three rotate over 2 and 3.
    assert list(split.replica_of.values()) == [0, 0, 1, 1, 2, 3, 2]
    assert split.label == "2 on 2 + rest on 2"
    with pytest.raises(ValueError):
        residents_and_overflow(SESSIONS, 4, per_replica=1, overflow=4)


def test_candidates_cover_every_split_down_to_all_sessions_on_one_replica() -> None:
    found = list(candidates(SESSIONS, 3))
    assert found[0].label == "rotate"
    # 2 resident replicas: 1-3 each with the rest on the third, then 4 each (no rest);
    # 1 resident replica: 1-6 with the rest over two, then all 7 on it.
    assert [placement.label for placement in found[1:]] == [
        *(f"{k} on 2 + rest on 1" for k in (1, 2, 3)),
        "4 on 2",
        *(f"{k} on 1 + rest on 2" for k in range(1, 7)),
        "7 on 1",
    ]
    for placement in found:
        assert set(placement.replica_of) == set(SESSIONS)
    assert set(found[-1].replica_of.values()) == {0}


def test_best_is_the_highest_hit_rate_then_the_lower_p99() -> None:
    a, b, c = (Placement(label, {}) for label in "abc")
    runs = [(a, _result(0.5, 1.0)), (b, _result(0.6, 3.0)), (c, _result(0.6, 2.0))]
    assert best(runs)[0] is c
    assert best([(a, _result(0.5, 1.0)), (b, _result(0.5, 1.0))])[0] is a
    with pytest.raises(ValueError):
        best([])


def test_the_frontier_keeps_what_no_other_beats_on_hit_rate_and_p99() -> None:
    a, b, c, d = (Placement(label, {}) for label in "abcd")
    runs = [(a, _result(0.40, 5.0)), (b, _result(0.44, 10.0)), (c, _result(0.39, 6.0)), (d, _result(0.42, 7.0))]
    assert [placement.label for placement, _ in frontier(runs)] == ["a", "d", "b"]  # c: a beats it on both


def test_a_fixed_placement_sends_every_session_to_its_replica() -> None:
    (workload,) = make_workloads("agent-sessions:5", WorkloadOptions(limit=30, model="sim"))
    fleet = VirtualFleet(SimSpec(replicas=3, kv_capacity_tokens=16384))
    placement = residents_and_overflow(sessions_in_order(workload.requests), 3, per_replica=1, overflow=1)
    run = fleet.replay(workload, Settings(policy="round_robin"), placement=placement.replica_of)
    for record in run.result.records:
        assert record.ok and record.backend == fleet.urls[placement.replica_of[record.session_id or ""]]
    served = [counters.requests for counters in run.engines.values()]
    assert served[0] == served[1] == 6 and served[2] == 18  # one session each; three on the last
    with pytest.raises(ValueError, match="load-only"):
        fleet.replay(workload, Settings(policy="cache_aware"), placement=placement.replica_of)


def test_kvroute_bench_placement_search(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    argv = ["--engine", "virtual", "--replicas", "2", "--kv-capacity-tokens", "16384", "--limit", "24"]
    argv += ["--workload", "agent-sessions:4", "--policies", "round_robin", "--placement-search"]
    assert bench.main([*argv, "--repeat", "2", "--out", str(out)]) == 0
    log = capsys.readouterr().err
    tried = {
        label: float(hit) for label, hit in re.findall(r"agent-sessions:4 / placement (.+?): hit rate ([0-9.]+)", log)
    }
    assert set(tried) == {placement.label for placement in candidates([f"s{n}" for n in range(4)], 2)}
    (row,) = [row for row in read_json(out / "results.json") if row.target == BEST_PLACEMENT_TARGET]
    assert row.placement in tried and row.requests == 24 and row.errors == 0  # run once: it is deterministic
    assert row.hit_rate_observed == pytest.approx(max(tried.values()), abs=5e-4)
    assert row.of_bound_fleet is not None and 0.0 < row.of_bound_fleet <= 1.0


def test_the_search_says_why_it_did_not_run() -> None:
    settings = bench.RunSettings(speedup=1.0, max_in_flight=64, time_scale=1.0)
    (sessions,) = make_workloads("agent-sessions:2", WorkloadOptions(limit=4, model="sim"))
    wall_clock = asyncio.run(bench._best_placement(sessions, SimFleet(SimSpec()), settings, None, None))
    assert (wall_clock.target, wall_clock.status) == (BEST_PLACEMENT_TARGET, "virtual time only")
    anonymous = Workload("anonymous", "test", [WorkloadRequest(0.0, "/v1/completions", {"prompt": "x"})])
    virtual = asyncio.run(bench._best_placement(anonymous, VirtualFleet(SimSpec()), settings, None, None))
    assert virtual.status == "no session ids" and virtual.requests == 0
