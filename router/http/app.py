"""The aiohttp application: routes, lifecycle, and running it on uvloop with a graceful drain.

:func:`build_app` wires the parts (backend pool, routing engine, metrics, proxy, health
checker, admin API) into one ``web.Application``; its cleanup context opens the HTTP
clients (``kvroute.router.forwarding.upstream`` for proxied requests, an aiohttp session for health checks
and scrapes), probes the configured backends once, starts the background loops (health
checks, the engines' ``/metrics`` scraper, and with ``--discovery file|k8s`` the backend
source the pool follows), and closes everything again. :func:`serve` runs it until
SIGTERM/SIGINT, then stops accepting connections, lets in-flight requests and streams
finish for up to ``drain_timeout_s`` and returns; :func:`run` does that on uvloop.

The proxied POST endpoints are served by the lean llhttp server of
``kvroute.router.http.lean_server`` (``--http-server lean``, the default), which hands every
other connection to aiohttp; with ``--http-server aiohttp`` aiohttp serves everything.

Around the proxy: the client gate and admission control (``kvroute.router.http.security``,
``kvroute.router.forwarding.admission``), the router's own OpenAPI document at ``/openapi.json``, and a
server whose connections answer unparsable requests (431, 400) in OpenAI's JSON form and
close connections that take longer than ``request_read_timeout_s`` to send a request head.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import hdrs, web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvroute.router.config import Settings
from kvroute.router.dns_name import DnsName
from kvroute.router.engines.openai import RESPONSE_LOOKUP, STORED_RESPONSE_ROUTES
from kvroute.router.errors import JSON_CONTENT_TYPE, JsonErrorServer, error_middleware, error_response, json_response
from kvroute.router.fleet.backends import Backend, BackendPool
from kvroute.router.fleet.discovery import build_discovery, check_discovery
from kvroute.router.fleet.engine_stats import EngineScraper, scrape_loop
from kvroute.router.fleet.health import HealthChecker
from kvroute.router.forwarding import metrics_merge
from kvroute.router.forwarding.admission import AdmissionControl
from kvroute.router.forwarding.exchange import ClientRequest, ResponseSink
from kvroute.router.forwarding.metrics import CONTENT_TYPE, RouterMetrics, RuntimeStats
from kvroute.router.forwarding.proxy import Proxy, insert_in_loop_turns
from kvroute.router.forwarding.upstream import KEEPALIVE_S, UpstreamClient
from kvroute.router.http.admin import AdminAPI
from kvroute.router.http.aiohttp_exchange import AiohttpSink, client_request
from kvroute.router.http.lean_server import LeanLimits, LeanRoute, LeanServer, LeanStoredRoute, StoredCalls
from kvroute.router.http.openapi import openapi_document
from kvroute.router.http.security import ClientGate, SecretRedactor
from kvroute.router.http.workers import Siblings, WorkerGroup
from kvroute.router.routing.peer_discovery import PeerDiscovery
from kvroute.router.routing.peer_evidence import Answers
from kvroute.router.routing.peer_exchange import PeerExchange, Placement
from kvroute.router.routing.peer_load import BackendLoad
from kvroute.router.routing.precise_index import PreciseIndex
from kvroute.router.routing.request_info import ENDPOINTS, Endpoint
from kvroute.router.routing.routing_engine import RoutingEngine

log = logging.getLogger("kvroute")
_T = TypeVar("_T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: What aiohttp's server calls with each request (the application's dispatcher, by default).
ServerHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class RouterState:
    """The parts of one running router; ``app[STATE]``."""

    settings: Settings
    pool: BackendPool
    routing: RoutingEngine
    metrics: RouterMetrics
    admission: AdmissionControl[Backend]
    gate: ClientGate
    # Created on startup, inside the event loop:
    session: aiohttp.ClientSession | None = None  # health checks and probes
    upstream: UpstreamClient | None = None  # proxied requests
    proxy: Proxy | None = None
    health: HealthChecker | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    #: Precise mode (``--kv-events``): the index kept from the engines' KV events.
    precise: PreciseIndex | None = None
    #: Placements shared with the other router replicas (``--peer-bind`` / ``--peers`` / ``--peers-dns``).
    exchange: PeerExchange | None = None
    #: ``--peers-dns``: the peers found by resolving the name (set on startup).
    peer_discovery: PeerDiscovery | None = None
    #: ``kvroute serve --workers N``: this worker's siblings (their internal Unix sockets).
    siblings: Siblings | None = None


STATE = web.AppKey("kvroute_state", RouterState)
#: The proxied endpoints' POST handlers by path, which the server calls without aiohttp's
#: URL dispatcher and middleware chain (:func:`_dispatch_with_direct_routes`).
DIRECT_ROUTES = web.AppKey("kvroute_direct_routes", dict[str, Handler])
#: The same endpoints' handlers for the lean server (``--http-server lean``), by raw path.
LEAN_ROUTES = web.AppKey("kvroute_lean_routes", dict[bytes, LeanRoute])
#: The same for the calls on a stored response (``STORED_RESPONSE_ROUTES``).
LEAN_STORED_CALLS = web.AppKey("kvroute_lean_stored_calls", StoredCalls)
#: With workers: the internal application this worker serves its siblings on a Unix socket.
INTERNAL_APP = web.AppKey("kvroute_internal_app", web.Application)


def build_app(
    settings: Settings, *, redactor: SecretRedactor | None = None, workers: WorkerGroup | None = None
) -> web.Application:
    """The router as an aiohttp application (not yet started).

    ``redactor``: the log filter of ``kvroute serve``; engine API keys given to the admin
    API at run time are added to it. ``workers``: this process is one worker of
    ``kvroute serve --workers N``: ``/metrics`` merges every worker's, admin writes reach
    every worker, and ``app[INTERNAL_APP]`` is what :func:`serve` offers the siblings
    (:mod:`kvroute.router.http.workers`).
    """
    check_discovery(settings)  # e.g. --discovery k8s without kvroute[k8s]: an error now, not a dead task later
    pool = BackendPool(
        unhealthy_after=settings.unhealthy_after,
        healthy_after=settings.healthy_after,
        breaker_failures=settings.breaker_failures,
        breaker_cooldown_s=settings.breaker_cooldown_s,
    )
    admission: AdmissionControl[Backend] = AdmissionControl(
        max_concurrency=settings.max_concurrency,
        max_backend_concurrency=settings.max_backend_concurrency,
        queue_size=settings.queue_size,
        queue_timeout_s=settings.queue_timeout_s,
    )
    gate = ClientGate(settings)
    metrics = RouterMetrics(lambda: pool, lambda: _runtime_stats(admission, gate))
    precise = _precise_index(settings, pool, metrics) if settings.kv_events else None
    routing = RoutingEngine(settings, precise=precise)
    pool.on_removed(lambda backend: routing.forget_backend(backend.url))
    pool.on_removed(lambda backend: metrics.forget_backend(backend.url))
    if admission.limited:
        pool.on_changed(admission.wake)  # a backend joined or recovered: a waiter may run
    state = RouterState(
        settings=settings,
        pool=pool,
        routing=routing,
        metrics=metrics,
        admission=admission,
        gate=gate,
        precise=precise,
        exchange=_peer_exchange(settings, pool, routing),
        siblings=Siblings(workers) if workers is not None else None,
    )
    metrics.watch_chat_renders(routing.chat_render_counts)
    metrics.watch_conversation_memo(routing.conversation_memo_states)
    metrics.watch_tokenizer_units(routing.tokenizer_unit_counts)
    metrics.watch_tokenizer_new_words(routing.tokenizer_new_word_counts)
    metrics.watch_cache_model(routing.cache_model_states)
    if state.exchange is not None:
        exchange = state.exchange
        metrics.watch_peer_exchange(
            lambda: asdict(exchange.stats),
            lambda: asdict(exchange.load_stats),
            exchange.handshake_counts,
            lambda: asdict(exchange.evidence_stats),
            lambda: asdict(exchange.stored_stats),
        )

    app = web.Application(middlewares=[error_middleware], client_max_size=settings.max_body_bytes)
    app[STATE] = state
    direct_routes: dict[str, Handler] = {}
    lean_routes: dict[bytes, LeanRoute] = {}
    for endpoint in ENDPOINTS:
        direct_routes[endpoint.path] = _proxy_handler(state, endpoint)
        lean_routes[endpoint.path.encode()] = _lean_handler(state, endpoint)
        app.router.add_post(endpoint.path, direct_routes[endpoint.path])
    stored_response_call = _proxy_handler(state, RESPONSE_LOOKUP)
    for method, path, _ in STORED_RESPONSE_ROUTES:
        app.router.add_route(method, path, stored_response_call)
    app[DIRECT_ROUTES] = direct_routes
    app[LEAN_ROUTES] = lean_routes
    app[LEAN_STORED_CALLS] = StoredCalls.of(
        ((method, path) for method, path, _ in STORED_RESPONSE_ROUTES), _lean_stored_call(state)
    )
    app.router.add_get("/v1/models", _models_handler(state))
    app.router.add_get("/health", _health_handler(state))
    app.router.add_get("/livez", _livez)
    app.router.add_get("/metrics", _metrics_handler(state))
    app.router.add_get("/openapi.json", _openapi_handler(settings))
    admin: AdminAPI | None = None
    if settings.admin_token:
        on_secret = redactor.add if redactor is not None else None
        admin = AdminAPI(
            settings,
            pool,
            lambda: _started(state.health),
            on_secret=on_secret,
            decisions=routing.decisions,
            index_tokens=routing.index_tokens,
            siblings=state.siblings,
            peers=lambda: _peers_status(state),
        )
        admin.add_routes(app)
    if workers is not None:
        app[INTERNAL_APP] = _internal_app(state, admin)
    app.cleanup_ctx.append(_lifecycle)
    return app


def _internal_app(state: RouterState, admin: AdminAPI | None) -> web.Application:
    """What this worker answers its siblings on its Unix socket: its own metrics, admin writes."""
    internal = web.Application(middlewares=[error_middleware], client_max_size=state.settings.max_body_bytes)

    async def local_metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(body=_local_exposition(state), headers={"Content-Type": CONTENT_TYPE})

    internal.router.add_get("/metrics", local_metrics)
    if admin is not None:
        admin.add_local_routes(internal)
    return internal


def _peer_exchange(settings: Settings, pool: BackendPool, routing: RoutingEngine) -> PeerExchange | None:
    """The exchange with the other routers, if configured: placements to and from the routing
    engine, this router's own requests in flight to them and theirs into the pool."""
    if settings.peer_bind is None and not settings.peers and settings.peers_dns is None:
        return None

    def apply(placement: Placement) -> None:
        if placement.backend in pool:  # a peer's backend that is not ours stays out of our index
            pending = routing.apply_placement(placement, sliced=True)
            if pending is not None:
                insert_in_loop_turns(pending)

    def own_load() -> dict[str, BackendLoad]:
        computing = routing.computing_blocks()
        return {
            backend.url: BackendLoad(
                backend.own_in_flight, backend.own_in_flight_work_tokens, tuple(computing.get(backend.url, ()))
            )
            for backend in pool
        }

    def apply_load(url: str, load: BackendLoad) -> None:
        pool.set_peer_load(url, load.in_flight, load.work_tokens)
        if url in pool:
            routing.apply_peer_computing(url, load.computing)

    def apply_evidence(url: str, answers: Answers) -> None:
        if url in pool:
            routing.apply_answers(url, answers)

    def apply_stored(response_id: str, url: str) -> None:
        if url in pool:
            routing.apply_stored_response(response_id, url)

    exchange = PeerExchange(
        bind=settings.peer_bind,
        peers=settings.peers,
        apply=apply,
        max_bytes_per_s=settings.peer_max_bytes_per_s,
        own_load=own_load,
        apply_load=apply_load,
        apply_evidence=apply_evidence,
        apply_stored=apply_stored,
        key=settings.peer_key(),
        accepted_key=settings.peer_accepted_key(),
    )
    routing.on_placement(exchange.publish)
    routing.on_answer(exchange.answered)
    routing.on_response_stored(exchange.stored)
    pool.on_load_changed(exchange.load_changed)
    return exchange


def _peers_status(state: RouterState) -> dict[str, Any]:
    """``GET /admin/peers``: the exchange's status and the DNS discovery's, each None when off."""
    discovery = state.peer_discovery
    return {
        "exchange": state.exchange.status() if state.exchange is not None else None,
        "discovery": None
        if discovery is None
        else {
            "name": str(discovery.name),
            "peers": sorted(discovery.peers),
            "lookups": discovery.lookups,
            "failed_lookups": discovery.failed_lookups,
        },
    }


def _precise_index(settings: Settings, pool: BackendPool, metrics: RouterMetrics) -> PreciseIndex:
    """The KV-event index, following the pool and exporting each stream's state."""
    gauge = metrics.kv_events_state
    precise = PreciseIndex.from_settings(
        settings,
        on_state=lambda url, kv_state: gauge.labels(url).set(int(kv_state)),
        on_event_lag=metrics.record_kv_event_lag,
    )
    metrics.watch_kv_events(precise.stream_counts)
    pool.on_added(lambda backend: precise.add_backend(backend.url, backend.kv_events_endpoint))
    pool.on_removed(lambda backend: precise.remove_backend(backend.url))
    return precise


def _runtime_stats(admission: AdmissionControl[Backend], gate: ClientGate) -> RuntimeStats:
    return RuntimeStats(
        active_requests=admission.active,
        queued_requests=admission.queued,
        rejected={**admission.rejected, **gate.rejected},
        rate_limited_clients=gate.tracked_clients,
    )


def _started(part: _T | None) -> _T:
    if part is None:
        raise RuntimeError("the router application has not started")
    return part


# --- handlers --------------------------------------------------------------------------


def _proxy_handler(state: RouterState, endpoint: Endpoint) -> Handler:
    """A proxied endpoint under aiohttp: its request and response through the proxy's seam
    (also called directly, unmatched, by the lean server's hand-over; a stored response's
    own calls, :data:`RESPONSE_LOOKUP`, name it in their matched path)."""
    settings = state.settings
    max_body_bytes = settings.max_body_bytes
    read_timeout_s = settings.request_read_timeout_s

    async def handle(request: web.Request) -> web.StreamResponse:
        sink = AiohttpSink(request)
        client = client_request(request, max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
        stored_id = request.match_info["response_id"] if endpoint is RESPONSE_LOOKUP else None
        await _started(state.proxy).forward(client, endpoint, sink, stored_id)
        return sink.finished()

    return handle


def _lean_handler(state: RouterState, endpoint: Endpoint) -> LeanRoute:
    """A proxied endpoint under the lean server (:mod:`kvroute.router.http.lean_server`)."""

    def handle(request: ClientRequest, sink: ResponseSink) -> Awaitable[None]:
        # The proxy's coroutine itself, not one wrapping it: a coroutine less per request.
        return _started(state.proxy).forward(request, endpoint, sink)

    return handle


def _lean_stored_call(state: RouterState) -> LeanStoredRoute:
    """A call on a stored response under the lean server."""

    def handle(request: ClientRequest, sink: ResponseSink, stored_id: str) -> Awaitable[None]:
        return _started(state.proxy).forward(request, RESPONSE_LOOKUP, sink, stored_id)

    return handle


def _models_handler(state: RouterState) -> Handler:
    async def models(request: web.Request) -> web.StreamResponse:
        if state.gate.active:
            state.gate.check(request)
        return json_response({"object": "list", "data": state.pool.model_cards()})

    return models


def _health_handler(state: RouterState) -> Handler:
    async def health(request: web.Request) -> web.StreamResponse:
        healthy = state.pool.healthy_count()
        if not healthy:
            return error_response(503, "no healthy backend", code="no_healthy_backend")
        return json_response({"status": "ok", "healthy_backends": healthy, "backends": len(state.pool)})

    return health


async def _livez(request: web.Request) -> web.StreamResponse:
    """Liveness: the process serves requests, whatever its backends' health (a liveness
    probe on ``/health`` would restart every router during an engine outage)."""
    return json_response({"status": "alive"})


def _local_exposition(state: RouterState) -> bytes:
    """This process's own metrics."""
    index = state.routing.index_stats()
    for url, blocks in index.blocks.items():
        state.metrics.index_blocks.labels(url).set(blocks)
    state.metrics.index_bytes.set(index.bytes)
    state.metrics.stored_responses.set(state.routing.stored_responses_count)
    return state.metrics.render()


def _metrics_handler(state: RouterState) -> Handler:
    async def metrics(request: web.Request) -> web.StreamResponse:
        own = _local_exposition(state)
        if state.siblings is not None:
            own = await _merged_exposition(state.siblings, own)
        return web.Response(body=own, headers={"Content-Type": CONTENT_TYPE})

    return metrics


async def _merged_exposition(siblings: Siblings, own: bytes) -> bytes:
    """Every worker's metrics merged (a sibling that does not answer in time is left out)."""
    answers = await siblings.each("GET", "/metrics")
    parsed = [(siblings.group.index, metrics_merge.parse(own.decode()))]
    missing = 0
    for answer in answers:
        if answer.ok:
            parsed.append((answer.index, metrics_merge.parse(answer.body.decode())))
        else:
            missing += 1
            log.warning("metrics: worker %d did not answer: %s", answer.index, answer.error or answer.status)
    parsed.sort(key=lambda item: item[0])
    families = metrics_merge.merge(families for _, families in parsed)
    workers = GaugeMetricFamily("kvroute_workers", "Router worker processes (kvroute serve --workers).")
    workers.add_metric([], siblings.group.count)
    answered = GaugeMetricFamily(
        "kvroute_workers_unreachable", "Sibling workers whose metrics this scrape could not include."
    )
    answered.add_metric([], missing)
    failures = CounterMetricFamily(
        "kvroute_worker_scrape_failures",
        "Calls from the answering worker to a sibling that failed (timeout, refused).",
    )
    failures.add_metric([], siblings.failures)
    families += [workers, answered, failures, metrics_merge.worker_requests(parsed)]
    return metrics_merge.render(families)


def _openapi_handler(settings: Settings) -> Handler:
    document = openapi_document(admin=bool(settings.admin_token), api_keys=bool(settings.api_keys))

    async def openapi(request: web.Request) -> web.StreamResponse:
        return web.Response(body=document, content_type=JSON_CONTENT_TYPE)

    return openapi


# --- lifecycle -------------------------------------------------------------------------
async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    settings = state.settings
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None),
    )
    upstream = UpstreamClient(connect_timeout=settings.connect_timeout_s)
    state.session = session
    state.upstream = upstream
    state.health = HealthChecker(settings, state.pool, session)
    state.proxy = Proxy(
        settings,
        state.pool,
        state.routing,
        state.metrics,
        upstream,
        admission=state.admission,
        check_client=state.gate.check if state.gate.active else None,
    )
    state.pool.on_removed(lambda backend: upstream.forget(backend.access.base_url))
    scraper = EngineScraper(session, timeout_s=settings.health_timeout_s, listeners=[state.routing.update_engine_stats])
    state.pool.on_removed(lambda backend: scraper.forget_backend(backend.url))
    peer_discovery: asyncio.Task[None] | None = None
    try:
        await _admit_configured_backends(state.health, settings)
        state.tasks.append(asyncio.create_task(state.health.run(), name="kvroute-health"))
        state.tasks.append(
            asyncio.create_task(
                scrape_loop(
                    lambda: state.pool,
                    session,
                    interval_s=settings.engine_scrape_interval_s,
                    timeout_s=settings.health_timeout_s,
                    scraper=scraper,
                ),
                name="kvroute-engine-stats",
            )
        )
        if settings.discovery != "static":
            # Backends come and go with the source; the pool follows (new ones probed, gone ones drained).
            source = build_discovery(settings)
            state.tasks.append(asyncio.create_task(source.run(state.health.sync), name="kvroute-discovery"))
        if state.precise is not None:
            await state.precise.start()
        if state.exchange is not None:
            siblings = state.siblings
            wait_for = [siblings.group.placements_endpoint(i) for i in siblings.group.siblings] if siblings else []
            if not await state.exchange.start(wait_for=wait_for):
                log.warning("placement exchange: not every sibling worker subscribed within 10 s")
            if settings.peers_dns is not None:
                state.peer_discovery = PeerDiscovery(DnsName.parse(settings.peers_dns), state.exchange)
                peer_discovery = asyncio.create_task(state.peer_discovery.run(), name="kvroute-peer-discovery")
        yield
    finally:
        if peer_discovery is not None:  # first: it must not subscribe on a stopped exchange
            peer_discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await peer_discovery
        if state.exchange is not None:
            await state.exchange.stop()
        if state.precise is not None:
            await state.precise.stop()
        for task in state.tasks:
            task.cancel()
        for task in state.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        state.tasks.clear()
        upstream.close()
        await session.close()
        if state.siblings is not None:
            await state.siblings.close()


async def _admit_configured_backends(health: HealthChecker, settings: Settings) -> None:
    configured = settings.backend_ranks()
    results = await asyncio.gather(*(health.admit(config) for config in configured), return_exceptions=True)
    for config, result in zip(configured, results, strict=True):
        if isinstance(result, BaseException):
            log.warning("backend %s not added: %s", config.name, result)
        elif not result.healthy:
            log.warning("backend %s is not healthy yet; health checks continue", config.name)


# --- running ---------------------------------------------------------------------------
class _RouterRunner(web.AppRunner):
    """aiohttp's runner, serving the application through a :class:`~kvroute.router.errors.JsonErrorServer`,
    or with ``lean`` a :class:`~kvroute.router.http.lean_server.LeanServer` (the proxied POSTs on
    llhttp, everything else handed to that JSON-error server)."""

    def __init__(
        self,
        app: web.Application,
        connection_options: dict[str, Any],
        *,
        lean: LeanLimits | None = None,
        **runner_options: Any,
    ) -> None:
        super().__init__(app, **runner_options)
        self._connection_options = connection_options
        self._lean = lean

    async def _make_server(self) -> web.Server:
        # The hook every aiohttp runner implements (abstract in BaseRunner). aiohttp's own
        # server starts the application and wires its handler and request factory; the
        # JSON-error server serves those, with the connection options.
        serving = await super()._make_server()
        serving.request_handler = _dispatch_with_direct_routes(self.app, serving.request_handler)
        lean_routes = self.app.get(LEAN_ROUTES)
        if self._lean is not None and lean_routes and _direct_routes_allowed(self.app):
            # The lean server takes exactly what the direct route would (and is off when it is).
            return LeanServer(
                serving,
                routes=lean_routes,
                limits=self._lean,
                stored_calls=self.app.get(LEAN_STORED_CALLS),
                **self._connection_options,
            )
        return JsonErrorServer(serving, **self._connection_options)


def _dispatch_with_direct_routes(app: web.Application, dispatch: ServerHandler) -> ServerHandler:
    """The server's request handler: a proxied POST goes straight to its handler, inside
    the same :func:`~kvroute.router.errors.error_middleware`; everything else to aiohttp's
    ``dispatch`` (the application's URL dispatcher and middlewares).

    Why: per request, the dispatcher's resolve, match-info bookkeeping and middleware chain
    (the error middleware, then aiohttp's own current-app one) cost ~15-20 us of CPU on
    the shared 2-core machine, several percent of a proxied request (benchmarks/README.md).
    The answer is the same: the direct path takes exactly the requests the dispatcher would
    give those handlers (method POST, the route's path as aiohttp matches it), runs the
    only middleware the application has, and leaves ``Expect`` (aiohttp's 100-continue
    handling) to the dispatcher. If the application ever gets another middleware or a
    response-prepare signal, the direct path is off, so neither can be bypassed.
    """
    routes = app.get(DIRECT_ROUTES)
    if not routes or not _direct_routes_allowed(app):
        return dispatch

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.method == "POST" and hdrs.EXPECT not in request.headers:
            handler = routes.get(request.rel_url.path_safe)  # what the dispatcher matches routes on
            if handler is not None:
                # The application's request factory makes web.Request objects (no cast():
                # a function call per request).
                return await error_middleware(request, handler)  # type: ignore[arg-type]
        return await dispatch(request)

    return handle


def _direct_routes_allowed(app: web.Application) -> bool:
    """Whether the proxied POSTs may skip the dispatcher: the application has the direct
    routes, no middleware but the error middleware, and no response-prepare signal."""
    return (
        DIRECT_ROUTES in app
        and bool(app[DIRECT_ROUTES])
        and list(app.middlewares) == [error_middleware]
        and not app.on_response_prepare
    )


def make_runner(app: web.Application, settings: Settings) -> web.AppRunner:
    """The runner the router is served with (also used by tests that run it in-process)."""
    connection_options: dict[str, Any] = {
        "access_log": None,  # nothing per request at INFO: it costs more than the proxying
        "max_line_size": settings.max_header_bytes,
        "max_field_size": settings.max_header_bytes,
        # Closes idle keep-alive connections and those whose request head never completes
        # (slowloris); aiohttp's default would keep them for an hour.
        "keepalive_timeout": settings.request_read_timeout_s,
    }
    lean = (
        LeanLimits(
            max_header_bytes=settings.max_header_bytes,
            max_body_bytes=settings.max_body_bytes,
            read_timeout_s=settings.request_read_timeout_s,
        )
        if settings.http_server == "lean"
        else None
    )
    return _RouterRunner(
        app,
        connection_options,
        lean=lean,
        handle_signals=False,
        handler_cancellation=True,  # a client hanging up cancels its handler: upstream closed at once
        shutdown_timeout=settings.drain_timeout_s,
    )


async def serve(
    settings: Settings,
    app: web.Application,
    *,
    workers: WorkerGroup | None = None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Run the router until SIGTERM/SIGINT, then drain in-flight work and return.

    ``workers``: this process is one worker of several on the same port (SO_REUSEPORT);
    it also serves ``app[INTERNAL_APP]`` on its Unix socket. ``on_listening`` is called
    in the loop once every socket listens.
    """
    runner = make_runner(app, settings)
    await runner.setup()
    internal: web.AppRunner | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=2048, reuse_port=workers is not None)
        await site.start()
        host, port = runner.addresses[0][:2]
        if workers is None:
            log.info("kvroute listening on http://%s:%d (policy %s)", host, port, settings.policy)
        else:
            internal = web.AppRunner(app[INTERNAL_APP], handle_signals=False, access_log=None)
            await internal.setup()
            path = workers.socket_path(workers.index)
            path.unlink(missing_ok=True)  # left by a worker this one replaces
            await web.UnixSite(internal, str(path)).start()
            log.info("worker %d of %d listening on http://%s:%d", workers.index, workers.count, host, port)
        if on_listening is not None:
            on_listening()
        await stop.wait()
        log.info("shutting down: draining in-flight requests for up to %.1f s", settings.drain_timeout_s)
    finally:
        await runner.cleanup()
        if internal is not None:
            await internal.cleanup()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    log.info("kvroute stopped")


def run(
    settings: Settings,
    app: web.Application,
    *,
    workers: WorkerGroup | None = None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Run :func:`serve` on uvloop (when installed)."""
    main = serve(settings, app, workers=workers, on_listening=on_listening)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        asyncio.run(main)
    else:
        uvloop.run(main)
