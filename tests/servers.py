"""The test servers: a background uvloop, in-process sim engines and routers on real sockets,
and a ``/metrics`` scrape. The fixtures that start them are in ``conftest.py``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import openai
import uvloop
from aiohttp import web, web_app
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from kvroute.benchmarks.sim_engine.config import SimEngineConfig
    from kvroute.benchmarks.sim_engine.server import SimEngine
    from kvroute.router.http.app import RouterState

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

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
            forget_stopped_apps()


def forget_stopped_apps() -> None:
    """Drop aiohttp's cache of middleware-wrapped handlers (1,024 of them, private): each
    holds its app, so every server a test session stopped stayed in memory (a sim engine
    ~32 MB: a test worker grew to ~10 GB)."""
    cached = getattr(web_app, "_cached_build_middleware", None)
    if cached is not None:
        cached.cache_clear()


@dataclass
class SimServer(_Server):
    """A running simulated engine."""

    config: SimEngineConfig | None = None

    @property
    def engine(self) -> SimEngine:
        from kvroute.benchmarks.sim_engine.server import SIM_ENGINE

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
        from kvroute.router.http.app import STATE

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


def engine_stand_in(routes: Iterable[tuple[str, str, Handler]], model: str = "m") -> web.Application:
    """An upstream answering ``routes`` (method, path, handler) as a test needs a backend to,
    healthy and serving ``model`` for the router's checks."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model}]})

    app = web.Application()
    app.router.add_get("/health", models)
    app.router.add_get("/v1/models", models)
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app


async def start_server(
    app: web.Application, runner: web.AppRunner | None = None, port: int = 0
) -> tuple[web.AppRunner, str]:
    runner = runner or web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def until(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> None:
    """In a test's event loop: yield to it until ``predicate`` holds; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def wait_until(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
