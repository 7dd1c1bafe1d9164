"""Faults under steady load: every request is answered or fails with a clear error; none is lost.

Each scenario runs :class:`~kvroute.benchmarks.steady_load.SteadyLoad` (8 ``openai`` SDK clients:
streaming, non-streaming, and streams whose client hangs up) against the router while one
fault happens, then requires:

* **0 lost** requests (no answer, hung, truncated without an error, non-JSON error);
* **0 failed before their first byte**: a request that failed before anything reached
  its client had a healthy alternative (only one engine misbehaves at a time), so the
  router must have retried it there. The only errors a client may see are on streams
  cut after their first chunk, whose engine died or wedged mid-answer;
* **nothing left in flight**: the router's ``kvroute_backend_in_flight_requests`` and
  every engine's running + waiting requests return to 0.

The per-fault table (sent / completed / failed with error / lost) is printed at the end
of the run; ``KVROUTE_FAULTS_REPORT=path.json`` also writes it as JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import openai
import pytest

from kvroute.benchmarks.steady_load import SteadyLoad, Tally
from tests.faults.conftest import RESULTS, Fleet

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

CONCURRENCY = 8
WARM_UP_S = 0.5


async def under_load(fleet: Fleet, name: str, fault: Callable[[], Awaitable[None]], *, seed: int) -> Tally:
    """Run ``fault()`` while the clients send; account for every request; check the counters."""
    load = SteadyLoad(fleet.url, concurrency=CONCURRENCY, seed=seed, request_timeout_s=30.0)
    load.start()
    try:
        await asyncio.sleep(WARM_UP_S)
        await fault()
    finally:
        await load.stop()
        await load.close()
    tally = load.tally()
    RESULTS.append((name, tally))
    await fleet.wait_quiet()
    assert tally.sent >= 20, f"too little load to mean anything: {tally}"
    assert tally.lost == 0, f"lost requests: {dict(tally.lost_reasons)}"
    assert tally.failed_before_first_byte == 0, f"failed before the first byte: {dict(tally.failures)}"
    assert tally.completed > 0
    return tally


async def test_baseline(fleet: Fleet) -> None:
    tally = await under_load(fleet, "none (baseline)", lambda: asyncio.sleep(2.0), seed=1)
    assert tally.failed == 0


async def test_engine_sigkilled_then_restarted(fleet: Fleet) -> None:
    victim = fleet.engines[0]

    async def fault() -> None:
        await asyncio.sleep(1.0)
        victim.kill()
        await asyncio.sleep(2.0)  # the router finds out from failed requests and health checks
        assert not (await fleet.backends())[victim.url]["healthy"]
        await victim.start()
        await fleet.wait_serving(fleet.engines)
        await asyncio.sleep(1.0)

    tally = await under_load(fleet, "engine SIGKILL + restart", fault, seed=2)
    # Only streams that were mid-answer on the killed engine may fail, with an SSE error.
    assert all(detail.startswith("stream error") for detail in tally.failures), tally.failures


async def test_engine_refusing_connections(fleet: Fleet) -> None:
    victim = fleet.engines[1]
    victim.kill()  # idle: nothing was running there; its port now refuses connections

    async def fault() -> None:
        await asyncio.sleep(2.5)
        await victim.start()
        await fleet.wait_serving(fleet.engines)

    tally = await under_load(fleet, "connection refused", fault, seed=3)
    assert tally.failed == 0


@pytest.mark.parametrize(("mode", "count"), [("error_500", None), ("error_503", 6)])
async def test_engine_answering_5xx(fleet: Fleet, mode: str, count: int | None) -> None:
    victim = fleet.engines[1]
    trips_before = (await fleet.backends())[victim.url]["breaker_trips"]

    async def fault() -> None:
        await fleet.set_fault(victim, mode, count)
        await asyncio.sleep(2.5)
        await fleet.set_fault(victim, "none")
        await fleet.wait_serving(fleet.engines)

    tally = await under_load(fleet, f"{mode} ({'every request' if count is None else count})", fault, seed=4)
    assert tally.failed == 0
    if count is None:
        # /health kept saying 200: only the circuit breaker could take it out of rotation.
        assert (await fleet.backends())[victim.url]["breaker_trips"] > trips_before


async def test_engine_hanging_before_the_first_byte(fleet: Fleet) -> None:
    victim = fleet.engines[2]

    async def fault() -> None:
        await fleet.set_fault(victim, "hang_before_first_byte", 4)
        await asyncio.sleep(4.0)  # each hung request waits out the 2 s first-byte timeout
        await fleet.set_fault(victim, "none")
        await fleet.wait_serving(fleet.engines)

    tally = await under_load(fleet, "hang before first byte", fault, seed=5)
    assert tally.failed == 0


@pytest.mark.parametrize("mode", ["stall_mid_stream", "close_mid_stream"])
async def test_engine_breaking_off_mid_answer(fleet: Fleet, mode: str) -> None:
    victim = fleet.engines[0]

    async def fault() -> None:
        await fleet.set_fault(victim, mode, 6)
        await asyncio.sleep(3.5)
        await fleet.set_fault(victim, "none")
        await fleet.wait_serving(fleet.engines)

    tally = await under_load(fleet, mode.replace("_", " "), fault, seed=6)
    # Non-streaming answers had sent the client nothing yet: retried elsewhere. Streams
    # whose first chunk had gone out end with an SSE error event and [DONE].
    assert all(detail.startswith("stream error") for detail in tally.failures), tally.failures


async def test_backends_added_drained_and_removed_through_the_admin_api(fleet: Fleet) -> None:
    keep, drained, removed = fleet.engines
    spare = fleet.spare

    async def fault() -> None:
        assert await fleet.admin("POST", "/admin/backends", {"url": spare.url}) == 201
        await asyncio.sleep(1.0)
        assert await fleet.admin("POST", "/admin/backends/drain", {"url": drained.url}) == 202
        assert await fleet.admin("DELETE", "/admin/backends", {"url": removed.url}) == 200
        await fleet.wait_serving([keep, spare])  # the drained one left once its requests finished
        await asyncio.sleep(1.0)
        for engine in (drained, removed):
            assert await fleet.admin("POST", "/admin/backends", {"url": engine.url}) == 201
        assert await fleet.admin("POST", "/admin/backends/drain", {"url": spare.url}) == 202
        await fleet.wait_serving(fleet.engines)

    tally = await under_load(fleet, "admin add/drain/remove", fault, seed=7)
    assert tally.failed == 0
    assert await fleet.engine_served(spare) > 0


async def test_drain_lets_a_long_stream_finish_before_the_backend_leaves(fleet: Fleet) -> None:
    """A drained backend takes no new requests, finishes the ones it has, then leaves."""
    client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="drain-test", max_retries=0, timeout=60)
    stream = await client.chat.completions.with_raw_response.create(
        model="sim",
        messages=[{"role": "user", "content": "a long answer please"}],
        max_tokens=600,
        stream=True,
    )
    target = stream.headers["x-kvroute-backend"]
    engine = next(e for e in fleet.engines if e.url == target)
    chunks = 0
    finished = False
    drained_at = None
    async for chunk in stream.parse():
        chunks += 1
        if chunks == 3:
            assert await fleet.admin("POST", "/admin/backends/drain", {"url": target}) == 202
            drained_at = chunks
            state = (await fleet.backends())[target]
            assert state["draining"] and state["in_flight"] == 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finished = True
    await client.close()
    assert drained_at == 3 and finished and chunks > 100, "the stream ran to its end after the drain"
    assert target not in await fleet.backends(), "gone once its last request finished"
    assert await fleet.admin("POST", "/admin/backends", {"url": engine.url}) == 201
    await fleet.wait_serving(fleet.engines)
    await fleet.wait_quiet()
