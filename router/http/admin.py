"""The admin API: list, add, remove and drain backends at run time.

Enabled only when ``admin_token`` is set (without it the paths do not exist: 404).
Every call needs ``Authorization: Bearer <admin_token>``, compared in constant time.

* ``GET    /admin/backends``         -> ``{"backends": [BackendState + index_tokens, ...]}``
  (``index_tokens``: what the routing engine's prefix index holds of the backend)
* ``POST   /admin/backends``         ``{"url", "api_key"?, "capacity_tokens"?, "kv_events_endpoint"?}``
  (or any other per-backend setting of the config file: ``headers``, ``ca_file``, ``verify``, ...)
  -> 201 with the new backend's state (probed once first; 409 if already there)
* ``DELETE /admin/backends``         ``{"url"}`` (or ``?url=``) -> 200, removed at once
* ``POST   /admin/backends/drain``   ``{"url"}`` -> 202; no new requests go there and it
  leaves the pool when its in-flight requests reach zero
* ``GET    /admin/decisions?last=N`` -> ``{"decisions": [...]}``: the last N (default 100)
  routing decisions, oldest first, each with every candidate's cost terms
  (:mod:`kvroute.router.routing.decisions`)

With ``kvroute serve --workers N`` the writes (add, remove, drain) are applied by the
worker that received them, then forwarded to every sibling over their Unix sockets
(:mod:`kvroute.router.http.workers`); ``x-kvroute-workers-applied: K/N`` says how many
applied it (a sibling's failure is logged). A write refused here (400, 403, 404, 409) is
not forwarded. The reads (``GET``) answer for the worker the connection reached.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from pydantic import ValidationError

from kvroute.router.backend_url import parse_backend_url, rank_name, split_rank_name
from kvroute.router.config import BackendConfig, Settings
from kvroute.router.errors import RouterError, json_response
from kvroute.router.fleet.backends import Backend, BackendPool
from kvroute.router.fleet.health import HealthChecker
from kvroute.router.http.workers import Siblings
from kvroute.router.routing.decisions import DecisionRecorder

log = logging.getLogger("kvroute")

AdminHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdminAPI:
    """Handlers of the admin routes; ``health`` is read lazily (it exists once the app started)."""

    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        health: Callable[[], HealthChecker],
        *,
        on_secret: Callable[[str], None] | None = None,
        decisions: DecisionRecorder | None = None,
        index_tokens: Callable[[str], int] | None = None,
        siblings: Siblings | None = None,
        peers: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``on_secret`` hears of every engine API key added at run time (log redaction);
        ``decisions`` holds the recent routing decisions ``GET /admin/decisions`` returns;
        ``index_tokens(url)`` says what the routing engine's prefix index holds of a backend
        (``RoutingEngine.index_tokens``; without it backends list ``"index_tokens": null``);
        ``siblings``: the other workers of ``kvroute serve --workers N``, which every write
        is forwarded to; ``peers()``: what ``GET /admin/peers`` shows of the exchange with
        other routers."""
        if not settings.admin_token:
            raise ValueError("the admin API needs an admin token")
        self._token = settings.admin_token.encode()
        self._data_parallel_size = settings.data_parallel_size
        self._pool = pool
        self._health = health
        self._on_secret = on_secret
        self._decisions = decisions
        self._index_tokens = index_tokens
        self._siblings = siblings
        self._peers = peers
        self._allowed_networks = [ipaddress.ip_network(net, strict=False) for net in settings.admin_allowed_networks]

    def add_routes(self, app: web.Application) -> None:
        """Register the admin routes on ``app``."""
        app.router.add_get("/admin/backends", self._guard(self.list_backends))
        app.router.add_post("/admin/backends", self._guard(self._everywhere(self.add_backend)))
        app.router.add_delete("/admin/backends", self._guard(self._everywhere(self.remove_backend)))
        app.router.add_post("/admin/backends/drain", self._guard(self._everywhere(self.drain_backend)))
        app.router.add_get("/admin/decisions", self._guard(self.list_decisions))
        app.router.add_get("/admin/peers", self._guard(self.show_peers))

    def add_local_routes(self, app: web.Application) -> None:
        """The writes, unguarded and applied here only: a worker's internal application,
        reachable only through its private Unix socket, where a sibling forwards them."""
        app.router.add_post("/admin/backends", self.add_backend)
        app.router.add_delete("/admin/backends", self.remove_backend)
        app.router.add_post("/admin/backends/drain", self.drain_backend)

    def _guard(self, handler: AdminHandler) -> AdminHandler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            self._authorize(request)
            return await handler(request)

        return guarded

    def _everywhere(self, handler: AdminHandler) -> AdminHandler:
        """Apply a write here, then (with workers) on every sibling."""
        siblings = self._siblings
        if siblings is None:
            return handler

        async def everywhere(request: web.Request) -> web.StreamResponse:
            response = await handler(request)  # a refusal raises: nothing is forwarded
            body = await request.read()  # aiohttp keeps the body the handler read
            answers = await siblings.each(request.method, request.path, query=dict(request.query), body=body)
            applied = 1
            for answer in answers:
                # 409 on an add: that worker has the backend already (e.g. discovered it).
                if answer.ok or (
                    answer.status == 409 and request.method == "POST" and request.path == "/admin/backends"
                ):
                    applied += 1
                else:
                    detail = answer.error or f"{answer.status} {answer.body[:300].decode(errors='replace')}"
                    log.warning("admin %s %s: worker %d did not apply it: %s", request.method, request.path,
                                answer.index, detail)  # fmt: skip
            response.headers["x-kvroute-workers-applied"] = f"{applied}/{siblings.group.count}"
            return response

        return everywhere

    def _authorize(self, request: web.Request) -> None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # compare_digest always runs, so a wrong scheme and a wrong token take equal time.
        valid = hmac.compare_digest(token.strip().encode(), self._token)
        if scheme.lower() != "bearer" or not valid:
            raise RouterError(
                401,
                "admin API: missing or wrong bearer token",
                code="invalid_admin_token",
                headers={"WWW-Authenticate": "Bearer"},
            )

    # --- handlers --------------------------------------------------------------------
    async def list_backends(self, request: web.Request) -> web.Response:
        """All backends with their state."""
        return json_response({"backends": [self._state(backend) for backend in self._pool]})

    async def list_decisions(self, request: web.Request) -> web.Response:
        """The last ``?last=N`` routing decisions, oldest first."""
        raw = request.query.get("last", "100")
        if not raw.isdigit():
            raise RouterError(400, "'last' must be a non-negative integer", code="invalid_last")
        decisions = self._decisions
        return json_response({"decisions": decisions.last(int(raw)) if decisions is not None else []})

    async def show_peers(self, request: web.Request) -> web.Response:
        """The exchange with other routers: each peer's state, CURVE, DNS discovery, counters."""
        return json_response(self._peers() if self._peers is not None else {"exchange": None, "discovery": None})

    async def add_backend(self, request: web.Request) -> web.Response:
        """Probe and add a backend."""
        payload = await _json_object(request)
        try:
            config = BackendConfig.model_validate(payload)
        except ValidationError as exc:
            raise RouterError(400, _validation_message(exc), code="invalid_backend") from None
        if self._on_secret is not None:
            for secret in config.secrets():
                self._on_secret(secret)
        if len(config.ranks(self._data_parallel_size)) > 1:
            raise RouterError(
                400, "add a data-parallel engine's ranks one by one (data_parallel_rank)", code="invalid_backend"
            )
        if config.name in self._pool:
            raise RouterError(409, f"backend {config.name} is already in the pool", code="backend_exists")
        await self._check_network(config.url)
        try:
            backend = await self._health().admit(config)
        except ValueError as exc:  # added concurrently while we probed
            raise RouterError(409, str(exc), code="backend_exists") from None
        return json_response(self._state(backend), status=201)

    async def remove_backend(self, request: web.Request) -> web.Response:
        """Remove a backend now (requests already running there finish)."""
        url = await self._target_url(request)
        backend = self._pool.remove(url)
        if backend is None:
            raise RouterError(404, f"no backend {url}", code="backend_not_found")
        return json_response(self._state(backend))

    async def drain_backend(self, request: web.Request) -> web.Response:
        """Stop routing to a backend; it leaves once idle."""
        url = await self._target_url(request)
        backend = self._pool.drain(url)
        if backend is None:
            raise RouterError(404, f"no backend {url}", code="backend_not_found")
        return json_response(self._state(backend), status=202)

    # --- helpers ---------------------------------------------------------------------
    def _state(self, backend: Backend) -> dict[str, Any]:
        """The backend's own state and what the routing engine's prefix index holds of it."""
        state = asdict(backend.state())
        state["index_tokens"] = self._index_tokens(backend.url) if self._index_tokens is not None else None
        return state

    async def _target_url(self, request: web.Request) -> str:
        url = request.query.get("url")
        if url is None:
            url = (await _json_object(request)).get("url")
        if not isinstance(url, str) or not url:
            raise RouterError(400, "'url' is required", code="missing_url")
        base, rank = split_rank_name(url)
        try:
            # As the pool names it: credentials left out, a data-parallel rank's mark kept.
            return rank_name(parse_backend_url(base).base, rank)
        except ValueError:
            return url.rstrip("/")  # not a backend URL: answered "no backend" below

    async def _check_network(self, url: str) -> None:
        """Refuse backends outside ``admin_allowed_networks`` (when that list is set)."""
        if not self._allowed_networks:
            return
        host = urlsplit(url).hostname or ""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise RouterError(400, f"cannot resolve backend host {host!r}: {exc}", code="invalid_backend") from None
        addresses = {ipaddress.ip_address(info[4][0]) for info in infos}
        outside = [str(a) for a in addresses if not any(a in net for net in self._allowed_networks)]
        if outside or not addresses:
            raise RouterError(
                403,
                f"backend {url} resolves outside the allowed networks ({', '.join(outside)})",
                code="backend_not_allowed",
            )


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw:
        return {}
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise RouterError(400, "body must be a JSON object", code="invalid_json")
    return payload


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}" for error in exc.errors()
    )
