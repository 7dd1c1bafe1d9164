"""Active health checking and the admission of new backends.

Every ``health_interval_s`` each backend gets ``GET /health`` (200 = pass) and, when it
passes, ``GET /v1/models`` to refresh the models it serves. ``unhealthy_after``
consecutive failures (active or passive, see :meth:`BackendPool.record_failure`) mark a
backend unhealthy; ``healthy_after`` consecutive passing checks bring it back. A backend
joining the pool (at start, through the admin API or discovery) is probed once first, so
it starts healthy or not according to that probe instead of after several intervals.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson

from router.backends import Backend, BackendPool
from router.config import BackendConfig, Settings

log = logging.getLogger("kvroute.health")


class HealthChecker:
    """Probes backends over the router's shared HTTP client session."""

    def __init__(self, settings: Settings, pool: BackendPool, session: aiohttp.ClientSession) -> None:
        self._settings = settings
        self._pool = pool
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=settings.health_timeout_s)

    # --- admission -------------------------------------------------------------------
    def new_backend(self, config: BackendConfig) -> Backend:
        """A :class:`Backend` for a configured URL, with the router-wide defaults applied."""
        return Backend(
            config.url,
            api_key=config.api_key or self._settings.backend_api_key,
            kv_events_endpoint=config.kv_events_endpoint,
            capacity_tokens=config.capacity_tokens,
            default_capacity_tokens=self._settings.default_capacity_tokens,
        )

    async def admit(self, config: BackendConfig) -> Backend:
        """Probe a new backend once and add it to the pool, healthy or not."""
        backend = self.new_backend(config)
        healthy = await self.probe(backend)
        if backend.url in self._pool:
            raise ValueError(f"backend {backend.url} is already in the pool")
        self._pool.set_healthy(backend, healthy)
        self._pool.add(backend)
        return backend

    async def sync(self, urls: set[str]) -> None:
        """Make the pool hold exactly ``urls`` (for discovery): admit new ones, drain gone ones."""
        wanted = {url.rstrip("/") for url in urls}
        current = {backend.url for backend in self._pool if not backend.draining}
        for url in current - wanted:
            self._pool.drain(url)
        new = [BackendConfig(url=url) for url in wanted - current]
        results = await asyncio.gather(*(self.admit(config) for config in new), return_exceptions=True)
        for config, result in zip(new, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("could not add discovered backend %s: %s", config.url, result)

    # --- checking --------------------------------------------------------------------
    async def probe(self, backend: Backend) -> bool:
        """One health check (and, when it passes, a model list refresh). Never raises."""
        try:
            async with self._session.get(
                backend.url + "/health", headers=self._auth(backend), timeout=self._timeout
            ) as response:
                await response.read()
                if response.status != 200:
                    return False
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
        cards = await self._model_cards(backend)
        if cards is not None:
            self._pool.set_models(backend, cards)
        return True

    async def check(self, backend: Backend) -> None:
        """Probe a backend and record the result."""
        if await self.probe(backend):
            self._pool.record_success(backend, active=True)
        else:
            self._pool.record_failure(backend)

    async def check_all(self) -> None:
        """Check every backend concurrently."""
        await asyncio.gather(*(self.check(backend) for backend in self._pool))

    async def run(self) -> None:
        """Check every backend every ``health_interval_s``, until cancelled."""
        while True:
            await asyncio.sleep(self._settings.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad answer
                log.exception("health check round failed")

    async def _model_cards(self, backend: Backend) -> list[dict[str, Any]] | None:
        """The engine's /v1/models cards, or None when it could not tell."""
        try:
            async with self._session.get(
                backend.url + "/v1/models", headers=self._auth(backend), timeout=self._timeout
            ) as response:
                if response.status != 200:
                    return None
                payload = orjson.loads(await response.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
            return None
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            return None
        return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]

    @staticmethod
    def _auth(backend: Backend) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else None
