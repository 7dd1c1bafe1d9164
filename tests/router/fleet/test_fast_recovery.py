"""Fast recovery: engines that come up (or back) after the router serve within a second.

The router runs with the production health interval (10 s); without fast probing of
unhealthy backends, the engines below would wait that long before their first request.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from aiohttp import web

from kvroute.router.fleet.probe_schedule import ProbeSchedule
from tests.servers import RouterServer, ServerLoop, SimServer

MESSAGES = [{"role": "user", "content": "Are you there?"}]
HEALTH_INTERVAL_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def first_served(router: RouterServer, wanted: set[str], deadline_s: float) -> dict[str, float]:
    """Send chat requests until each of ``wanted`` served one or ``deadline_s`` passed.

    Returns when (``time.monotonic()``) each backend served its first request."""
    client = router.client()
    deadline = time.monotonic() + deadline_s
    served: dict[str, float] = {}
    while served.keys() != wanted and time.monotonic() < deadline:
        try:
            response = client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2)
        except openai.APIStatusError as error:  # 503 while no backend is healthy yet
            assert error.status_code == 503, error
            time.sleep(0.01)
            continue
        assert response.parse().choices
        served.setdefault(response.headers["x-kvroute-backend"], time.monotonic())
    return served


@contextmanager
def engines_not_listening_yet(
    server_loop: ServerLoop, sim_tokenizer: Any, ports: list[int]
) -> Iterator[Callable[[], float]]:
    """Simulated engines built and ready but not listening; the yielded function opens
    their ports together (an engine's start, as the router sees it) and returns when."""
    from kvroute.benchmarks.sim_engine.config import SimEngineConfig
    from kvroute.benchmarks.sim_engine.server import build_app

    runners = [
        web.AppRunner(build_app(SimEngineConfig(port=port, time_scale=1000.0), sim_tokenizer), access_log=None)
        for port in ports
    ]
    for runner in runners:
        server_loop.run(runner.setup())

    async def listen() -> None:
        sites = [web.TCPSite(runner, "127.0.0.1", port) for runner, port in zip(runners, ports, strict=True)]
        await asyncio.gather(*(site.start() for site in sites))

    def open_ports() -> float:
        server_loop.run(listen())
        return time.monotonic()

    try:
        yield open_ports
    finally:
        for runner in runners:
            server_loop.run(runner.cleanup())


def test_engines_started_after_the_router_serve_within_a_second(
    router_server: Callable[..., RouterServer], server_loop: ServerLoop, sim_tokenizer: Any
) -> None:
    ports = [free_port(), free_port()]
    urls = {f"http://127.0.0.1:{port}" for port in ports}
    with engines_not_listening_yet(server_loop, sim_tokenizer, ports) as open_ports:
        router = router_server(sorted(urls), health_interval_s=HEALTH_INTERVAL_S)
        started = time.monotonic()
        assert router.state.pool.healthy_count() == 0
        router.client()  # built now, not while the engines are being timed
        time.sleep(max(0.0, started + 0.5 - time.monotonic()))
        up = open_ports()
        served = first_served(router, urls, deadline_s=5.0)
    delays = {url: round(at - up, 3) for url, at in served.items()}
    print(f"engines up {up - started:.3f} s after the router; first request served after: {delays}")
    assert served.keys() == urls
    assert max(delays.values()) < 1.0


def test_an_engine_marked_unhealthy_serves_again_within_a_second_of_its_return(
    sim_engines: Callable[..., list[SimServer]],
    router_server: Callable[..., RouterServer],
    server_loop: ServerLoop,
    sim_tokenizer: Any,
) -> None:
    (engine,) = sim_engines(1)
    port = int(engine.url.rsplit(":", 1)[1])
    router = router_server([engine], health_interval_s=HEALTH_INTERVAL_S, unhealthy_after=1, healthy_after=2)
    backend = router.state.pool.get(engine.url)
    assert backend is not None and backend.healthy
    engine.stop()
    with engines_not_listening_yet(server_loop, sim_tokenizer, [port]) as open_port:
        server_loop.run(router.state.health.check_all())
        assert not backend.healthy
        # A restart: back within the first steps of the fast probes (0.25 s, then 0.5 s
        # later); an engine back later is found within its current step (up to the interval).
        time.sleep(0.1)
        back = open_port()
        served = first_served(router, {engine.url}, deadline_s=5.0)
    assert served.keys() == {engine.url}
    print(f"the engine served again {served[engine.url] - back:.3f} s after it was back")
    # It had answered before, so healthy_after (2 passing checks) still applies, quickly.
    assert served[engine.url] - back < 1.0


# --- the schedule itself ------------------------------------------------------------------
def probe_times(schedule: ProbeSchedule, url: str, results: list[tuple[bool, bool]]) -> list[float]:
    """Run the probes the schedule asks for, answering with ``(passed, healthy)`` in turn."""
    now = 0.0
    times = []
    for passed, healthy in results:
        now = schedule.next_due() or 0.0
        assert schedule.due(now) == [url]
        schedule.started(url)
        assert schedule.due(now) == [] and schedule.next_due() is None  # no second probe while one runs
        schedule.probed(url, passed=passed, healthy=healthy, now=now)
        times.append(now)
    return times


def test_an_unhealthy_backend_is_retried_at_doubling_intervals_up_to_the_normal_one() -> None:
    schedule = ProbeSchedule(interval_s=5.0)
    schedule.track("http://a", healthy=False, now=0.0)
    times = probe_times(schedule, "http://a", [(False, False)] * 7)
    assert times == [0.25, 0.75, 1.75, 3.75, 7.75, 12.75, 17.75]


def test_a_passing_check_of_a_still_unhealthy_backend_is_confirmed_fast() -> None:
    schedule = ProbeSchedule(interval_s=5.0)
    schedule.track("http://a", healthy=False, now=0.0)
    # Fails three times, passes (healthy_after not reached yet), passes again (healthy).
    times = probe_times(schedule, "http://a", [(False, False)] * 3 + [(True, False), (True, True), (True, True)])
    assert times == [0.25, 0.75, 1.75, 3.75, 4.0, 9.0]


def test_a_healthy_backend_falling_ill_between_probes_is_retried_fast() -> None:
    schedule = ProbeSchedule(interval_s=10.0)
    schedule.track("http://a", healthy=True, now=0.0)
    assert schedule.next_due() == 10.0
    schedule.track("http://a", healthy=True, now=3.0)  # nothing changed: the plan stays
    assert schedule.next_due() == 10.0
    schedule.track("http://a", healthy=False, now=4.0)  # passive failures marked it unhealthy
    assert schedule.next_due() == 4.25
    schedule.track("http://a", healthy=False, now=4.1)  # already planned fast: not pushed back
    assert schedule.next_due() == 4.25


def test_backends_that_leave_are_forgotten() -> None:
    schedule = ProbeSchedule(interval_s=1.0)
    schedule.track("http://a", healthy=True, now=0.0)
    schedule.track("http://b", healthy=False, now=0.0)
    schedule.retain(["http://a"])
    assert schedule.due(100.0) == ["http://a"]
    schedule.probed("http://b", passed=True, healthy=True, now=1.0)  # a probe that outlived it
    assert schedule.due(100.0) == ["http://a"]


def test_the_first_retry_never_exceeds_the_interval() -> None:
    schedule = ProbeSchedule(interval_s=0.1)
    schedule.track("http://a", healthy=False, now=0.0)
    assert schedule.next_due() == pytest.approx(0.1)
