"""Admission control: concurrency limits, the bounded wait queue, 429 with Retry-After.

First the controller on its own (asyncio, plain backends), then through a running router
in front of sim engines with the ``openai`` SDK.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from kvroute.router.errors import RouterError
from kvroute.router.forwarding.admission import AdmissionControl
from tests.servers import RouterServer, wait_until


@dataclass
class FakeBackend:
    url: str
    own_in_flight: int = 0


def control(**limits: Any) -> AdmissionControl[FakeBackend]:
    options: dict[str, Any] = {
        "max_concurrency": None,
        "max_backend_concurrency": None,
        "queue_size": 8,
        "queue_timeout_s": 5.0,
    }
    options.update(limits)
    return AdmissionControl(**options)


async def test_no_limits_admits_everything_at_once() -> None:
    admission = control()
    backends = [FakeBackend("a", own_in_flight=10_000)]
    assert not admission.limited
    assert await admission.admit(lambda: backends, holds_request_slot=False) == backends


async def test_global_limit_queues_in_order_and_hands_over_slots() -> None:
    admission = control(max_concurrency=2)
    backends = [FakeBackend("a")]
    order: list[int] = []
    await admission.admit(lambda: backends, holds_request_slot=False)
    await admission.admit(lambda: backends, holds_request_slot=False)
    assert admission.active == 2

    async def waiter(number: int) -> None:
        await admission.admit(lambda: backends, holds_request_slot=False)
        order.append(number)

    tasks = [asyncio.create_task(waiter(n)) for n in range(3)]
    await asyncio.sleep(0.01)
    assert admission.queued == 3 and order == []
    admission.leave()
    # The slot is reserved for the first waiter: a newcomer may not take it meanwhile.
    newcomer = asyncio.create_task(waiter(99))
    await asyncio.sleep(0.01)
    assert order == [0]
    admission.leave()
    admission.leave()
    await asyncio.sleep(0.01)
    assert order == [0, 1, 2]
    admission.leave()
    await asyncio.sleep(0.01)
    assert order == [0, 1, 2, 99]
    await asyncio.gather(*tasks, newcomer)
    assert admission.active == 2


async def test_full_queue_and_timeout_are_429_with_retry_after() -> None:
    admission = control(max_concurrency=1, queue_size=1, queue_timeout_s=0.1)
    backends = [FakeBackend("a")]
    await admission.admit(lambda: backends, holds_request_slot=False)
    queued = asyncio.create_task(admission.admit(lambda: backends, holds_request_slot=False))
    await asyncio.sleep(0.01)
    with pytest.raises(RouterError) as full:
        await admission.admit(lambda: backends, holds_request_slot=False)
    assert full.value.status == 429
    assert full.value.headers is not None and int(full.value.headers["Retry-After"]) >= 1
    with pytest.raises(RouterError) as timed_out:
        await queued
    assert timed_out.value.status == 429 and "within" in timed_out.value.message
    assert admission.rejected == {"queue_full": 1, "queue_timeout": 1}
    assert admission.queued == 0 and admission.active == 1


async def test_a_cancelled_waiter_leaves_and_passes_its_turn_on() -> None:
    admission = control(max_concurrency=1)
    backends = [FakeBackend("a")]
    await admission.admit(lambda: backends, holds_request_slot=False)
    first = asyncio.create_task(admission.admit(lambda: backends, holds_request_slot=False))
    second = asyncio.create_task(admission.admit(lambda: backends, holds_request_slot=False))
    await asyncio.sleep(0.01)
    admission.leave()  # the turn goes to `first` ...
    first.cancel()  # ... whose client hangs up before it resumes
    await asyncio.sleep(0.01)
    assert second.done() and first.cancelled()
    assert admission.active == 1 and admission.queued == 0


async def test_per_backend_limit_routes_among_backends_with_room_and_waits_when_all_are_full() -> None:
    admission = control(max_backend_concurrency=1)
    a, b = FakeBackend("a"), FakeBackend("b")
    assert await admission.admit(lambda: [a, b], holds_request_slot=False) == [a, b]
    a.own_in_flight = 1
    assert await admission.admit(lambda: [a, b], holds_request_slot=False) == [b]
    b.own_in_flight = 1
    waiting = asyncio.create_task(admission.admit(lambda: [a, b], holds_request_slot=False))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    admission.wake()  # nothing freed yet: it keeps waiting
    await asyncio.sleep(0.01)
    assert not waiting.done()
    b.own_in_flight = 0
    admission.wake()
    assert await waiting == [b]
    # No candidate at all is not a reason to queue: the caller answers 503 at once.
    assert await admission.admit(list, holds_request_slot=False) == []


async def test_waiters_for_other_models_do_not_block_the_queue() -> None:
    admission = control(max_backend_concurrency=1)
    busy, idle = FakeBackend("busy", own_in_flight=1), FakeBackend("idle", own_in_flight=1)
    stuck = asyncio.create_task(admission.admit(lambda: [busy], holds_request_slot=False))
    await asyncio.sleep(0.01)
    other = asyncio.create_task(admission.admit(lambda: [idle], holds_request_slot=False))
    await asyncio.sleep(0.01)
    idle.own_in_flight = 0
    admission.wake()
    assert await other == [idle]
    assert not stuck.done()
    stuck.cancel()


# --- through the router ----------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


def _stream_in_thread(router: RouterServer, results: list[Any], max_tokens: int) -> threading.Thread:
    def run() -> None:
        try:
            chunks = list(
                router.client(timeout=60).chat.completions.create(
                    model="sim",
                    messages=MESSAGES,
                    max_tokens=max_tokens,
                    stream=True,
                )
            )
            results.append(len(chunks))
        except openai.APIStatusError as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_router_queues_then_turns_away_with_429(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(1, time_scale=1.0, decode_tokens_per_s=20.0)
    router = router_server(sims, max_concurrency=2, queue_size=1, queue_timeout_s=30.0)
    results: list[Any] = []
    threads = [_stream_in_thread(router, results, max_tokens=60) for _ in range(2)]  # 3 s each
    wait_until(lambda: router.state.pool.get(sims[0].url).own_in_flight == 2)
    threads.append(_stream_in_thread(router, results, max_tokens=5))  # waits its turn
    wait_until(lambda: router.metrics().value("kvroute_admission_queued_requests") == 1)
    response = httpx.post(router.v1 + "/chat/completions", json={"model": "sim", "messages": MESSAGES}, timeout=30)
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
    for thread in threads:
        thread.join(60)
    assert sorted(r for r in results if isinstance(r, int)) == [6, 61, 61]  # chunks incl. the role chunk
    metrics = router.metrics()
    assert metrics.value("kvroute_rejected_requests_total", reason="queue_full") == 1
    assert metrics.value("kvroute_admission_active_requests") == 0


def test_router_queue_timeout_is_429(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(1, time_scale=1.0, decode_tokens_per_s=100.0)
    router = router_server(sims, max_concurrency=1, queue_size=4, queue_timeout_s=0.3)
    results: list[Any] = []
    thread = _stream_in_thread(router, results, max_tokens=100)
    wait_until(lambda: router.state.pool.get(sims[0].url).own_in_flight == 1)
    with pytest.raises(openai.RateLimitError) as raised:
        router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
    assert raised.value.response.headers["retry-after"]
    thread.join(60)
    assert results == [101]
    assert router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2).choices


def test_router_per_backend_limit_spreads_and_never_exceeds(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(2, time_scale=1.0, decode_tokens_per_s=200.0)
    router = router_server(sims, policy="round_robin", max_backend_concurrency=1, queue_timeout_s=60.0)
    peak: dict[str, int] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for backend in router.state.pool:
                peak[backend.url] = max(peak.get(backend.url, 0), backend.own_in_flight)
            stop.wait(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    results: list[Any] = []
    threads = [_stream_in_thread(router, results, max_tokens=20) for _ in range(6)]
    for thread in threads:
        thread.join(60)
    stop.set()
    watcher.join()
    assert results == [21] * 6
    assert peak == {sim.url: 1 for sim in sims}
    for sim in sims:
        assert sim.metrics().value("vllm:num_requests_running") == 0
