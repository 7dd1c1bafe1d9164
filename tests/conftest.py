"""Shared fixtures: simulated engines and kvroute routers on real sockets.

Every server runs on ONE uvloop in a background thread (the session-wide ``server_loop``),
listening on 127.0.0.1 with an ephemeral port. Tests talk to them over HTTP only, so they
may use synchronous clients (``openai.OpenAI``, ``httpx.Client``) or async ones
(``openai.AsyncOpenAI``) from the test's own event loop alike.

Fixtures (factories; everything they start is stopped when the test ends):

* ``sim_engines(n=1, **config) -> list[SimServer]``: ``n`` simulated vLLM replicas;
  ``config`` holds :class:`~benchmarks.sim_engine.config.SimEngineConfig` fields, e.g.
  ``sim_engines(2, models=("a",), time_scale=50.0, decode_tokens_per_s=20.0)``.
  Defaults make them fast: ``time_scale=1000``. ``port=`` binds a fixed port (to bring a
  stopped replica back at the same URL); by default each gets a free one.
* ``router_server(backends, **settings) -> RouterServer``: an in-process router
  (``router.app.build_app``, served exactly as ``kvroute serve`` serves it) in front of
  ``backends`` (URLs or ``SimServer``\\ s); ``settings`` are :class:`~router.config.Settings`
  fields. Defaults: ``policy="round_robin"``, a long health interval (tests drive health
  explicitly), a short drain timeout.

Handles: ``server.url`` (base URL), ``router.v1`` (``url + "/v1"``), ``router.client()`` /
``router.async_client()`` (``openai`` clients without retries), ``server.metrics()``
(a :class:`Scrape` of its ``/metrics``), ``router.state`` (the live
:class:`~router.app.RouterState`: read it, do not mutate it from the test thread),
``sim.set_fault(mode, count)``, ``sim.stop()`` (its URL then refuses connections).

* ``recording_engine -> (url, received)``: a bare HTTP backend (``/health``, ``/v1/models``,
  ``/v1/chat/completions``) that answers 200 and appends ``(headers, raw body)`` of every
  request it gets to ``received``: to see exactly what kvroute forwards.

Shared assertions (plain functions) live in ``helpers.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import openai
import pytest
import uvloop
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

# The servers are imported inside the fixtures, so that a half-written module of one
# component never stops the other components' tests from being collected.
if TYPE_CHECKING:
    from benchmarks.sim_engine.config import SimEngineConfig
    from benchmarks.sim_engine.server import SimEngine
    from benchmarks.sim_engine.tokens import SimTokenizer
    from router.app import RouterState

T = TypeVar("T")

# Generous: a 2-core machine shared with other test runs can be slow.
START_TIMEOUT_S = 60.0


class ServerLoop:
    """A uvloop event loop running in a daemon thread; servers live there."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = START_TIMEOUT_S) -> T:
        """Run ``coro`` on the server loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, function: Callable[[], T]) -> T:
        """Run a plain function on the server loop's thread (to touch server state safely)."""

        async def wrapper() -> T:
            return function()

        return self.run(wrapper())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@dataclass
class Scrape:
    """Samples of one ``/metrics`` scrape."""

    samples: list[tuple[str, dict[str, str], float]]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = [
            (sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
        return cls(samples)

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def label_values(self, name: str, label: str) -> set[str]:
        """Every value of ``label`` among the samples called ``name``."""
        return {labels[label] for sample_name, labels, _ in self.samples if sample_name == name and label in labels}


@dataclass
class _Server:
    url: str
    runner: web.AppRunner
    loop: ServerLoop
    stopped: bool = field(default=False, init=False)

    def metrics(self) -> Scrape:
        """Scrape this server's /metrics."""
        response = httpx.get(self.url + "/metrics", timeout=30)
        response.raise_for_status()
        return Scrape.parse(response.text)

    def stop(self) -> None:
        """Stop the server: its port closes and refuses new connections."""
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
        if not self.stopped:
            self.stopped = True
            self.loop.run(self.runner.cleanup())


@dataclass
class SimServer(_Server):
    """A running simulated engine."""

    config: SimEngineConfig | None = None

    @property
    def engine(self) -> SimEngine:
        from benchmarks.sim_engine.server import SIM_ENGINE

        return self.runner.app[SIM_ENGINE]

    def set_fault(self, mode: str, count: int | None = None) -> None:
        """Make the next ``count`` generation requests suffer ``mode`` (see /sim/fault)."""
        response = httpx.post(self.url + "/sim/fault", json={"mode": mode, "count": count}, timeout=30)
        response.raise_for_status()


@dataclass
class RouterServer(_Server):
    """A running in-process router."""

    _client: openai.OpenAI | None = field(default=None, init=False, repr=False)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def state(self) -> RouterState:
        from router.app import STATE

        return self.runner.app[STATE]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """A synchronous ``openai`` client of this router (no SDK retries); reused when called without options."""
        if kwargs:
            return openai.OpenAI(base_url=self.v1, api_key=kwargs.pop("api_key", "test"), max_retries=0, **kwargs)
        if self._client is None:
            self._client = openai.OpenAI(base_url=self.v1, api_key="test", max_retries=0)
        return self._client

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An async ``openai`` client of this router (no SDK retries)."""
        return openai.AsyncOpenAI(base_url=self.v1, api_key=kwargs.pop("api_key", "test"), max_retries=0, **kwargs)


async def _start(
    app: web.Application, runner: web.AppRunner | None = None, port: int = 0
) -> tuple[web.AppRunner, str]:
    runner = runner or web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    """The background event loop every test server runs on."""
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def sim_tokenizer() -> SimTokenizer:
    """The default tokenizer, loaded once and shared by every sim engine of the session."""
    from benchmarks.sim_engine.tokens import SimTokenizer

    return SimTokenizer.load(None)


@pytest.fixture
def sim_engines(server_loop: ServerLoop, sim_tokenizer: SimTokenizer) -> Iterator[Callable[..., list[SimServer]]]:
    """Factory: ``sim_engines(n=1, **SimEngineConfig fields) -> list[SimServer]``."""
    from benchmarks.sim_engine.config import SimEngineConfig
    from benchmarks.sim_engine.server import build_app as build_sim_app

    started: list[SimServer] = []

    def start(n: int = 1, **options: Any) -> list[SimServer]:
        options.setdefault("time_scale", 1000.0)
        port = options.pop("port", 0)  # a fixed port: e.g. to bring a stopped replica back
        servers = []
        for index in range(n):
            config = SimEngineConfig(port=port, engine_id=str(len(started) + index), **options)
            app = build_sim_app(config, sim_tokenizer)
            runner, url = server_loop.run(_start(app, port=port))
            servers.append(SimServer(url=url, runner=runner, loop=server_loop, config=config))
        started.extend(servers)
        return servers

    yield start
    for server in reversed(started):
        server.stop()


@pytest.fixture
def router_server(server_loop: ServerLoop) -> Iterator[Callable[..., RouterServer]]:
    """Factory: ``router_server(backends, **Settings fields) -> RouterServer``."""
    from router.app import build_app as build_router_app, make_runner
    from router.config import Settings

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
        runner, url = server_loop.run(_start(app, make_runner(app, settings)))
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
    runner, url = server_loop.run(_start(app))
    yield url, received
    server_loop.run(runner.cleanup())
