"""Bad input of every kind gets a fast 4xx in OpenAI's error form, and the router keeps serving.

The router runs its default policy (cache_aware: every body is also tokenized for routing,
so bad input meets the tokenizer too) in front of one sim engine. Some answers come from
the router itself (it cannot parse or route the request), others from the engine (a
well-formed request the engine rejects); both must be 4xx with an ``error`` object, never
a 5xx, a hang, or a dead router.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import assert_openai_error, still_serves
from tests.servers import RouterServer, wait_until

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
# How long the router waits for a request head. Not 1 s: the client and the router share one
# process here, and once (CI, 2026-12-05, the dependency-floor run beside the e2e tier's vLLM
# engines) still_serves' fresh connection ended in an APIConnectionError that runs alone never
# showed, most likely the client starved that long between its connect and its head.
READ_TIMEOUT_S = 3.0
# Generous: "fast" means no waiting on anything, on a loaded 2-core machine.
FAST_S = 10.0

WRONG_VALUES: list[Any] = [None, True, 0, -1, 1.5, "", "text", [], [1, "a"], {}, {"a": {"b": []}}]


@pytest.fixture
def router(sim_engines: Any, router_server: Any) -> RouterServer:
    return router_server(
        sim_engines(1),
        policy="cache_aware",
        max_body_bytes=256 * 1024,
        max_header_bytes=8 * 1024,
        request_read_timeout_s=READ_TIMEOUT_S,
    )


def post(router: RouterServer, body: bytes, path: str = CHAT, **headers: str) -> httpx.Response:
    started = time.monotonic()
    response = httpx.post(
        router.url + path, content=body, headers={"Content-Type": "application/json", **headers}, timeout=60
    )
    assert time.monotonic() - started < FAST_S, "bad input must be answered without waiting on anything"
    return response


def assert_client_error(response: httpx.Response) -> dict[str, Any]:
    """A 4xx with an OpenAI-style error object, whoever answered (router or engine)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert isinstance(error, dict) and isinstance(error["message"], str) and error["message"]
    assert "type" in error and "code" in error
    return error


# --- bodies the router cannot use -----------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "sim", "messages": [}',
        b'{"model": "sim"',
        b"null",
        b"true",
        b"12",
        b'"text"',
        b"[]",
        b'{"model": "sim", "messages": [{"role": "user", "content": "\xc3\x28"}]}',  # invalid UTF-8
        b'{"model": "sim", "messages": [{"role": "user", "content": "\\ud800"}]}',  # lone surrogate
        b'{"model": "sim", "max_tokens": 1e1000, "messages": []}',  # a number that is not a double
        b'{"model": "sim", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"a": ' * 5_000 + b"1" + b"}" * 5_000,
        b'{"messages": [{"role": "user", "content": "hi"}]}',
        b"\x00\x01\x02",
    ],
    ids=[
        "broken",
        "unterminated",
        "null",
        "bool",
        "number",
        "string",
        "array",
        "invalid-utf8",
        "lone-surrogate",
        "infinite-number",
        "nested-100k",
        "objects-5k-deep",
        "no-model",
        "binary",
    ],
)
def test_unusable_bodies_are_400_from_the_router(router: RouterServer, body: bytes) -> None:
    response = post(router, body)
    assert_openai_error(response, 400)
    assert "x-kvroute-backend" not in response.headers  # the router answered itself
    still_serves(router)


def _positive_int(value: Any) -> bool:
    # As vLLM reads integers (pydantic's lax mode): JSON true is 1.
    return value is True or (isinstance(value, int) and value >= 1)


# What each field of a chat request may hold, as the sim engine judges it like vLLM (null
# means "not given" for the optional ones; stream_options without stream must be empty).
VALID: dict[str, Any] = {
    "model": lambda value: value == "sim",
    "messages": lambda value: False,  # none of WRONG_VALUES is a list of messages
    "stream": lambda value: value is None or isinstance(value, bool),  # the router itself wants a boolean
    "stream_options": lambda value: value is None or value == {},
    "max_tokens": lambda value: value is None or _positive_int(value),
    "max_completion_tokens": lambda value: value is None or _positive_int(value),
    "n": lambda value: value is None or _positive_int(value),
    "cache_salt": lambda value: value is None or (isinstance(value, str) and value != ""),
}


@pytest.mark.parametrize("field", list(VALID))
def test_wrong_types_in_every_field(router: RouterServer, field: str) -> None:
    wrong = [value for value in WRONG_VALUES if not VALID[field](value)]
    assert len(wrong) >= 5
    for value in wrong:
        body = {"model": "sim", "messages": MESSAGES, "max_tokens": 4, field: value}
        response = post(router, httpx.Request("POST", "/", json=body).content)
        assert_client_error(response)
    still_serves(router)


@pytest.mark.parametrize(
    "message",
    [{"role": 7, "content": "x"}, {"role": "user", "content": 7}, {"content": "no role"}, "a string", 7, None],
    ids=["role-int", "content-int", "no-role", "string", "int", "null"],
)
def test_wrong_types_inside_messages(router: RouterServer, message: Any) -> None:
    body = {"model": "sim", "messages": [message], "max_tokens": 4}
    assert_client_error(post(router, httpx.Request("POST", "/", json=body).content))
    still_serves(router)


def test_missing_messages_and_prompt(router: RouterServer) -> None:
    assert_client_error(post(router, b'{"model": "sim"}'))
    assert_client_error(post(router, b'{"model": "sim"}', path="/v1/completions"))
    still_serves(router)


@pytest.mark.parametrize("max_tokens", [10**12, 2**63, 2**70, -(2**63)])
def test_absurd_max_tokens(router: RouterServer, max_tokens: int) -> None:
    body = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": %d}' % max_tokens
    assert_client_error(post(router, body))
    backend = next(iter(router.state.pool))
    assert (backend.in_flight, backend.in_flight_work_tokens) == (0, 0), "an absurd estimate must not stick"
    still_serves(router)


def test_ten_thousand_messages(router: RouterServer) -> None:
    messages = [{"role": "user" if n % 2 else "assistant", "content": f"message number {n}"} for n in range(10_000)]
    response = post(
        router, httpx.Request("POST", "/", json={"model": "sim", "messages": messages, "max_tokens": 2}).content
    )
    # Longer than the sim's context: the engine says so; shorter ones are served. Never a 5xx.
    if response.status_code != 200:
        assert_client_error(response)
    still_serves(router)


# --- size limits -----------------------------------------------------------------------------
def test_oversized_body_is_413_declared_or_streamed(router: RouterServer) -> None:
    huge = b'{"model": "sim", "messages": [{"role": "user", "content": "' + b"x" * (300 * 1024) + b'"}]}'
    assert_openai_error(post(router, huge), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for start in range(0, len(huge), 16 * 1024):
            yield huge[start : start + 16 * 1024]

    response = httpx.post(router.url + CHAT, content=chunks(), headers={"Content-Type": "application/json"}, timeout=60)
    assert_openai_error(response, 413, "request_too_large")
    still_serves(router)


def _raw_exchange(router: RouterServer, data: bytes, wait_s: float = 30.0) -> bytes:
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as connection:
        connection.sendall(data)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    return received


# In every unparsable request below: aiohttp's own answer would quote it (a credential, say).
OFFENDING = b"sk-offending-bytes"


def _raw_json_error(raw: bytes, status: int) -> None:
    """``raw`` is the router's JSON error with ``status``, quoting none of the offending request."""
    assert OFFENDING not in raw, raw[:300]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == str(status).encode(), head
    assert b"application/json" in head.lower()
    response = httpx.Response(status, content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(response, status)


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + OFFENDING + b"a" * 20_000 + b"\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + OFFENDING
        + b"s" * 20_000
        + b"\r\n\r\n",
        b"GET /" + OFFENDING + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: %s\r\n" % (n, OFFENDING) for n in range(1_000))
        + b"\r\n",
    ],
    ids=["one-big-header", "big-authorization", "long-url", "many-headers"],
)
def test_oversized_heads_are_431_json(router: RouterServer, head: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _raw_json_error(_raw_exchange(router, head), 431)
    assert OFFENDING.decode() not in caplog.text
    still_serves(router)


def test_garbage_on_the_wire_is_400_json(router: RouterServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    _raw_json_error(_raw_exchange(router, b"\x16\x03\x01\x02\x00 " + OFFENDING + b" not HTTP\r\n\r\n"), 400)
    _raw_json_error(
        _raw_exchange(
            router, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header: " + OFFENDING + b"\r\n\r\n"
        ),
        400,
    )
    assert OFFENDING.decode() not in caplog.text
    still_serves(router)


# --- paths and methods -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nope", 404),
        ("POST", "/v2/chat/completions", 404),
        ("POST", "/admin/backends", 404),  # no admin token configured: it does not exist
        ("GET", CHAT, 405),
        ("PUT", CHAT, 405),
        ("DELETE", "/v1/models", 405),
        ("PATCH", "/health", 405),
        ("POST", "/metrics", 405),
    ],
)
def test_unknown_paths_and_methods(router: RouterServer, method: str, path: str, status: int) -> None:
    response = httpx.request(method, router.url + path, timeout=30)
    assert_openai_error(response, status)
    still_serves(router)


# --- slow clients ----------------------------------------------------------------------------
def test_slowloris_body_is_408_and_the_router_keeps_serving(router: RouterServer) -> None:
    host, port = router.url.removeprefix("http://").split(":")
    body = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}]}'
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        started = time.monotonic()
        received = b""
        for byte in body:  # one byte at a time, slower than the read timeout allows
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break
            still_serves(router)  # meanwhile everyone else is served
            slow.settimeout(0.2)
            try:
                received += slow.recv(65536)
            except TimeoutError:
                continue
            if received:
                break
        slow.settimeout(30)
        while b"\r\n\r\n" not in received and (chunk := slow.recv(65536)):
            received += chunk
    assert time.monotonic() - started < READ_TIMEOUT_S + FAST_S
    head, _, _ = received.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"408", received[:300]
    assert b"connection: close" in head.lower()
    still_serves(router)


def test_a_client_hanging_up_stops_the_wait_on_the_engine(sim_engines: Any, router_server: Any) -> None:
    """The handler of a client that left is cancelled at once, not after the first-byte timeout."""
    (sim,) = sim_engines(1)
    router = router_server([sim], first_byte_timeout_s=300.0)
    sim.set_fault("hang_before_first_byte", 1)
    body = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}]}'
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as leaving:
        leaving.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(lambda: sim.engine.hanging == 1)
    wait_until(lambda: sim.engine.hanging == 0, timeout=FAST_S)  # the router closed its upstream request
    assert router.state.pool.get(sim.url).in_flight == 0
    still_serves(router)


def test_slow_request_head_is_cut_off(router: RouterServer) -> None:
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        closed = False
        while time.monotonic() - started < READ_TIMEOUT_S + FAST_S:
            try:
                slow.sendall(b"X-Drip: 1\r\n")
            except OSError:
                closed = True
                break
            slow.settimeout(0.3)
            try:
                if slow.recv(65536) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
    assert closed, "a request head dripping in forever must not hold a connection"
    still_serves(router)


@pytest.mark.parametrize("depth", [1_000, 5_000])
def test_tool_call_arguments_nested_past_what_json_writes(router: RouterServer, depth: int) -> None:
    """Arguments are a JSON text the router parses and writes again to render the chat:
    nested deeper than the encoder goes, the request is the client's error (or the
    engine's answer), never a 5xx, and the router keeps serving."""
    arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    body = {"model": "sim", "messages": messages, "max_tokens": 2}
    response = post(router, httpx.Request("POST", "/", json=body).content)
    if response.status_code != 200:
        assert_client_error(response)
    still_serves(router)
