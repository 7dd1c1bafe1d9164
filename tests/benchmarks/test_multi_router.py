"""The several-routers benchmark: its arrangements (one router, then per count N > 1 N
routers alone, N exchanging routers and one router with N workers, in either index mode),
and a precise arrangement run for real on evented sims."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvroute.benchmarks import multi_router
from kvroute.benchmarks.bench import RunSettings
from kvroute.benchmarks.fleet import FleetError, KVEventEndpoints, SimFleet, SimSpec
from kvroute.benchmarks.multi_router import Arrangement, arrangements, run_one
from kvroute.benchmarks.workloads import WorkloadOptions, make_workloads
from tests.servers import SimServer

#: Sims at 20x real time, replayed at the same pace.
SETTINGS = RunSettings(speedup=20, max_in_flight=64, time_scale=20)


def test_arrangements_per_router_count() -> None:
    assert [a.name for a in arrangements([1, 2])] == [
        "one router",
        "2 routers, approximate",
        "2 routers, exchange",
        "one router, --workers 2",
    ]
    assert Arrangement(4, "workers").name == "one router, --workers 4"
    assert [a.name for a in arrangements([1, 2], modes=["exchange", "relay"])] == [
        "one router",
        "2 routers, exchange",
        "2 routers of 2 workers, exchange",
    ]


def test_precise_arrangements_follow_the_approximate_ones_and_compare_with_one_precise_router() -> None:
    names = [a.name for a in arrangements([1, 2], ["approximate", "precise"])]
    assert names[4:] == [
        "one router, precise",
        "2 routers, alone, precise",
        "2 routers, exchange, precise",
        "one router, --workers 2, precise",
    ]
    assert Arrangement(2, "exchange", precise=True).single == Arrangement(1, "approximate", precise=True)
    assert Arrangement(2, "exchange").single.name == "one router"


async def test_two_precise_routers_read_the_sims_events_through_a_run() -> None:
    """Sims that publish KV events, two exchanging routers in precise mode (each backend's
    endpoints in flags): the run completes and, at its end, both still read every engine's
    events (``run_one`` raises otherwise); the shared system prompt is served from cache."""
    fleet = SimFleet(SimSpec(replicas=2, time_scale=20, kv_capacity_tokens=32768, kv_events=True))
    assert set(fleet.kv_events) == set(fleet.urls)
    (workload,) = make_workloads("system-prompt", WorkloadOptions(users=4, turns=3, system_tokens=400))
    try:
        hit_rate, ttft_p99_s = await run_one(Arrangement(2, "exchange", precise=True), workload, fleet, SETTINGS, None)
    finally:
        fleet.stop()
    assert hit_rate > 0.3 and ttft_p99_s > 0


async def test_a_router_without_the_events_fails_the_precise_check() -> None:
    """Sims that publish no events: a router told to read them stays approximate, and the
    benchmark says so rather than report its run as precise."""
    fleet = SimFleet(SimSpec(replicas=1, time_scale=20, kv_capacity_tokens=32768))
    (workload,) = make_workloads("system-prompt", WorkloadOptions(users=2, turns=2, system_tokens=200))
    fleet.kv_events = {url: KVEventEndpoints("tcp://127.0.0.1:1") for url in fleet.urls}
    try:
        with pytest.raises(FleetError, match="not precise"):
            await run_one(Arrangement(1, "approximate", precise=True), workload, fleet, SETTINGS, None)
    finally:
        fleet.stop()


def test_precise_over_external_engines_needs_their_endpoints(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        multi_router.main(["--index", "precise", "--engine", "http://127.0.0.1:1,http://127.0.0.1:2"])
    assert exit_.value.code == 2
    assert "--kv-events-endpoints" in capsys.readouterr().err


def test_refused_runs_are_counted_and_the_series_goes_on(
    sim_engines: Callable[..., list[SimServer]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Engines whose events no router can read: every precise run is refused, each with its
    reason on stderr, the series runs every round anyway, the table and JSON count the
    refusals, and the exit status says an arrangement has no figures."""
    (sim,) = sim_engines(1, time_scale=20)
    code = multi_router.main(
        [
            *("--engine", sim.url, "--index", "precise", "--routers", "1", "--repeat", "2"),
            *("--kv-events-endpoints", "tcp://127.0.0.1:1", "--workload", "system-prompt", "--users", "2"),
            *("--turns", "2", "--system-tokens", "200", "--out", str(tmp_path)),
        ]
    )
    output = capsys.readouterr()
    assert code == 1
    assert output.err.count("one router, precise: refused") == 2
    assert "| system-prompt | one router, precise (2 of 2 refused) | — |" in output.out
    [row] = orjson.loads((tmp_path / "multi_router.json").read_bytes())
    assert (row["refused"], row["hit_rates"], row["hit_rate"]) == (2, [], None)
