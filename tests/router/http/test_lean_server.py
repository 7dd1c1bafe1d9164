"""The lean server (``--http-server lean``) answers as aiohttp does: the same raw bytes sent
over real sockets to a router served by it and to one served by aiohttp alone get the same
answers (status, the headers that matter, bodies, whether the connection stays open); and
what only the lean server does (pipelining in order, cancellation on hang-up, flow
control, handing a connection over to aiohttp) holds."""

from __future__ import annotations

import asyncio
import http.client
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from kvroute.router.http.lean_server import LeanServer
from tests.servers import RouterServer, wait_until

TOKEN = "lean-admin-token"
READ_TIMEOUT_S = 2.5
MAX_HEADER_BYTES = 2048
MAX_BODY_BYTES = 4096
CHAT = orjson.dumps({"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "Name a river."}]})
STREAM = orjson.dumps(
    {"model": "sim", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Name a lake."}]}
)


def post(path: str, body: bytes, *, version: str = "1.1", extra: str = "", length: int | None = None) -> bytes:
    """A POST's bytes, with ``Content-Length`` (``length`` overrides it) and ``extra`` header lines."""
    size = len(body) if length is None else length
    head = f"POST {path} HTTP/{version}\r\nHost: router\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {size}\r\n{extra}\r\n").encode() + body


def get(path: str, *, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: router\r\n{extra}\r\n".encode()


@dataclass(frozen=True)
class Answer:
    """What is compared of one response."""

    status: int
    headers: tuple[tuple[str, str | None], ...]
    body: Any


#: Response headers compared by value (the rest differ per request or per process: Date,
#: x-request-id, Content-Length of generated text).
COMPARED_HEADERS = ("content-type", "transfer-encoding", "connection", "allow", "server", "x-kvroute-policy")


class _OneFile:
    """Lets ``http.client.HTTPResponse`` read several responses from one socket in turn."""

    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("rb")

    def makefile(self, *args: Any, **kwargs: Any) -> Any:
        return _Unclosable(self.file)


class _Unclosable:
    """The shared file, which one response's end must not close for the next."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def close(self) -> None:
        pass


def _normalise(response: http.client.HTTPResponse, body: bytes) -> Answer:
    headers = tuple((name, response.getheader(name)) for name in COMPARED_HEADERS)
    names = tuple(sorted(name.lower() for name, _ in response.getheaders() if name.lower().startswith("x-kvroute-")))
    headers += (("x-kvroute-*", ",".join(names)), ("date?", str(response.getheader("date") is not None)))
    content_type = response.getheader("content-type") or ""
    payload: Any = body
    if content_type.startswith("application/json"):
        payload = orjson.loads(body)
        if response.status == 200 and isinstance(payload, dict) and "choices" in payload:
            payload = sorted(payload)  # generated text and ids differ per request: compare the shape
    elif content_type.startswith("text/plain; version=0.0.4"):
        payload = ("prometheus exposition", b"kvroute_" in body)  # counters differ per router
    elif content_type.startswith("text/event-stream"):
        events = [line for line in body.split(b"\n\n") if line]
        payload = ("events", len(events) > 1, events[-1])  # the stream's shape and its end
    return Answer(response.status, headers, payload)


def exchange(
    url: str, data: bytes, responses: int = 1, *, pause_s: float = 0.0, rest: bytes = b""
) -> tuple[list[Answer], bool]:
    """Send ``data`` (then ``rest`` after ``pause_s``), read ``responses`` answers; and
    whether the connection was closed by the server afterwards."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(data)
        if rest:
            time.sleep(pause_s)
            sock.sendall(rest)
        reader = _OneFile(sock)
        answers = []
        for _ in range(responses):
            response = http.client.HTTPResponse(reader, method="POST")  # type: ignore[arg-type]
            response.begin()
            answers.append(_normalise(response, response.read()))
        sock.settimeout(0.3)
        try:
            closed = reader.file.read1(1) == b""
        except TimeoutError:
            closed = False
    return answers, closed


#: (name, request bytes, responses expected): each sent on its own connection.
CASES: list[tuple[str, bytes, int]] = [
    ("proxied", post("/v1/chat/completions", CHAT), 1),
    ("streamed", post("/v1/chat/completions", STREAM), 1),
    ("query string", post("/v1/chat/completions?trace=1", CHAT), 1),
    ("query with odd bytes", post("/v1/chat/completions?q=|{x}^`", CHAT), 1),
    ("query with UTF-8", b"POST /v1/chat/completions?q=\xc3\xa9 HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}", 1),
    ("header with UTF-8", post("/v1/chat/completions", CHAT, extra="X-Name: caf\u00e9\r\n"), 1),
    ("header with a tab", post("/v1/chat/completions", CHAT, extra="X-Name: a\tb\t \r\n"), 1),
    ("obsolete line folding", post("/v1/chat/completions", CHAT, extra="X-Name: a\r\n b\r\n"), 1),
    ("space before colon", post("/v1/chat/completions", CHAT, extra="X-Name : a\r\n"), 1),
    ("leading blank line", b"\r\n" + post("/v1/chat/completions", CHAT), 1),
    ("absolute form", post("http://router/v1/chat/completions", CHAT), 1),
    (
        "content-length with sign",
        post("/v1/chat/completions", CHAT, length=None).replace(b"Content-Length: ", b"Content-Length: +"),
        1,
    ),
    ("completions", post("/v1/completions", b'{"model": "sim", "prompt": "hi", "max_tokens": 2}'), 1),
    ("expect 100-continue", post("/v1/chat/completions", CHAT, extra="Expect: 100-continue\r\n"), 1),
    ("expect other", post("/v1/chat/completions", CHAT, extra="Expect: something-else\r\n"), 1),
    ("bad json", post("/v1/chat/completions", b"{not json"), 1),
    ("no body", post("/v1/chat/completions", b""), 1),
    ("unknown model", post("/v1/chat/completions", b'{"model": "nonexistent"}'), 1),
    ("trailing slash", post("/v1/chat/completions/", CHAT), 1),
    ("%2F", post("/v1/chat%2Fcompletions", CHAT), 1),
    ("percent-encoded letter", post("/v1/%63hat/completions", CHAT), 1),
    ("dot segment", post("/v1/./chat/completions", CHAT), 1),
    ("fragment", post("/v1/chat/completions#part", CHAT), 1),
    ("wrong case", post("/V1/chat/completions", CHAT), 1),
    ("wrong method", get("/v1/chat/completions"), 1),
    ("put", b"PUT /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}", 1),
    ("unknown path", get("/nowhere"), 1),
    ("health", get("/health"), 1),
    (
        "pipelined",
        post("/v1/chat/completions", CHAT) + get("/health") + post("/v1/chat/completions", b"{not json"),
        3,
    ),
    (
        "pipelined lean",
        post("/v1/chat/completions", CHAT) + post("/v1/chat/completions", STREAM) + post("/v1/completions", b"{}"),
        3,
    ),
    ("http/1.0", post("/v1/chat/completions", CHAT, version="1.0"), 1),
    ("http/1.0 keep-alive", post("/v1/chat/completions", CHAT, version="1.0", extra="Connection: keep-alive\r\n"), 1),
    ("http/1.0 stream", post("/v1/chat/completions", STREAM, version="1.0"), 1),
    ("connection close", post("/v1/chat/completions", CHAT, extra="Connection: close\r\n"), 1),
    ("connection close stream", post("/v1/chat/completions", STREAM, extra="Connection: close\r\n"), 1),
    ("oversized head", post("/v1/chat/completions", CHAT, extra=f"X-Big: {'a' * MAX_HEADER_BYTES}\r\n"), 1),
    ("oversized body", post("/v1/chat/completions", b"x" * (MAX_BODY_BYTES + 1)), 1),
    ("oversized body, short", post("/v1/chat/completions", b"{}", length=MAX_BODY_BYTES + 1), 1),
    ("duplicate content-length", post("/v1/chat/completions", CHAT, extra=f"Content-Length: {len(CHAT)}\r\n"), 1),
    ("no host", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 1),
    (
        "chunked body",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n0\r\n\r\n" % (len(CHAT), CHAT),
        1,
    ),
    ("garbage", b"\x16\x03\x01 not http\r\n\r\n", 1),
    ("bare LF", b"POST /v1/chat/completions HTTP/1.1\nHost: r\nContent-Length: 2\n\n{}", 1),
    ("http/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 1),
    ("stored response", get("/v1/responses/resp_1?stream=true&starting_after=2"), 1),
    ("stored response delete", b"DELETE /v1/responses/resp_1 HTTP/1.1\r\nHost: r\r\n\r\n", 1),
    ("stored response cancel", post("/v1/responses/resp-1/cancel", b""), 1),
    ("stored response items", get("/v1/responses/resp_1/input_items"), 1),
    ("stored response, escaped id", get("/v1/responses/resp%5F1"), 1),
    ("stored response, dot segment", get("/v1/responses/./resp_1"), 1),
    ("stored response, trailing slash", get("/v1/responses/resp_1/"), 1),
    ("stored response, no id", get("/v1/responses/"), 1),
    ("stored response, wrong method", b"PUT /v1/responses/resp_1 HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n", 1),
    ("stored response, get cancel", get("/v1/responses/resp_1/cancel"), 1),
    ("stored response then chat", get("/v1/responses/resp_1") + post("/v1/chat/completions", CHAT), 2),
    ("metrics after lean", post("/v1/chat/completions", CHAT) + get("/metrics"), 2),
    ("openapi after lean", post("/v1/chat/completions", CHAT) + get("/openapi.json"), 2),
    (
        "admin after lean",
        post("/v1/chat/completions", CHAT) + get("/admin/backends", extra=f"Authorization: Bearer {TOKEN}\r\n"),
        2,
    ),
    ("admin unauthorised after lean", post("/v1/chat/completions", CHAT) + get("/admin/backends"), 2),
]


@pytest.fixture
def routers(
    sim_engines: Any, router_server: Callable[..., RouterServer]
) -> Iterator[tuple[RouterServer, RouterServer]]:
    (sim,) = sim_engines(1)
    options = {
        "admin_token": TOKEN,
        "max_header_bytes": MAX_HEADER_BYTES,
        "max_body_bytes": MAX_BODY_BYTES,
        "request_read_timeout_s": READ_TIMEOUT_S,
    }
    lean = router_server([sim], http_server="lean", **options)
    plain = router_server([sim], http_server="aiohttp", **options)
    assert isinstance(lean.runner.server, LeanServer)
    assert not isinstance(plain.runner.server, LeanServer)
    yield lean, plain


@pytest.mark.parametrize(("name", "data", "responses"), CASES, ids=[case[0] for case in CASES])
def test_lean_answers_as_aiohttp(
    routers: tuple[RouterServer, RouterServer], name: str, data: bytes, responses: int
) -> None:
    lean, plain = routers
    ours = exchange(lean.url, data, responses)
    theirs = exchange(plain.url, data, responses)
    assert ours == theirs


def test_bytes_after_the_body_are_the_next_request(routers: tuple[RouterServer, RouterServer]) -> None:
    """A body longer than its Content-Length: the rest is the next request (here a 400). Sent
    in one piece, aiohttp drops the first request and answers only its 400 (its parser
    raises for the batch); the lean server answers both, in order. Sent in two pieces, both
    answer both."""
    lean, plain = routers
    data = post("/v1/chat/completions", CHAT) + b"garbage"
    answers, closed = exchange(lean.url, data, 2)
    assert [answer.status for answer in answers] == [200, 400] and closed
    first, rest = post("/v1/chat/completions", CHAT), b"garbage"
    assert exchange(lean.url, first, 2, pause_s=0.3, rest=rest) == exchange(plain.url, first, 2, pause_s=0.3, rest=rest)


def test_slow_body_is_a_408_and_closes(routers: tuple[RouterServer, RouterServer]) -> None:
    lean, plain = routers
    request = post("/v1/chat/completions", CHAT)
    half = len(request) - len(CHAT) // 2
    ours = exchange(lean.url, request[:half], pause_s=READ_TIMEOUT_S + 0.5, rest=request[half:])
    theirs = exchange(plain.url, request[:half], pause_s=READ_TIMEOUT_S + 0.5, rest=request[half:])
    assert ours == theirs
    assert ours[0][0].status == 408 and ours[1]


def test_body_in_pieces_within_the_timeout_is_proxied(routers: tuple[RouterServer, RouterServer]) -> None:
    lean, plain = routers
    request = post("/v1/chat/completions", CHAT)
    half = len(request) - len(CHAT) // 2
    ours = exchange(lean.url, request[:half], pause_s=0.2, rest=request[half:])
    assert ours == exchange(plain.url, request[:half], pause_s=0.2, rest=request[half:])
    assert ours[0][0].status == 200


def _closed_within(url: str, data: bytes, seconds: float) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(data)
        try:
            return sock.recv(1) == b""
        except TimeoutError:
            return False


@pytest.mark.parametrize("data", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"], ids=["idle", "slow head"])
def test_idle_and_slow_heads_are_closed_after_the_read_timeout(
    routers: tuple[RouterServer, RouterServer], data: bytes
) -> None:
    for router in routers:
        assert _closed_within(router.url, data, READ_TIMEOUT_S + 2.0)


def test_keep_alive_connection_stays_lean_until_a_request_is_not(routers: tuple[RouterServer, RouterServer]) -> None:
    lean, _ = routers
    server = lean.runner.server
    assert isinstance(server, LeanServer)
    host, port = lean.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        reader = _OneFile(sock)
        for _ in range(3):
            sock.sendall(post("/v1/chat/completions", CHAT))
            response = http.client.HTTPResponse(reader, method="POST")  # type: ignore[arg-type]
            response.begin()
            response.read()
            assert response.status == 200
        assert lean.loop.call(lambda: server.lean_connections) == 1
        sock.sendall(get("/v1/responses/resp_1"))  # a stored response's call is a lean one too
        response = http.client.HTTPResponse(reader, method="GET")  # type: ignore[arg-type]
        response.begin()
        response.read()
        assert response.status == 404 and response.getheader("x-kvroute-reason") == "search"
        assert lean.loop.call(lambda: server.lean_connections) == 1
        sock.sendall(get("/health"))
        response = http.client.HTTPResponse(reader, method="GET")  # type: ignore[arg-type]
        response.begin()
        response.read()
        assert response.status == 200
        assert lean.loop.call(lambda: server.lean_connections) == 0  # aiohttp's now
        sock.sendall(post("/v1/chat/completions", CHAT))  # and aiohttp serves the proxied POSTs on it
        response = http.client.HTTPResponse(reader, method="POST")  # type: ignore[arg-type]
        response.begin()
        response.read()
        assert response.status == 200


@pytest.mark.parametrize("http_server", ["lean", "aiohttp"])
def test_client_hanging_up_mid_stream_cancels_the_request(
    http_server: str, sim_engines: Any, router_server: Any
) -> None:
    (sim,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=20.0)
    router = router_server([sim], http_server=http_server)
    backend = router.state.pool.get(sim.url)
    assert backend is not None
    body = orjson.dumps(
        {"model": "sim", "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "Go on."}]}
    )
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10.0) as sock:
        sock.sendall(post("/v1/chat/completions", body))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert router.loop.call(lambda: backend.in_flight) == 1
    wait_until(lambda: router.loop.call(lambda: (backend.in_flight, backend.in_flight_work_tokens)) == (0, 0))


def test_a_slow_client_pauses_the_relay(sim_engines: Any, router_server: Any) -> None:
    """A client that does not read a long stream: the router's write buffer stays near the
    transport's high-water mark instead of growing with the stream."""
    (sim,) = sim_engines(1, decode_tokens_per_s=1_000_000.0)
    router = router_server([sim])
    server = router.runner.server
    assert isinstance(server, LeanServer)
    body = orjson.dumps(
        {"model": "sim", "max_tokens": 60_000, "stream": True, "messages": [{"role": "user", "content": "Talk."}]}
    )
    host, port = router.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        sock.sendall(post("/v1/chat/completions", body))

        def buffered() -> tuple[bool, int]:
            (connection,) = list(server._lean)
            transport = connection._transport
            assert transport is not None
            return connection.write_paused, transport.get_write_buffer_size()

        wait_until(lambda: router.loop.call(buffered)[0])
        time.sleep(1.0)
        paused, size = router.loop.call(buffered)
        assert paused
        assert size < 1024 * 1024, size  # the high-water mark plus a chunk, not the stream
    finally:
        sock.close()
    backend = router.state.pool.get(sim.url)
    assert backend is not None
    wait_until(lambda: router.loop.call(lambda: backend.in_flight) == 0)


@pytest.mark.parametrize("http_server", ["lean", "aiohttp"])
def test_an_unexpected_error_is_a_json_500_and_the_connection_goes_on(
    http_server: str, sim_engines: Any, router_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim], http_server=http_server)
    proxy = router.state.proxy
    assert proxy is not None

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy, "forward", broken)
    answers, closed = exchange(router.url, post("/v1/chat/completions", CHAT) + get("/health"), 2)
    assert answers[0].status == 500
    assert answers[0].body == {
        "type": "error",
        "error": {"message": "internal router error", "type": "server_error", "code": "internal_error"},
    }
    assert answers[1].status == 200 and not closed


def test_drain_finishes_a_lean_stream_and_closes_idle_connections(sim_engines: Any, router_server: Any) -> None:
    """The runner's cleanup (what SIGTERM runs): an idle keep-alive connection closes at once,
    a stream in flight runs to its end, then its connection closes."""
    (sim,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=40.0)
    router = router_server([sim], drain_timeout_s=20.0)
    host, port = router.url.removeprefix("http://").split(":")
    idle = socket.create_connection((host, int(port)), timeout=10.0)
    streaming = socket.create_connection((host, int(port)), timeout=10.0)
    try:
        idle.sendall(post("/v1/completions", b'{"model": "sim", "prompt": "hi", "max_tokens": 1}'))
        response = http.client.HTTPResponse(_OneFile(idle), method="POST")  # type: ignore[arg-type]
        response.begin()
        response.read()
        assert response.status == 200
        body = orjson.dumps(
            {"model": "sim", "max_tokens": 40, "stream": True, "messages": [{"role": "user", "content": "Count."}]}
        )
        streaming.sendall(post("/v1/chat/completions", body))
        reader = _OneFile(streaming)
        stream = http.client.HTTPResponse(reader, method="POST")  # type: ignore[arg-type]
        stream.begin()
        assert stream.status == 200
        first = stream.read1(65536)  # type: ignore[attr-defined]
        assert first
        stopping = asyncio.run_coroutine_threadsafe(router.runner.cleanup(), router.loop.loop)
        router.stopped = True
        assert idle.recv(1) == b""  # closed at once, not after the stream
        assert not stopping.done()
        rest = stream.read()
        assert (first + rest).rstrip().endswith(b"data: [DONE]")
        assert reader.file.read1(1) == b""  # then its connection closes
        stopping.result(timeout=20.0)
    finally:
        idle.close()
        streaming.close()
