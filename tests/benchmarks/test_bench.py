"""``kvroute bench`` on a tiny fleet: real sim engines, a real router, the results schema."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvroute.benchmarks import bench
from kvroute.benchmarks.fleet import WHOLE_ENGINE, ExternalFleet, SimFleet, SimSpec
from kvroute.benchmarks.replay import replay
from kvroute.benchmarks.results import TargetResult, read_json
from kvroute.benchmarks.workloads import WorkloadOptions, make_workloads
from tests.paths import SHARED

TRACE = SHARED / "traces" / "mooncake_conversation_trace.jsonl"

REQUIRED_KEYS = {
    "target",
    "workload",
    "requests",
    "errors",
    "hit_rate_observed",
    "hit_rate_predicted",
    "ttft_p50_s",
    "ttft_p99_s",
    "throughput_rps",
    "backend_share",
    "bound_fleet",
    "pooled_lru",
    "of_bound_fleet",
    "fleet_capacity_blocks",
}


def test_results_schema_on_a_tiny_replay(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    workloads = ["--workload", "system-prompt"]
    if TRACE.exists():
        workloads += ["--workload", f"mooncake:{TRACE}"]
    code = bench.main(
        [
            "--engine",
            "sim",
            "--replicas",
            "2",
            "--time-scale",
            "20",
            *workloads,
            "--users",
            "2",
            "--turns",
            "2",
            "--system-tokens",
            "600",
            "--limit",
            "5",
            "--policies",
            "round_robin",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "round_robin" in printed and "bound" in printed

    raw = json.loads((out / "results.json").read_text())
    assert isinstance(raw, list) and raw
    for item in raw:
        assert REQUIRED_KEYS <= set(item)
    results = read_json(out / "results.json")
    names = {result.workload for result in results}
    assert "system-prompt" in names
    for result in results:
        assert result.status == "ok"
        assert result.target in {"bound", "bound_fleet", "pooled_lru", "round_robin"}
        assert 0.0 <= result.hit_rate_observed <= 1.0
        assert result.fleet_capacity_blocks == 2 * 65536 // 16
        # every row, offline or served, is measured against the pooled optimum
        assert result.of_bound_fleet == pytest.approx(result.hit_rate_observed / result.bound_fleet)
        assert result.pooled_lru <= result.bound_fleet
        if result.target != "round_robin":
            continue
        assert result.requests == (4 if result.workload == "system-prompt" else 5)
        assert result.errors == 0
        assert 0 < result.ttft_p50_s <= result.ttft_p99_s
        assert result.throughput_rps > 0
        assert len(result.backend_share) == 2
        assert sum(share.requests for share in result.backend_share.values()) == pytest.approx(1)
        assert sum(s.prompt_tokens for s in result.backend_share.values()) == pytest.approx(1)
        # round robin over 2 engines: each engine got half of the requests, give or take one
        for share in result.backend_share.values():
            assert abs(share.requests * result.requests - result.requests / 2) <= 1
    bound = {r.workload: r.hit_rate_observed for r in results if r.target == "bound"}
    assert bound["system-prompt"] > 0.3  # the shared system prompt and the first turns
    header = next(line for line in printed.splitlines() if line.startswith("workload"))
    assert "of bound_fleet" in header
    assert (out / "summary.png").stat().st_size > 10_000


async def test_replay_reports_ttft_usage_and_session_order() -> None:
    fleet = SimFleet(SimSpec(replicas=1, time_scale=20, kv_capacity_tokens=32768))
    (workload,) = make_workloads("system-prompt", WorkloadOptions(users=2, turns=3, system_tokens=400))
    try:
        await fleet.fresh()
        run = await replay(fleet.urls[0], workload.requests, speedup=20)
    finally:
        fleet.stop()
    assert run.errors == 0 and run.completed == 6
    for request, record in zip(workload.requests, run.records):
        assert record.status == 200
        assert 0 < record.ttft_s <= record.latency_s
        assert record.prompt_tokens > 400
        if request.turn > 0:  # the previous turn of the same session is cached
            assert record.cached_tokens > 400
    by_session: dict[str, list] = {}
    for request, record in zip(workload.requests, run.records):
        by_session.setdefault(request.session_id, []).append(record)
    for records in by_session.values():
        for earlier, later in itertools.pairwise(records):
            assert later.sent_s >= earlier.sent_s + earlier.latency_s - 1e-6


def test_a_missing_peer_is_reported_not_run(capsys: pytest.CaptureFixture) -> None:
    result = bench._not_run("peer:nothing", make_workloads("system-prompt", WorkloadOptions())[0], "not installed")
    assert isinstance(result, TargetResult) and result.status == "not installed"
    code = bench.main(["--policies", "no_such_policy"])
    assert code == 2
    assert "unknown policies" in capsys.readouterr().err


def test_overhead_compares_a_router_with_direct(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    code = bench.main(
        [
            "--overhead",
            "--policies",
            "round_robin",
            "--peers",
            "none",
            "--rounds",
            "1",
            "--seconds",
            "0.5",
            "--concurrency",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    measured = json.loads(out.read_text())
    closed = {row["target"]: row for row in measured if row["mode"] == "closed"}
    at_rate = {row["target"]: row for row in measured if row["mode"] == "rate"}
    assert set(closed) == set(at_rate) == {"direct", "round_robin"}
    assert closed["direct"]["router_cpu_us_per_request"] is None
    assert closed["round_robin"]["router_cpu_us_per_request"] > 0
    assert closed["round_robin"]["added_p50_ms"] is not None
    # The fixed rate is half the router's closed-loop throughput, offered to every target.
    offered = at_rate["direct"]["offered_per_s"]
    assert offered == at_rate["round_robin"]["offered_per_s"]
    assert offered == pytest.approx(closed["round_robin"]["requests_per_s"] / 2)
    assert at_rate["round_robin"]["router_cpu_us_per_request"] > 0
    assert all(row["errors"] == 0 and row["requests_per_s"] > 0 for row in measured)


def test_new_words_make_every_body_new_and_keep_it_a_chat() -> None:
    from kvroute.benchmarks.overhead import NewWords, chat_bodies

    bodies = chat_bodies(512, system_prompts=2, per_prompt=2)
    fresh = NewWords(bodies, 5)
    sent = [fresh() for _ in range(12)]
    assert len(set(sent)) == 12
    for number, body in enumerate(sent):
        request, base = json.loads(body), json.loads(bodies[number % len(bodies)])
        added = request["messages"][1]["content"].removeprefix(base["messages"][1]["content"])
        assert added.endswith(f" #{number}") and len(added.split()) == 6
        assert request["messages"][0] == base["messages"][0] and request["model"] == base["model"]


@pytest.mark.parametrize("bodies", [["--new-words", "12"], ["--bodies", "agent"]], ids=["new-words", "agent"])
def test_overhead_sends_its_bodies_to_a_cache_aware_router(tmp_path: Path, bodies: list[str]) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--overhead", "--policies", "cache_aware", "--peers", "none", "--rounds", "1", "--seconds", "0.5"]
    argv += ["--concurrency", "4", *bodies, "--out", str(out)]
    assert bench.main(argv) == 0
    measured = json.loads(out.read_text())
    assert {row["target"] for row in measured} == {"direct", "cache_aware"}
    assert all(row["errors"] == 0 and row["requests_per_s"] > 0 for row in measured)


def test_agent_bodies_are_distinct_tool_call_conversations_new_words_extend() -> None:
    from kvroute.benchmarks.overhead import AGENT_MESSAGES, AGENT_TOOLS, NewWords, agent_bodies

    bodies = agent_bodies(system_prompts=2, per_prompt=6)
    chats = [json.loads(body)["messages"] for body in bodies]
    assert len(set(bodies)) == 12 and sorted({len(chat) for chat in chats}) == list(AGENT_MESSAGES)
    for chat in chats:
        calls = [message for message in chat if message["role"] == "assistant"]
        results = [message for message in chat if message["role"] == "tool"]
        assert [call["tool_calls"][0]["id"] for call in calls] == [result["tool_call_id"] for result in results]
        assert all(json.loads(call["tool_calls"][0]["function"]["arguments"])["path"] for call in calls)
    extended = json.loads(NewWords(bodies, 3)())["messages"]
    assert extended[:-1] == chats[0][:-1] and extended[-1]["content"].endswith(" #0")
    offering = agent_bodies(system_prompts=2, per_prompt=6, tools=True)
    assert all(json.loads(body)["tools"] == AGENT_TOOLS for body in offering)
    assert [json.loads(body)["messages"] for body in offering] == chats
    assert json.loads(NewWords(offering, 3)())["messages"] == extended


def test_overhead_pairs_each_target_with_its_baseline_round_by_round() -> None:
    from kvroute.benchmarks.overhead import OverheadRow, baseline_pairs, format_rows

    def row(target: str, mode: str, cpus: list[float | None]) -> OverheadRow:
        return OverheadRow(
            target=target,
            mode=mode,
            concurrency=32 if mode == "closed" else None,
            offered_per_s=500.0 if mode == "rate" else None,
            requests_per_s=1000.0,
            latency_p50_ms=1.0,
            latency_p99_ms=2.0,
            added_p50_ms=None,
            added_p99_ms=None,
            router_cpu_us_per_request=None,
            errors=0,
            cpu_us_per_request_rounds=cpus,
        )

    rows = [
        row("direct", "closed", [None, None, None]),
        # Rounds drift together (200 -> 400 us): the ratio does not.
        row("round_robin", "closed", [180.0, 270.0, 360.0]),
        row("round_robin@baseline", "closed", [200.0, 300.0, 400.0]),
        row("round_robin", "rate", [500.0, None]),
        row("round_robin@baseline", "rate", [400.0, 450.0]),
    ]
    closed, at_rate = baseline_pairs(rows)
    assert (closed.target, closed.mode, closed.load) == ("round_robin", "closed", 32.0)
    assert closed.ratios == pytest.approx([0.9, 0.9, 0.9])
    assert (at_rate.mode, at_rate.load, at_rate.ratios) == ("rate", 500.0, [1.25])  # a round without CPU is left out
    assert "0.900 (0.900-0.900)" in format_rows(rows)


def test_paired_ab_loads_both_trees_at_once_and_reports_their_ratio(tmp_path: Path) -> None:
    from kvroute.benchmarks import paired_ab

    out = tmp_path / "paired.json"
    tree = Path(paired_ab.__file__).resolve().parents[1]  # this checkout, as its own baseline
    # 100 requests a side per round: several of /proc's 10 ms CPU ticks even on a quiet machine.
    args = ["--baseline", str(tree), "--rate", "50", "--rounds", "2", "--seconds", "2", "--out", str(out)]
    assert paired_ab.main(args) == 0
    measured = json.loads(out.read_text())
    summary = measured["summary"]
    assert summary["rounds"] == len(measured["rounds"]) == 2 and summary["errors"] == 0
    for item in measured["rounds"]:
        assert item["cpu_us"] > 0 and item["baseline_cpu_us"] > 0
        assert item["requests_per_s"] == pytest.approx(50, rel=0.3)
    low, high = summary["ratio_range"]
    assert 0 < low <= summary["ratio_median"] <= high


def test_a_paired_round_without_a_cpu_reading_has_no_ratio_and_is_left_out() -> None:
    from kvroute.benchmarks.paired_ab import PairedRound, summarize

    rounds = [PairedRound(660.0, 0.0, 50.0, 50.0, 0), PairedRound(500.0, 400.0, 50.0, 50.0, 0)]
    assert math.isnan(rounds[0].ratio)
    summary = summarize("cache_aware", 50.0, 0.6, rounds)
    assert (summary.rounds, summary.ratio_median, summary.rounds_cheaper) == (2, 1.25, 0)


def test_server_floor_measures_every_server_answering(tmp_path: Path) -> None:
    from kvroute.benchmarks import server_floor

    out = tmp_path / "floor.json"
    assert server_floor.main(["--rounds", "1", "--seconds", "0.5", "--out", str(out)]) == 0
    rows = {row["server"]: row for row in json.loads(out.read_text())}
    # uvicorn is measured where it is installed; kvroute does not depend on it.
    assert set(rows) == {kind for kind in server_floor.SERVERS if server_floor.installed(kind)}
    assert {"aiohttp-app", "aiohttp-direct", "httptools"} <= set(rows)
    for row in rows.values():
        assert row["errors"] == 0 and row["requests_per_s"] > 0 and row["cpu_us_per_request"] > 0


async def test_replay_waits_each_think_time_after_the_answer_scaled_by_speedup() -> None:
    fleet = SimFleet(SimSpec(replicas=1, time_scale=20, kv_capacity_tokens=32768))
    options = WorkloadOptions(conversations=2, turns=3, user_tokens=60, reply_tokens=40)
    (workload,) = make_workloads("multi-turn+think=4", options)
    speedup = 20.0
    try:
        await fleet.fresh()
        run = await replay(fleet.urls[0], workload.requests, speedup=speedup)
    finally:
        fleet.stop()
    assert run.errors == 0
    waits = []
    by_session: dict[str, list] = {}
    for request, record in zip(workload.requests, run.records):
        by_session.setdefault(request.session_id, []).append((request, record))
    for turns in by_session.values():
        for (_, earlier), (request, later) in itertools.pairwise(turns):
            answered = earlier.sent_s + earlier.latency_s
            assert later.sent_s >= answered + request.think_s / speedup - 1e-3
            waits.append(later.sent_s - answered)
    # think times of mean 4 s at 20x: waits of ~0.2 s wall, not back-to-back turns
    assert len(waits) == 4 and sum(waits) > 0.2


async def test_a_real_engine_never_beats_the_pooled_bound_over_its_sent_order() -> None:
    """One sim replica whose cache holds ~2 of 6 agent sessions: what it really kept is at
    most bound_fleet over the order the replay sent, and LRU (its own rule) is below it."""
    capacity_tokens = 4096
    fleet = SimFleet(SimSpec(replicas=1, time_scale=20, kv_capacity_tokens=capacity_tokens))
    options = WorkloadOptions(agent_turns=4, agent_scale=0.04, max_output_tokens=4)
    (workload,) = make_workloads("agent-sessions:6+think=0.5", options)
    prompts = bench.workload_prompts(workload, fleet.block_size, None)
    settings = bench.RunSettings(speedup=20, max_in_flight=256, time_scale=20)
    try:
        result = await bench.run_target("round_robin", workload, fleet, settings, None, prompts=prompts)
    finally:
        fleet.stop()
    assert result.errors == 0
    (unbounded,) = [r for r in bench.offline_rows(workload, prompts, None) if r.target == "bound"]
    assert result.fleet_capacity_blocks == capacity_tokens // 16
    assert result.pooled_lru < result.bound_fleet < unbounded.hit_rate_observed  # it binds
    assert result.hit_rate_observed <= result.bound_fleet
    assert result.of_bound_fleet == pytest.approx(result.hit_rate_observed / result.bound_fleet)


def test_settings_sweep_and_repeats_label_every_row(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    code = bench.main(
        [
            "--engine",
            "sim",
            "--replicas",
            "2",
            "--workload",
            "system-prompt",
            "--users",
            "2",
            "--turns",
            "2",
            "--system-tokens",
            "300",
            "--policies",
            "round_robin",
            "--sweep-time-scale",
            "20,40",
            "--repeat",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "median [min-max] over the runs" in printed
    results = read_json(out / "results.json")
    served = [(r.setting, r.repeat) for r in results if r.target == "round_robin"]
    assert sorted(served) == [
        ("time-scale=20 prefill=20000", 0),
        ("time-scale=20 prefill=20000", 1),
        ("time-scale=40 prefill=20000", 0),
        ("time-scale=40 prefill=20000", 1),
    ]
    assert {r.time_scale for r in results if r.target == "round_robin"} == {20.0, 40.0}
    offline = [r.setting for r in results if r.target == "bound_fleet"]
    assert sorted(offline) == ["time-scale=20 prefill=20000", "time-scale=40 prefill=20000"]


async def test_replay_over_several_urls_takes_them_in_turn() -> None:
    """Router replicas behind a client-side round robin: request k goes to URL k mod N."""
    from kvroute.benchmarks.fleet import engine_counters

    fleet = SimFleet(SimSpec(replicas=2, time_scale=20, kv_capacity_tokens=32768))
    (workload,) = make_workloads("system-prompt", WorkloadOptions(users=2, turns=3, system_tokens=400))
    try:
        await fleet.fresh()
        run = await replay(fleet.urls, workload.requests, speedup=20)
        counters = await engine_counters(fleet.urls)
    finally:
        fleet.stop()
    assert run.errors == 0 and run.completed == 6
    assert [counters[url].requests for url in fleet.urls] == [3, 3]


async def test_data_parallel_engines_run_each_policy_to_the_ranks_and_to_the_whole() -> None:
    """``--data-parallel-size 2``: ``POLICY`` routes to each engine's two ranks (backends
    ``URL#dp0`` and ``URL#dp1``), ``POLICY@whole-engine`` to the engine as one backend; the
    fleet's capacity counts every rank. (A sim has no ranks: it serves both names alike.)"""
    sims = SimFleet(SimSpec(replicas=1, time_scale=20, kv_capacity_tokens=4096))
    options = WorkloadOptions(agent_turns=2, agent_scale=0.04, max_output_tokens=4)
    (workload,) = make_workloads("agent-sessions:4", options)
    settings = bench.RunSettings(speedup=20, max_in_flight=256, time_scale=20)
    backends: dict[str, list[str]] = {}

    def names(target: str) -> Callable[[str], None]:
        def seen(router_url: str) -> None:
            page = httpx.get(router_url + "/metrics", timeout=10).text
            backends[target] = sorted(re.findall(r'kvroute_backend_healthy\{backend="([^"]+)"\} 1\.0', page))

        return seen

    try:
        await sims.fresh()
        fleet = ExternalFleet(sims.urls, capacity_tokens=4096, data_parallel_size=2)
        assert bench.fleet_capacity_blocks(fleet) == 2 * 4096 // 16
        prompts = bench.workload_prompts(workload, fleet.block_size, None)
        for target in ("round_robin", "round_robin" + WHOLE_ENGINE):
            result = await bench.run_target(target, workload, fleet, settings, None, names(target), prompts)
            assert result.errors == 0
            assert result.hit_rate_predicted is None  # a load-only policy, whole engine or not
    finally:
        sims.stop()
    (url,) = sims.urls
    assert backends == {"round_robin": [url + "#dp0", url + "#dp1"], "round_robin" + WHOLE_ENGINE: [url]}
