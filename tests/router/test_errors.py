"""Every error the router answers is OpenAI-style JSON with the right status, and it keeps serving."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
from aiohttp import web

from tests.helpers import assert_openai_error, still_serves
from tests.servers import RouterServer, engine_stand_in, start_server, wait_until

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def router(sim_engines: Any, router_server: Any) -> RouterServer:
    return router_server(sim_engines(1), max_body_bytes=256 * 1024)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"", "invalid_json"),
        (b"[1, 2, 3]", "invalid_json"),
        (b'"a string"', "invalid_json"),
        (b"\xff\xfe\x00garbage", "invalid_json"),
        (b'{"messages": []}', "missing_model"),
        (b'{"model": 42, "messages": []}', "invalid_model"),
        (b'{"model": "", "messages": []}', "invalid_model"),
        (b'{"model": "sim", "stream": "yes", "messages": []}', "invalid_stream"),
        (b"[" * 20_000 + b"]" * 20_000, "invalid_json"),
    ],
    ids=[
        "broken",
        "empty",
        "array",
        "string",
        "not-utf8",
        "no-model",
        "model-int",
        "model-empty",
        "stream-str",
        "deep-nesting",
    ],
)
def test_bad_bodies_are_400(router: RouterServer, body: bytes, code: str) -> None:
    response = httpx.post(router.url + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert_openai_error(response, 400, code)
    assert response.headers["x-request-id"]
    still_serves(router)


def test_unknown_model_is_404(router: RouterServer) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        router.client().chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert raised.value.code == "model_not_found"
    assert raised.value.type == "invalid_request_error"


def test_anthropics_client_reads_the_routers_own_errors(sim_engines: Any, router_server: Any, server_loop: Any) -> None:
    """Claude Code's client (``anthropic``) gets the router's errors on the Messages API's
    paths as that API's own: its status and Anthropic's ``error.type``. The same error on
    a chat path keeps OpenAI's type."""
    (engine,) = sim_engines(1)
    router = router_server([engine], unhealthy_after=1)
    client = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)  # type: ignore[arg-type]
    assert raised.value.body == {
        "type": "error",
        "error": {
            "message": "The model `no-such-model` does not exist.",
            "type": "not_found_error",
            "code": "model_not_found",
        },
    }
    chat = httpx.post(router.url + CHAT, json={"model": "no-such-model", "messages": MESSAGES}, timeout=30)
    assert (chat.status_code, chat.json()["error"]["type"]) == (404, "invalid_request_error")
    broken = httpx.post(router.url + "/v1/messages/count_tokens", content=b"{", timeout=30)
    assert (broken.status_code, broken.json()["error"]["type"]) == (400, "invalid_request_error")
    engine.stop()
    server_loop.run(router.state.health.check_all())
    with pytest.raises(anthropic.InternalServerError) as down:
        client.messages.create(model="sim", max_tokens=4, messages=MESSAGES)  # type: ignore[arg-type]
    assert (down.value.status_code, down.value.body["error"]["type"]) == (503, "overloaded_error")  # type: ignore[index]


def test_body_over_the_limit_is_413(router: RouterServer) -> None:
    huge = {"model": "sim", "messages": [{"role": "user", "content": "x" * (300 * 1024)}]}
    response = httpx.post(router.url + CHAT, json=huge, timeout=30)
    assert_openai_error(response, 413, "request_too_large")
    still_serves(router)


def test_unknown_path_and_wrong_method(router: RouterServer) -> None:
    assert_openai_error(httpx.get(router.url + "/v1/nope", timeout=30), 404, "not_found")
    assert_openai_error(httpx.post(router.url + "/admin/backends", json={}, timeout=30), 404, "not_found")
    wrong = httpx.get(router.url + CHAT, timeout=30)
    assert_openai_error(wrong, 405, "method_not_allowed")
    assert "POST" in wrong.headers["allow"]
    assert_openai_error(httpx.delete(router.url + "/metrics", timeout=30), 405)


def test_engine_errors_are_relayed_as_the_engine_wrote_them(router: RouterServer) -> None:
    response = httpx.post(router.url + CHAT, json={"model": "sim", "messages": "not a list"}, timeout=30)
    assert response.status_code == 400
    assert "error" in response.json()
    assert response.headers["x-kvroute-backend"]


def test_no_healthy_backend_is_503(router_server: Any) -> None:
    router = router_server(["http://127.0.0.1:9"])  # discard port: nothing listens
    response = httpx.post(router.url + CHAT, json={"model": "sim", "messages": MESSAGES}, timeout=30)
    assert_openai_error(response, 503, "no_healthy_backend")
    assert_openai_error(httpx.get(router.url + "/health", timeout=30), 503)


def test_backend_dying_after_routing_is_a_502(sim_engines: Any, router_server: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim])
    sim.stop()
    response = httpx.post(router.url + CHAT, json={"model": "sim", "messages": MESSAGES}, timeout=30)
    assert_openai_error(response, 502, "backend_unreachable")


def test_upstream_timeout_is_504(sim_engines: Any, router_server: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim], first_byte_timeout_s=0.3)
    sim.set_fault("hang_before_first_byte", 1)
    response = httpx.post(router.url + CHAT, json={"model": "sim", "messages": MESSAGES, "stream": True}, timeout=30)
    assert_openai_error(response, 504, "upstream_timeout")
    still_serves(router)


def test_oversized_headers_are_refused_and_the_router_survives(router: RouterServer) -> None:
    response = httpx.post(
        router.url + CHAT,
        json={"model": "sim", "messages": MESSAGES},
        headers={"x-big": "a" * (64 * 1024)},
        timeout=30,
    )
    assert response.status_code in (400, 413, 431)
    still_serves(router)


def test_odd_values_in_other_fields_are_the_engines_to_judge(router: RouterServer) -> None:
    for body in (
        {"model": "sim", "messages": MESSAGES, "max_tokens": "lots"},
        {"model": "sim", "messages": [{"role": "user"}] * 10_000, "max_tokens": -5},
        {"model": "sim", "messages": MESSAGES, "stream_options": "include"},
        {"model": "sim", "messages": MESSAGES, "user": {"nested": [1, 2]}},
    ):
        response = httpx.post(router.url + CHAT, json=body, timeout=30)
        assert response.status_code < 500, (body, response.text)
        assert response.headers.get("x-kvroute-backend"), (body, response.status_code, response.text[:300])
    still_serves(router)


def test_anthropics_client_reads_a_stream_cut_short(server_loop: Any, router_server: Any) -> None:
    """A Messages stream its engine breaks off after the first event ends with the router's
    ``event: error`` in Anthropic's form, which the anthropic client raises with its type."""

    async def messages(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        start = {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "m",
                "usage": {"input_tokens": 3, "output_tokens": 0},
            },
        }
        await response.write(b"event: message_start\ndata: " + orjson.dumps(start) + b"\n\n")
        assert request.transport is not None
        request.transport.close()  # the engine dies mid-stream
        return response

    runner, url = server_loop.run(start_server(engine_stand_in([("POST", "/v1/messages", messages)])))
    try:
        router = router_server([url])
        client = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0)
        events = []
        with pytest.raises(anthropic.APIStatusError) as raised:
            for event in client.messages.create(model="m", max_tokens=4, messages=MESSAGES, stream=True):  # type: ignore[arg-type]
                events.append(event.type)
        assert events == ["message_start"]
        assert raised.value.body["error"]["type"] == "api_error", raised.value.body  # type: ignore[index]
        wait_until(lambda: all(backend.in_flight == 0 for backend in router.state.pool))
    finally:
        server_loop.run(runner.cleanup())
