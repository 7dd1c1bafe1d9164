"""The proxied endpoints' direct route (``_dispatch_with_direct_routes``) answers exactly as
aiohttp's URL dispatcher and the error middleware do: the same requests sent to a router
served with it and to one served without it get the same answers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from kvroute.router.config import Settings
from kvroute.router.errors import error_middleware
from kvroute.router.http.app import DIRECT_ROUTES, _dispatch_with_direct_routes, build_app, make_runner
from tests.servers import RouterServer, ServerLoop, SimServer, start_server

CHAT = orjson.dumps({"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "Name a river."}]})

#: (method, path, headers, body): what each of the two routers is sent.
REQUESTS: list[tuple[str, str, dict[str, str], bytes]] = [
    ("POST", "/v1/chat/completions", {"content-type": "application/json"}, CHAT),
    ("POST", "/v1/chat/completions?trace=1", {"content-type": "application/json"}, CHAT),
    ("POST", "/v1/chat/completions", {"content-type": "application/json", "expect": "100-continue"}, CHAT),
    ("POST", "/v1/chat/completions", {"content-type": "application/json", "expect": "something-else"}, CHAT),
    ("POST", "/v1/chat/completions", {"content-type": "application/json"}, b"{not json"),
    ("POST", "/v1/chat/completions", {"content-type": "application/json"}, b'{"model": "nonexistent"}'),
    ("POST", "/v1/chat/completions/", {"content-type": "application/json"}, CHAT),
    ("POST", "/v1/chat%2Fcompletions", {"content-type": "application/json"}, CHAT),
    ("POST", "/V1/chat/completions", {"content-type": "application/json"}, CHAT),
    ("POST", "/v1/completions", {"content-type": "application/json"}, b'{"model": "sim", "prompt": "hi"}'),
    ("GET", "/v1/chat/completions", {}, b""),
    ("PUT", "/v1/chat/completions", {"content-type": "application/json"}, CHAT),
    ("GET", "/health", {}, b""),
    ("POST", "/health", {}, b""),
    ("GET", "/nowhere", {}, b""),
]


def _start(server_loop: ServerLoop, sim: SimServer, *, direct: bool) -> RouterServer:
    settings = Settings.model_validate(
        {"policy": "round_robin", "health_interval_s": 3600.0, "drain_timeout_s": 5.0, "backends": [sim.url]}
    )
    app = build_app(settings)
    if not direct:
        del app[DIRECT_ROUTES]
    runner, url = server_loop.run(start_server(app, make_runner(app, settings)))
    return RouterServer(url=url, runner=runner, loop=server_loop)


@pytest.fixture
def routers(server_loop: ServerLoop, sim_engines: Any) -> Iterator[tuple[RouterServer, RouterServer]]:
    (sim,) = sim_engines(1)
    direct = _start(server_loop, sim, direct=True)
    dispatched = _start(server_loop, sim, direct=False)
    yield direct, dispatched
    dispatched.stop()
    direct.stop()


def _answer(client: httpx.Client, url: str, method: str, path: str, headers: dict[str, str], body: bytes) -> Any:
    response = client.request(method, url + path, headers=headers, content=body)
    kvroute_headers = sorted(name for name in response.headers if name.startswith("x-kvroute-"))
    content_type = response.headers.get("content-type", "")
    payload = response.json() if content_type.startswith("application/json") else response.text
    if response.status_code == 200 and isinstance(payload, dict) and "choices" in payload:
        payload = sorted(payload)  # generated text and ids differ per request: compare the shape
    return response.status_code, response.headers.get("allow"), content_type, kvroute_headers, payload


def test_direct_routes_answer_as_the_dispatcher_does(routers: tuple[RouterServer, RouterServer]) -> None:
    direct, dispatched = routers
    with httpx.Client(timeout=10.0) as client:
        for method, path, headers, body in REQUESTS:
            ours = _answer(client, direct.url, method, path, headers, body)
            theirs = _answer(client, dispatched.url, method, path, headers, body)
            assert ours == theirs, (method, path, headers)
        # The proxied requests were proxied by both (not all answered with errors).
        assert _answer(client, direct.url, *REQUESTS[0])[0] == 200


def test_the_direct_route_is_off_for_anything_it_would_bypass() -> None:
    async def dispatch(request: web.BaseRequest) -> web.StreamResponse:
        raise AssertionError("never called here")

    app = build_app(Settings.model_validate({"policy": "round_robin"}))
    assert _dispatch_with_direct_routes(app, dispatch) is not dispatch

    @web.middleware
    async def another(request: web.Request, handler: Any) -> web.StreamResponse:
        return await handler(request)

    with_middleware = build_app(Settings.model_validate({"policy": "round_robin"}))
    with_middleware.middlewares.append(another)
    assert list(with_middleware.middlewares) == [error_middleware, another]
    assert _dispatch_with_direct_routes(with_middleware, dispatch) is dispatch

    with_signal = build_app(Settings.model_validate({"policy": "round_robin"}))

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-prepared"] = "1"

    with_signal.on_response_prepare.append(on_prepare)
    assert _dispatch_with_direct_routes(with_signal, dispatch) is dispatch
