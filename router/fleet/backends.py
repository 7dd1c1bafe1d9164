"""Backends and the pool that holds them.

A :class:`Backend` is one engine replica as the router sees it: its URL, the models it
serves, its health, the load this router has put on it (requests, and their work in
tokens: :attr:`Backend.in_flight_work_tokens`; with peer routers, their load there too),
and what the engine itself reports (set by the engine-stats scraper through :meth:`Backend.update_engine_stats`).
It implements ``kvroute.router.routing.policies.base.BackendView``, so policies read it directly.

The :class:`BackendPool` is the registry: add, remove, drain, and the hot-path question
"which backends may take a request for this model?" (:meth:`BackendPool.candidates`),
answered from a cache that every membership, health or model change invalidates.
Listeners registered with :meth:`BackendPool.on_removed` drop their per-backend state
(metrics series, prefix index entries, policy state) when a backend leaves -- once its
last in-flight request has finished, so those requests' bookkeeping finds it still there.

Two gates decide whether a backend takes new requests: its health (active ``/health``
checks, plus connection failures of real requests) and its circuit breaker
(:mod:`kvroute.router.fleet.breaker`: consecutive failed requests eject it for a cooldown, then one
probe request decides). The proxy reports every attempt's outcome with
:meth:`BackendPool.request_succeeded` / :meth:`~BackendPool.request_failed` /
:meth:`~BackendPool.request_abandoned`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvroute.router.engines import DEFAULT_ENGINE, ENGINES, EngineAPI, EngineFacts
from kvroute.router.fleet.backend_access import BackendAccess
from kvroute.router.fleet.breaker import BreakerState, CircuitBreaker

log = logging.getLogger("kvroute.backends")

BackendListener = Callable[["Backend"], None]


@dataclass(frozen=True, slots=True)
class BackendState:
    """A snapshot of one backend, as the admin API lists it."""

    url: str
    healthy: bool
    draining: bool
    models: list[str] | None
    in_flight: int
    in_flight_work_tokens: int
    capacity_tokens: int | None
    engine_running: int | None
    engine_waiting: int | None
    engine_kv_usage: float | None
    engine_prefix_cache_hit_ratio: float | None
    consecutive_failures: int
    breaker: str
    breaker_trips: int
    #: The engine API it speaks (vllm, sglang, generic) and whether configured or detected.
    engine: str = "vllm"
    engine_source: str = "configured"
    #: Requests in flight there that peer routers last reported (``in_flight`` is this router's).
    peer_in_flight: int = 0
    peer_in_flight_work_tokens: int = 0


class Backend:
    """One engine replica; see the module docstring. Mutated only by the pool and the proxy."""

    __slots__ = (
        "_configured_capacity",
        "_default_capacity",
        "_scraped_capacity",
        "access",
        "breaker",
        "consecutive_failures",
        "consecutive_successes",
        "draining",
        "engine",
        "engine_facts",
        "engine_kv_usage",
        "engine_prefix_cache_hit_ratio",
        "engine_running",
        "engine_setting",
        "engine_waiting",
        "healthy",
        "in_flight",
        "in_flight_work_tokens",
        "kv_events_endpoint",
        "model_cards",
        "models",
        "own_in_flight",
        "own_in_flight_work_tokens",
        "peer_in_flight",
        "peer_in_flight_work_tokens",
        "url",
    )

    def __init__(
        self,
        url: str,
        *,
        access: BackendAccess | None = None,
        kv_events_endpoint: str | None = None,
        capacity_tokens: int | None = None,
        default_capacity_tokens: int | None = None,
        breaker: CircuitBreaker | None = None,
        engine: str = "auto",
    ) -> None:
        #: ``vllm``/``sglang``/``generic`` as configured, or ``auto`` (detected at its first probe).
        self.engine_setting = engine
        #: Its engine API (kvroute.router.engines); ``auto`` counts as vLLM until detected.
        self.engine: EngineAPI = ENGINES.get(engine, DEFAULT_ENGINE)
        #: What the engine said about itself when detected (page size, capacity...).
        self.engine_facts = EngineFacts()
        #: Where and how the router calls it (path prefix, credentials, TLS).
        self.access = access or BackendAccess.for_url(url)
        #: Its identity: the URL as written, without credentials (pool key, metrics label).
        self.url = self.access.url
        self.kv_events_endpoint = kv_events_endpoint
        self.healthy = False
        self.draining = False
        #: Model ids from the engine's /v1/models; None until read (then any model is accepted).
        self.models: frozenset[str] | None = None
        #: The engine's own model cards, re-served by the router's /v1/models.
        self.model_cards: tuple[dict[str, Any], ...] = ()
        #: Requests this router has sent here and not yet seen finish.
        self.own_in_flight = 0
        #: The load those requests put here, in tokens the engine computes: each one's
        #: uncached prompt tokens (as the router predicted) plus its expected output tokens
        #: (``RoutePlan.work_tokens``).
        self.own_in_flight_work_tokens = 0
        #: The same counts as peer routers last reported them (placement exchange), summed.
        self.peer_in_flight = 0
        self.peer_in_flight_work_tokens = 0
        #: What the policies weigh: requests in flight here that this router knows of (its
        #: own and its peers'), and their work. Kept equal to own + peer by the pool rather
        #: than summed on each read: the policies read it several times per candidate per
        #: request, and every ``BackendView`` stand-in (tests, the virtual fleet) sets it.
        self.in_flight = 0
        self.in_flight_work_tokens = 0
        self.engine_running: int | None = None
        self.engine_waiting: int | None = None
        self.engine_kv_usage: float | None = None
        self.engine_prefix_cache_hit_ratio: float | None = None
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        #: Replaced by the pool's own (its thresholds) when the backend joins a pool.
        self.breaker = breaker or CircuitBreaker(threshold=5, cooldown_s=10.0)
        self._configured_capacity = capacity_tokens
        self._scraped_capacity: int | None = None
        self._default_capacity = default_capacity_tokens

    def __repr__(self) -> str:
        state = "healthy" if self.healthy else "unhealthy"
        return f"Backend({self.url!r}, {state}, in_flight={self.own_in_flight})"

    @property
    def capacity_tokens(self) -> int | None:
        """KV cache size in tokens: configured, else scraped from the engine, else the default."""
        return self._configured_capacity or self._scraped_capacity or self._default_capacity

    def serves(self, model: str | None) -> bool:
        """Whether a request for ``model`` may go here (None: the request names no model)."""
        return model is None or self.models is None or model in self.models

    def update_engine_stats(
        self,
        *,
        running: int | None = None,
        waiting: int | None = None,
        kv_usage: float | None = None,
        prefix_cache_hit_ratio: float | None = None,
        capacity_tokens: int | None = None,
    ) -> None:
        """Record what the engine's /metrics said; arguments left None keep their last value."""
        if running is not None:
            self.engine_running = running
        if waiting is not None:
            self.engine_waiting = waiting
        if kv_usage is not None:
            self.engine_kv_usage = kv_usage
        if prefix_cache_hit_ratio is not None:
            self.engine_prefix_cache_hit_ratio = prefix_cache_hit_ratio
        if capacity_tokens is not None and capacity_tokens > 0:
            self._scraped_capacity = capacity_tokens

    def state(self) -> BackendState:
        """A snapshot for the admin API."""
        return BackendState(
            url=self.url,
            healthy=self.healthy,
            draining=self.draining,
            models=sorted(self.models) if self.models is not None else None,
            in_flight=self.own_in_flight,
            in_flight_work_tokens=self.own_in_flight_work_tokens,
            capacity_tokens=self.capacity_tokens,
            engine_running=self.engine_running,
            engine_waiting=self.engine_waiting,
            engine_kv_usage=self.engine_kv_usage,
            engine_prefix_cache_hit_ratio=self.engine_prefix_cache_hit_ratio,
            consecutive_failures=self.consecutive_failures,
            breaker=self.breaker.state.name.lower(),
            breaker_trips=self.breaker.trips,
            engine=self.engine.name,
            engine_source=self.engine_source,
            peer_in_flight=self.peer_in_flight,
            peer_in_flight_work_tokens=self.peer_in_flight_work_tokens,
        )

    @property
    def engine_source(self) -> str:
        """``configured``, ``detected`` (``auto``, probed) or ``auto`` (not yet probed)."""
        if self.engine_setting != "auto":
            return "configured"
        return "detected" if self.engine_facts.detected_by is not None else "auto"

    def set_engine(self, engine: EngineAPI, facts: EngineFacts) -> None:
        """What a probe learnt about the engine; a capacity it reported counts as scraped."""
        self.engine = engine
        self.engine_facts = facts
        if facts.capacity_tokens:
            self._scraped_capacity = facts.capacity_tokens


class BackendPool:
    """The set of backends and their health bookkeeping; see the module docstring."""

    def __init__(
        self,
        *,
        unhealthy_after: int = 3,
        healthy_after: int = 2,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 10.0,
    ) -> None:
        self._backends: dict[str, Backend] = {}
        self._unhealthy_after = unhealthy_after
        self._healthy_after = healthy_after
        self._breaker_failures = breaker_failures
        self._breaker_cooldown_s = breaker_cooldown_s
        # The earliest moment an open breaker turns half-open (None: no breaker is open).
        self._breaker_deadline: float | None = None
        # model -> eligible backends; only models some backend serves are cached, so
        # clients sending random model names cannot grow it.
        self._candidates: dict[tuple[str | None, str | None], list[Backend]] = {}
        self._on_added: list[BackendListener] = []
        self._on_removed: list[BackendListener] = []
        self._on_changed: list[Callable[[], None]] = []
        self._on_load_changed: Callable[[bool], None] | None = None

    # --- membership ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))

    def __len__(self) -> int:
        return len(self._backends)

    def __contains__(self, url: str) -> bool:
        return url.rstrip("/") in self._backends

    def get(self, url: str) -> Backend | None:
        """The backend with this URL, if it is in the pool."""
        return self._backends.get(url)

    def on_added(self, listener: BackendListener) -> None:
        """Call ``listener(backend)`` whenever a backend joins the pool."""
        self._on_added.append(listener)

    def on_removed(self, listener: BackendListener) -> None:
        """Call ``listener(backend)`` whenever a backend leaves the pool (drop its state)."""
        self._on_removed.append(listener)

    def on_changed(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the set of backends that may take requests changed."""
        self._on_changed.append(listener)

    def add(self, backend: Backend) -> None:
        """Add a backend (its health and models already probed by the caller)."""
        if backend.url in self._backends:
            raise ValueError(f"backend {backend.url} is already in the pool")
        backend.breaker = CircuitBreaker(self._breaker_failures, self._breaker_cooldown_s)
        self._backends[backend.url] = backend
        self._changed()
        log.info("backend added: %s (%s)", backend.url, "healthy" if backend.healthy else "unhealthy")
        for listener in self._on_added:
            listener(backend)

    def remove(self, url: str) -> Backend | None:
        """Remove a backend now; requests already running there finish on their own.

        Listeners hear of the removal once those requests are done, so their metrics
        and routing feedback land before the backend's state is dropped (and not after,
        which would bring its series back for good).
        """
        backend = self._backends.pop(url.rstrip("/"), None)
        if backend is None:
            return None
        backend.draining = True
        self._changed()
        log.info("backend removed: %s (%d in flight)", backend.url, backend.own_in_flight)
        if backend.own_in_flight == 0:
            self._notify_removed(backend)
        return backend

    def _notify_removed(self, backend: Backend) -> None:
        for listener in self._on_removed:
            listener(backend)

    def drain(self, url: str) -> Backend | None:
        """Stop routing new requests to a backend; it leaves the pool once idle."""
        backend = self._backends.get(url.rstrip("/"))
        if backend is None:
            return None
        if not backend.draining:
            backend.draining = True
            self._changed()
            log.info("backend draining: %s (%d in flight)", backend.url, backend.own_in_flight)
        if backend.own_in_flight == 0:
            self.remove(backend.url)
        return backend

    # --- the hot path ------------------------------------------------------------------
    def candidates(self, model: str | None, path: str | None = None) -> list[Backend]:
        """Healthy, non-draining backends serving ``model`` whose breaker admits requests,
        in pool order; with ``path``, those whose engine serves it (a mixed fleet: SGLang's
        ``/generate`` goes to SGLang replicas) unless none does. Cached until the pool or a
        backend's engine changes. Do not mutate."""
        deadline = self._breaker_deadline
        if deadline is not None and time.monotonic() >= deadline:
            self._tick_breakers()
        key = (model, path)
        cached = self._candidates.get(key)
        if cached is not None:
            return cached
        eligible = [
            b for b in self._backends.values() if b.healthy and not b.draining and b.breaker.admits and b.serves(model)
        ]
        if path is not None:
            eligible = [backend for backend in eligible if path in backend.engine.paths] or eligible
        if eligible:
            self._candidates[key] = eligible
        return eligible

    def set_engine(self, backend: Backend, engine: EngineAPI, facts: EngineFacts) -> None:
        """What a probe learnt about ``backend``'s engine (which paths it serves among them)."""
        backend.set_engine(engine, facts)
        self._changed()

    def acquire(self, backend: Backend, work_tokens: int) -> None:
        """A request of ``work_tokens`` was sent to ``backend``: count it as in flight (and as
        the breaker's probe)."""
        self._count_own(backend, 1, work_tokens)
        breaker = backend.breaker
        if breaker.state is not BreakerState.CLOSED and breaker.on_dispatch():
            self._changed()

    def _count_own(self, backend: Backend, requests: int, work_tokens: int) -> None:
        """This router's own requests there changed: in its own count and in the total the
        policies weigh; the peer exchange hears of it."""
        backend.own_in_flight += requests
        backend.own_in_flight_work_tokens += work_tokens
        backend.in_flight += requests
        backend.in_flight_work_tokens += work_tokens
        if self._on_load_changed is not None:
            self._on_load_changed(requests < 0)

    def on_load_changed(self, listener: Callable[[bool], None] | None) -> None:
        """Call ``listener(finished)`` whenever this router's own requests in flight change,
        ``finished`` when one ended (one listener: the peer exchange, which reports them)."""
        self._on_load_changed = listener

    def set_peer_load(self, url: str, in_flight: int, work_tokens: int) -> None:
        """Peer routers now report ``in_flight`` requests of ``work_tokens`` on ``url``, summed."""
        backend = self._backends.get(url)
        if backend is None:
            return  # a peer's backend that is not (or no longer) ours
        backend.in_flight += in_flight - backend.peer_in_flight
        backend.in_flight_work_tokens += work_tokens - backend.peer_in_flight_work_tokens
        backend.peer_in_flight = in_flight
        backend.peer_in_flight_work_tokens = work_tokens

    def release(self, backend: Backend, work_tokens: int) -> None:
        """That request finished (in any way); a draining or removed backend leaves once idle."""
        self._count_own(backend, -1, -work_tokens)
        if backend.draining and backend.own_in_flight == 0:
            current = self._backends.get(backend.url)
            if current is backend:
                self.remove(backend.url)
            elif current is None:  # removed earlier; not re-added under the same URL since
                self._notify_removed(backend)

    # --- request outcomes (the circuit breaker) ------------------------------------------
    def request_succeeded(self, backend: Backend) -> None:
        """The engine answered (any status below 500): it works."""
        if backend.consecutive_failures:
            backend.consecutive_failures = 0
        breaker = backend.breaker
        if (breaker.failures or breaker.state is not BreakerState.CLOSED) and breaker.on_success():
            log.warning("backend %s: probe request succeeded, circuit closed", backend.url)
            self._changed()

    def request_failed(self, backend: Backend, *, unreachable: bool = False) -> None:
        """A request failed because of the engine (5xx, timeout, broken answer).

        ``unreachable``: the engine could not be reached at all (refused, reset), which
        also counts toward its health like a failed health check.
        """
        if unreachable:
            self.record_failure(backend)
        breaker = backend.breaker
        was_probe = breaker.state is BreakerState.HALF_OPEN
        if breaker.on_failure(time.monotonic()):
            reopens_at = breaker.reopens_at
            assert reopens_at is not None
            log.warning(
                "backend %s ejected for %.1f s: %s",
                backend.url,
                reopens_at - time.monotonic(),
                "its probe request failed" if was_probe else "consecutive requests failed",
            )
            if self._breaker_deadline is None or reopens_at < self._breaker_deadline:
                self._breaker_deadline = reopens_at
            self._changed()

    def request_abandoned(self, backend: Backend) -> None:
        """The request ended without a verdict on the engine (its client went away)."""
        breaker = backend.breaker
        if breaker.state is BreakerState.HALF_OPEN and breaker.on_abandoned():
            self._changed()

    def _tick_breakers(self) -> None:
        now = time.monotonic()
        changed = False
        deadline: float | None = None
        for backend in self._backends.values():
            breaker = backend.breaker
            if breaker.tick(now):
                changed = True
                log.warning("backend %s: cooldown over, the next request probes it", backend.url)
            reopens_at = breaker.reopens_at
            if reopens_at is not None and (deadline is None or reopens_at < deadline):
                deadline = reopens_at
        self._breaker_deadline = deadline
        if changed:
            self._changed()

    # --- health ----------------------------------------------------------------------
    def record_success(self, backend: Backend, *, active: bool) -> None:
        """A health check passed (``active``) or a request got a non-5xx answer (passive).

        Only active checks bring an unhealthy backend back: passive traffic never reaches it.
        """
        if backend.consecutive_failures:
            backend.consecutive_failures = 0
        if not active or backend.healthy:
            return
        backend.consecutive_successes += 1
        if backend.consecutive_successes >= self._healthy_after:
            self.set_healthy(backend, True)

    def record_failure(self, backend: Backend) -> None:
        """A health check or a request failed (connection error, timeout, 5xx)."""
        backend.consecutive_successes = 0
        backend.consecutive_failures += 1
        if backend.healthy and backend.consecutive_failures >= self._unhealthy_after:
            self.set_healthy(backend, False)

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        """Set a backend's health directly (first probe, or a threshold crossed)."""
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        backend.consecutive_successes = 0
        if healthy:
            backend.consecutive_failures = 0
        self._changed()
        if backend.url in self._backends:  # a transition, not the first probe of a newcomer
            log.warning("backend %s is now %s", backend.url, "healthy" if healthy else "unhealthy")

    def set_models(self, backend: Backend, cards: list[dict[str, Any]]) -> None:
        """Record the model cards an engine listed at /v1/models."""
        models = frozenset(str(card["id"]) for card in cards)
        if models != backend.models:
            backend.models = models
            self._changed()
        backend.model_cards = tuple(cards)

    # --- questions for error messages and /v1/models ----------------------------------
    def any_serves(self, model: str | None) -> bool:
        """Whether any backend, healthy or not, is known to serve ``model``."""
        return any(b.models is not None and model in b.models for b in self._backends.values())

    def healthy_count(self) -> int:
        """Backends that are healthy (draining ones included: they still answer)."""
        return sum(1 for b in self._backends.values() if b.healthy)

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of the healthy backends' model cards, each model id once."""
        cards: dict[str, dict[str, Any]] = {}
        for backend in self._backends.values():
            if backend.healthy and not backend.draining:
                for card in backend.model_cards:
                    cards.setdefault(str(card["id"]), card)
        return list(cards.values())

    def _changed(self) -> None:
        self._candidates.clear()
        for listener in self._on_changed:
            listener()
