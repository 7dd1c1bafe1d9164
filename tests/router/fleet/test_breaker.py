"""The circuit breaker on its own, and as the backend pool's second gate next to health."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvroute.router.fleet.backends import Backend, BackendPool
from kvroute.router.fleet.breaker import MAX_COOLDOWN_FACTOR, BreakerState, CircuitBreaker
from kvroute.router.routing.policies.sticky import rendezvous_score


def test_consecutive_failures_open_it_and_a_success_resets_the_count() -> None:
    breaker = CircuitBreaker(threshold=3, cooldown_s=10.0)
    assert not breaker.on_failure(0.0)
    assert not breaker.on_failure(0.0)
    assert not breaker.on_success()  # the streak is broken
    assert breaker.failures == 0
    assert not breaker.on_failure(1.0)
    assert not breaker.on_failure(1.0)
    assert breaker.on_failure(1.0)
    assert breaker.state is BreakerState.OPEN and not breaker.admits
    assert breaker.reopens_at == 11.0
    assert breaker.trips == 1


def test_open_turns_half_open_after_the_cooldown_and_admits_one_probe() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown_s=5.0)
    breaker.on_failure(100.0)
    assert not breaker.tick(104.9)
    assert not breaker.on_success()  # a straggler's success does not close an open breaker
    assert breaker.state is BreakerState.OPEN
    assert breaker.tick(105.0)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.admits
    assert breaker.on_dispatch()  # the probe
    assert not breaker.admits  # nobody else until it reports back
    assert not breaker.on_dispatch()
    assert breaker.on_success()
    assert breaker.state is BreakerState.CLOSED and breaker.admits


def test_a_failed_probe_doubles_the_cooldown_up_to_the_cap() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown_s=1.0)
    now = 0.0
    breaker.on_failure(now)
    cooldowns = []
    for _ in range(8):
        reopens_at = breaker.reopens_at
        assert reopens_at is not None
        cooldowns.append(reopens_at - now)
        now = reopens_at
        breaker.tick(now)
        breaker.on_dispatch()
        assert breaker.on_failure(now)
    assert cooldowns[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0]
    assert max(cooldowns) == MAX_COOLDOWN_FACTOR
    breaker.tick(now + 100)
    breaker.on_success()
    breaker.on_failure(now + 100)  # closed again: back to the base cooldown
    assert breaker.reopens_at == now + 101


def test_an_abandoned_probe_lets_the_next_request_probe() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown_s=1.0)
    breaker.on_failure(0.0)
    breaker.tick(1.0)
    breaker.on_dispatch()
    assert not breaker.admits
    assert breaker.on_abandoned()
    assert breaker.admits and breaker.state is BreakerState.HALF_OPEN


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0, cooldown_s=1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=1, cooldown_s=0.0)


# --- in the pool ---------------------------------------------------------------------------
def _pool(cooldown_s: float = 0.05) -> tuple[BackendPool, Backend, Backend]:
    pool = BackendPool(breaker_failures=2, breaker_cooldown_s=cooldown_s)
    a, b = Backend("http://a:1"), Backend("http://b:1")
    for backend in (a, b):
        pool.set_healthy(backend, True)
        pool.add(backend)
    return pool, a, b


def test_the_pool_ejects_a_failing_backend_then_probes_it() -> None:
    pool, a, b = _pool()
    changes: list[None] = []
    pool.on_changed(lambda: changes.append(None))
    pool.request_failed(a)
    assert pool.candidates(None) == [a, b]
    pool.request_failed(a)
    assert pool.candidates(None) == [b]
    assert changes, "listeners hear of the ejection (admission wakes its queue)"
    assert a.healthy, "5xx answers and timeouts eject through the breaker, not health"
    assert a.state().breaker == "open" and a.state().breaker_trips == 1
    time.sleep(0.06)
    assert pool.candidates(None) == [a, b]  # half-open: one probe may go
    pool.acquire(a, 10)
    assert pool.candidates(None) == [b]  # the probe is out
    pool.release(a, 10)
    pool.request_succeeded(a)
    assert pool.candidates(None) == [a, b]
    assert a.breaker.state is BreakerState.CLOSED


def test_a_failed_probe_ejects_again_and_an_abandoned_one_frees_the_probe() -> None:
    pool, a, b = _pool()
    pool.request_failed(a)
    pool.request_failed(a)
    time.sleep(0.06)
    assert a in pool.candidates(None)
    pool.acquire(a, 0)
    pool.release(a, 0)
    pool.request_abandoned(a)  # the client left: no verdict
    assert a in pool.candidates(None)
    pool.acquire(a, 0)
    pool.release(a, 0)
    pool.request_failed(a)
    assert pool.candidates(None) == [b]
    assert a.breaker.trips == 2


def test_unreachable_failures_count_toward_health_too() -> None:
    pool = BackendPool(unhealthy_after=2, breaker_failures=5)
    backend = Backend("http://a:1")
    pool.set_healthy(backend, True)
    pool.add(backend)
    pool.request_failed(backend, unreachable=True)
    pool.request_failed(backend, unreachable=True)
    assert not backend.healthy
    assert backend.breaker.state is BreakerState.CLOSED


def test_removed_backend_is_forgotten_only_when_its_requests_finish() -> None:
    pool, a, _ = _pool()
    forgotten: list[str] = []
    pool.on_removed(lambda backend: forgotten.append(backend.url))
    pool.acquire(a, 5)
    assert pool.remove(a.url) is a
    assert a.url not in pool and forgotten == []
    pool.release(a, 5)
    assert forgotten == [a.url]
    # Removed and re-added under the same URL while an old request still ran: the old
    # request finishing must not wipe the new backend's state.
    pool2, c, _ = _pool()
    gone: list[str] = []
    pool2.on_removed(lambda backend: gone.append(backend.url))
    pool2.acquire(c, 1)
    pool2.remove(c.url)
    again = Backend(c.url)
    pool2.set_healthy(again, True)
    pool2.add(again)
    pool2.release(c, 1)
    assert gone == [] and again.url in pool2


# --- through the proxy ----------------------------------------------------------------------
def _session_ranking(*urls: str) -> str:
    """A session key whose rendezvous order over these backends is exactly ``urls``."""
    for number in range(100_000):
        key = f"session-{number}"
        if sorted(urls, key=lambda url: rendezvous_score(key, url), reverse=True) == list(urls):
            return key
    raise AssertionError("no such session key")


def test_a_retry_never_goes_to_a_backend_on_probation(sim_engines: Any, router_server: Any) -> None:
    """A request that failed on its first backend is retried on a proven one, not on a
    backend whose breaker is half-open (its probe is as likely to fail: one retry is all
    the client gets)."""
    first, on_probation, proven = sim_engines(3)
    router = router_server([first, on_probation, proven], policy="sticky", breaker_failures=1, breaker_cooldown_s=0.3)
    client = router.client()

    def chat(session: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            user=session,
        )
        return raw.headers["x-kvroute-backend"]

    # Eject `on_probation` (its request is retried elsewhere), then let its cooldown pass.
    on_probation.set_fault("error_500")
    assert chat(_session_ranking(on_probation.url, first.url, proven.url)) == first.url
    assert router.state.pool.get(on_probation.url).breaker.state is BreakerState.OPEN
    time.sleep(0.35)
    assert on_probation.url in {b.url for b in router.state.pool.candidates("sim")}  # half-open now
    # This session prefers first, then on_probation: first fails, the retry skips the probe.
    first.set_fault("error_500", 1)
    assert chat(_session_ranking(first.url, on_probation.url, proven.url)) == proven.url
    assert router.state.pool.get(on_probation.url).breaker.state is BreakerState.HALF_OPEN
    on_probation.set_fault("none")
