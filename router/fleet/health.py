"""Active health checking and the admission of new backends.

Every ``health_interval_s`` each backend gets ``GET /health`` (200 = pass) and, when it
passes, ``GET /v1/models`` to refresh the models it serves. ``unhealthy_after``
consecutive failures (active or passive, see :meth:`BackendPool.record_failure`) mark a
backend unhealthy; ``healthy_after`` consecutive passing checks bring it back. A backend
joining the pool (at start, through the admin API or discovery) is probed once first, so
it starts healthy or not according to that probe instead of after several intervals.

An unhealthy backend is probed sooner than every interval (:mod:`kvroute.router.fleet.probe_schedule`:
0.25 s, doubling up to the interval), and one that has never answered is healthy at its
first passing check, as a newcomer is at admission: engines that come up just after their
router serve within a fraction of a second instead of a full interval later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson

from kvroute.router.config import BackendConfig, Settings
from kvroute.router.fleet.backend_access import BackendAccess
from kvroute.router.fleet.backends import Backend, BackendPool
from kvroute.router.fleet.engine_detect import learn_engine, needs_probe
from kvroute.router.fleet.probe_schedule import ProbeSchedule

log = logging.getLogger("kvroute.health")


class HealthChecker:
    """Probes backends over the router's shared HTTP client session."""

    def __init__(self, settings: Settings, pool: BackendPool, session: aiohttp.ClientSession) -> None:
        self._settings = settings
        self._pool = pool
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s)
        self._schedule = ProbeSchedule(settings.health_interval_s)
        # URLs of backends that passed a check at least once (healthy_after applies to them only).
        self._answered: set[str] = set()
        self._probes: dict[str, asyncio.Task[None]] = {}
        # Set on any pool change (a backend joined, or fell ill between probes): replan now.
        self._wake = asyncio.Event()
        pool.on_changed(self._wake.set)

    # --- admission -------------------------------------------------------------------
    def new_backend(self, config: BackendConfig) -> Backend:
        """A :class:`Backend` for a configured URL, with the router-wide defaults applied."""
        return Backend(
            config.name,
            access=BackendAccess.build(
                config,
                default_api_key=self._settings.backend_api_key,
                client_keys_checked=bool(self._settings.api_keys),
            ),
            kv_events_endpoint=config.kv_events_endpoint,
            capacity_tokens=config.capacity_tokens,
            default_capacity_tokens=self._settings.default_capacity_tokens,
            engine=config.engine,
        )

    async def admit(self, config: BackendConfig) -> Backend:
        """Probe a new backend once and add it to the pool, healthy or not."""
        backend = self.new_backend(config)
        healthy = await self.probe(backend)
        if backend.url in self._pool:
            raise ValueError(f"backend {backend.url} is already in the pool")
        self._pool.set_healthy(backend, healthy)
        self._pool.add(backend)
        if healthy:
            self._answered.add(backend.url)
        return backend

    async def sync(self, urls: set[str]) -> None:
        """Make the pool hold exactly ``urls`` (for discovery): admit new ones, drain gone ones."""
        # Keyed by the backends' names: the URLs as written, without credentials (and a
        # data-parallel engine's ranks, each its own backend).
        size = self._settings.data_parallel_size
        configs = (rank for url in urls for rank in BackendConfig(url=url).ranks(size))
        wanted = {config.name: config for config in configs}
        current = {backend.url for backend in self._pool if not backend.draining}
        for name in current - wanted.keys():
            self._pool.drain(name)
        new = [wanted[name] for name in wanted.keys() - current]
        results = await asyncio.gather(*(self.admit(config) for config in new), return_exceptions=True)
        for config, result in zip(new, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("could not add discovered backend %s: %s", config.name, result)

    # --- checking --------------------------------------------------------------------
    async def probe(self, backend: Backend) -> bool:
        """One health check (and, when it passes, a model list refresh). Never raises."""
        try:
            async with self._session.get(
                backend.access.base_url + "/health",
                headers=backend.access.probe_headers,
                ssl=backend.access.aiohttp_ssl,
                timeout=self._timeout,
            ) as response:
                await response.read()
                if response.status != 200:
                    return False
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False
        cards = await self._model_cards(backend)
        if cards is not None:
            self._pool.set_models(backend, cards)
        if needs_probe(backend):  # engine: auto (or sglang's /server_info facts), once
            await learn_engine(self._session, self._pool, backend, self._timeout)
        return True

    async def check(self, backend: Backend) -> bool:
        """Probe a backend and record the result; True if it passed."""
        if not await self.probe(backend):
            self._pool.record_failure(backend)
            return False
        if backend.url in self._answered:
            self._pool.record_success(backend, active=True)
        else:
            # Nothing to flap yet: a first answer admits it, as the probe at admission does.
            self._answered.add(backend.url)
            self._pool.set_healthy(backend, True)
        return True

    async def check_all(self) -> None:
        """Check every backend concurrently."""
        await asyncio.gather(*(self.check(backend) for backend in self._pool))

    async def run(self) -> None:
        """Probe each backend when its schedule says (see :mod:`kvroute.router.fleet.probe_schedule`), until cancelled."""
        try:
            while True:
                self._wake.clear()
                now = time.monotonic()
                backends = self._plan(now)
                for url in self._schedule.due(now):
                    self._start_probe(backends[url])
                due = self._schedule.next_due()
                timeout = None if due is None else max(due - time.monotonic(), 0.0)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
        finally:
            probes = list(self._probes.values())
            for task in probes:
                task.cancel()
            await asyncio.gather(*probes, return_exceptions=True)

    def _plan(self, now: float) -> dict[str, Backend]:
        """Bring the schedule up to date with the pool; returns the pool's backends by URL."""
        backends = {backend.url: backend for backend in self._pool}
        self._schedule.retain(backends)
        self._answered.intersection_update(backends)
        for url, backend in backends.items():
            if backend.healthy:
                self._answered.add(url)
            self._schedule.track(url, backend.healthy, now)
        return backends

    def _start_probe(self, backend: Backend) -> None:
        self._schedule.started(backend.url)
        self._probes[backend.url] = asyncio.create_task(
            self._scheduled_check(backend), name=f"kvroute-probe {backend.url}"
        )

    async def _scheduled_check(self, backend: Backend) -> None:
        passed = False
        try:
            passed = await self.check(backend)
        except Exception:
            log.exception("health check of %s failed", backend.url)
        finally:
            self._probes.pop(backend.url, None)
            self._schedule.probed(backend.url, passed=passed, healthy=backend.healthy, now=time.monotonic())
            self._wake.set()

    async def _model_cards(self, backend: Backend) -> list[dict[str, Any]] | None:
        """The engine's /v1/models cards, or None when it could not tell."""
        try:
            async with self._session.get(
                backend.access.base_url + "/v1/models",
                headers=backend.access.probe_headers,
                ssl=backend.access.aiohttp_ssl,
                timeout=self._timeout,
            ) as response:
                if response.status != 200:
                    return None
                payload = orjson.loads(await response.read())
        except (TimeoutError, aiohttp.ClientError, OSError, orjson.JSONDecodeError):
            return None
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return None
        return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]
