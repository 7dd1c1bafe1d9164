"""The fault-injection fleet: sim-engine subprocesses behind a ``kvroute serve`` subprocess.

One fleet per test module (starting processes costs seconds on a 2-core machine); each
scenario leaves it as it found it: every engine up, healthy, in the pool, without faults,
and nothing in flight. Processes are real: an engine can be SIGKILLed, restarted on its
port, or kept down so that its port refuses connections; the router is driven through
its admin API and read through its ``/metrics``, as an operator would.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from kvroute.benchmarks.fleet import ManagedProcess, SimSpec, free_port, scrape, start_router
from kvroute.benchmarks.steady_load import Tally, format_table

ADMIN_TOKEN = "fault-suite-admin-token"
# Router settings that make faults show quickly (the defaults suit production, not CI).
ROUTER_FLAGS = (
    "--admin-token",
    ADMIN_TOKEN,
    "--health-interval-s",
    "0.3",
    "--health-timeout-s",
    "1",
    "--unhealthy-after",
    "2",
    "--healthy-after",
    "1",
    "--connect-timeout-s",
    "1",
    "--first-byte-timeout-s",
    "2",
    "--idle-timeout-s",
    "1.5",
    "--breaker-failures",
    "3",
    "--breaker-cooldown-s",
    "1",
    "--drain-timeout-s",
    "5",
    "--engine-scrape-interval-s",
    "0.5",
)
# Slow enough that a fault lands on streams in the middle of their tokens.
SIM = SimSpec(replicas=3, time_scale=4.0, decode_tokens_per_s=50.0, kv_capacity_tokens=32768)


@dataclass
class Engine:
    """One sim-engine subprocess and the port it keeps across restarts."""

    number: int
    port: int
    process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.process is not None and self.process.process.poll() is None

    async def start(self) -> None:
        self.process = ManagedProcess(f"sim-{self.number}", SIM.argv(self.port), self.url)
        await self.process.wait_ready()

    def kill(self) -> None:
        """SIGKILL: no goodbye, open connections reset."""
        if self.process is not None:
            self.process.process.kill()
            self.process.process.wait(10)
            self.process.stop()  # reaps the group and removes the log
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


@dataclass
class Fleet:
    """The engines, the router, and the questions the scenarios ask them."""

    engines: list[Engine]
    spare: Engine  # running, but not in the router's pool until a scenario adds it
    router: ManagedProcess

    @property
    def url(self) -> str:
        return self.router.url

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def set_fault(self, engine: Engine, mode: str, count: int | None = None) -> None:
        async with (
            aiohttp.ClientSession() as client,
            client.post(engine.url + "/sim/fault", json={"mode": mode, "count": count}) as response,
        ):
            response.raise_for_status()

    async def backends(self) -> dict[str, dict[str, Any]]:
        """The router's admin view: url -> state."""
        async with (
            aiohttp.ClientSession() as client,
            client.get(self.url + "/admin/backends", headers=self.admin_headers()) as response,
        ):
            response.raise_for_status()
            payload = await response.json()
        return {state["url"]: state for state in payload["backends"]}

    async def admin(self, method: str, path: str, payload: dict[str, Any]) -> int:
        async with (
            aiohttp.ClientSession() as client,
            client.request(method, self.url + path, json=payload, headers=self.admin_headers()) as response,
        ):
            await response.read()
            return response.status

    async def router_samples(self) -> dict[str, float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            return await scrape(client, self.url + "/metrics")

    async def engine_busy(self, engine: Engine) -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            samples = await scrape(client, engine.url + "/metrics")
        return samples.get("vllm:num_requests_running", 0.0) + samples.get("vllm:num_requests_waiting", 0.0)

    async def engine_served(self, engine: Engine) -> int:
        async with aiohttp.ClientSession() as client, client.get(engine.url + "/sim/stats") as response:
            return int((await response.json())["requests_served"])

    async def wait_quiet(self, timeout_s: float = 20.0) -> None:
        """Until nothing is in flight: the router's counters and every running engine's."""
        deadline = time.monotonic() + timeout_s
        while True:
            router = (await self.router_samples()).get("kvroute_backend_in_flight_requests", 0.0)
            engines = [await self.engine_busy(e) for e in [*self.engines, self.spare] if e.up]
            if router == 0 and not any(engines):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"still in flight after {timeout_s} s: router {router}, engines {engines}")
            await asyncio.sleep(0.2)

    async def wait_serving(self, engines: list[Engine], timeout_s: float = 20.0) -> None:
        """Until exactly these engines are in the pool, healthy, with closed breakers."""
        wanted = {engine.url for engine in engines}
        deadline = time.monotonic() + timeout_s
        while True:
            states = await self.backends()
            ready = {
                url for url, s in states.items() if s["healthy"] and s["breaker"] == "closed" and not s["draining"]
            }
            if ready == wanted and set(states) == wanted:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pool not back to {sorted(wanted)} after {timeout_s} s: {states}")
            await asyncio.sleep(0.2)


async def _start_fleet() -> Fleet:
    engines = [Engine(number, free_port()) for number in range(SIM.replicas)]
    spare = Engine(SIM.replicas, free_port())
    started: list[Engine] = []
    try:
        for engine in [*engines, spare]:
            await engine.start()
            started.append(engine)
        router = await start_router("cache_aware", [e.url for e in engines], extra_args=ROUTER_FLAGS)
    except BaseException:
        for engine in started:
            engine.stop()
        raise
    return Fleet(engines=engines, spare=spare, router=router)


#: (scenario, tally) of every scenario run in this session, for the summary table.
RESULTS: list[tuple[str, Tally]] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the per-fault table (and write it as JSON to ``$KVROUTE_FAULTS_REPORT`` when set)."""
    if not RESULTS:
        return
    terminalreporter.section("kvroute fault injection: every request accounted for")
    for line in format_table(RESULTS).splitlines():
        terminalreporter.write_line(line)
    report_path = os.environ.get("KVROUTE_FAULTS_REPORT")
    if report_path:
        with open(report_path, "w") as handle:
            json.dump({name: tally.as_dict() for name, tally in RESULTS}, handle, indent=2)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """The module's fleet, stopped (every process group) when its tests are done."""
    fleet = asyncio.run(_start_fleet())
    try:
        yield fleet
    finally:
        fleet.router.stop()
        for engine in [*fleet.engines, fleet.spare]:
            engine.stop()
