"""The proxy's HTTP/1.1 client against raw TCP peers that write exact bytes (framing edge cases)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvroute.router.forwarding.upstream import (
    HIGH_WATER_BYTES,
    UpstreamClient,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
)

Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A TCP server whose handler reads requests and writes raw response bytes."""

    def __init__(self, handler: Peer) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        request = head + await reader.readexactly(length)
        self.requests.append(request)
        return request

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Peer], Awaitable[tuple[RawServer, str]]]]:
    servers: list[RawServer] = []

    async def start(handler: Peer) -> tuple[RawServer, str]:
        server = RawServer(handler)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    upstream = UpstreamClient(connect_timeout=5.0)
    yield upstream
    upstream.close()


async def post(client: UpstreamClient, url: str, body: bytes = b'{"x": 1}', timeout: float = 10.0) -> tuple[int, bytes]:
    response = await client.send(
        b"POST", url, b"/v1/x?q=1", [(b"Content-Type", b"application/json")], body, first_byte_timeout=timeout
    )
    data = await response.read()
    response.release()
    return response.status, data


def length_response(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


def chunked(*parts: bytes, trailers: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
    for part in parts:
        out += f"{len(part):x}".encode() + b"\r\n" + part + b"\r\n"
    return out + b"0\r\n" + trailers + b"\r\n"


async def test_request_bytes_and_keep_alive_reuse(serve, client) -> None:
    async def handler(reader, writer) -> None:
        while True:
            await server.read_request(reader)
            writer.write(length_response(b'{"ok": true}'))
            await writer.drain()

    server, url = await serve(handler)
    for _ in range(3):
        assert await post(client, url, b'{"a": "b"}') == (200, b'{"ok": true}')
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/x?q=1 HTTP/1.1"
    assert f"Host: {url.removeprefix('http://')}".encode() in lines
    assert b"Content-Length: 10" in lines and b"Content-Type: application/json" in lines
    assert body == b'{"a": "b"}'


@pytest.mark.parametrize("piece", [1, 3, 7, 64, 100_000])
async def test_chunked_body_however_it_is_cut(serve, client, piece: int) -> None:
    parts = [b"data: one\n\n", b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]
    raw = chunked(*parts, trailers=b"X-Trailer: 1\r\n")

    async def handler(reader, writer) -> None:
        while True:
            await server.read_request(reader)
            for start in range(0, len(raw), piece):
                writer.write(raw[start : start + piece])
                await writer.drain()

    server, url = await serve(handler)
    for _ in range(2):  # the second request proves the framing ended exactly where it should
        status, body = await post(client, url)
        assert (status, body) == (200, b"".join(parts))
    assert server.connections == 1


async def test_streamed_chunks_arrive_as_sent(serve, client) -> None:
    release = asyncio.Event()

    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b"6\r\nfirst\n\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\nsecond\n\r\n0\r\n\r\n")
        await writer.drain()

    server, url = await serve(handler)
    response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=10)
    assert response.is_event_stream
    assert await response.read_available() == b"first\n"
    release.set()
    assert await response.read_available() == b"second\n"
    assert await response.read_available() == b""
    response.release()


async def test_close_delimited_body_and_interim_response(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil")
        await writer.drain()
        writer.write(b" the end")
        await writer.drain()

    server, url = await serve(handler)
    assert await post(client, url) == (200, b"until the end")
    assert await post(client, url) == (200, b"until the end")
    assert server.connections == 2  # not reusable after a close-delimited body


async def test_stale_keep_alive_connection_is_resent_on_a_fresh_one(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(length_response(b"once"))
        await writer.drain()
        # ...then close without saying so: the client's pooled connection is stale.

    server, url = await serve(handler)
    assert await post(client, url) == (200, b"once")
    await asyncio.sleep(0.05)
    assert await post(client, url) == (200, b"once")
    assert server.connections == 2


async def test_connection_refused(serve, client) -> None:
    server, url = await serve(lambda reader, writer: asyncio.sleep(0))
    await server.close()
    with pytest.raises(UpstreamConnectError):
        await post(client, url)


async def test_closed_before_answering_on_a_fresh_connection(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)

    server, url = await serve(handler)
    with pytest.raises(UpstreamDisconnected):
        await post(client, url)


async def test_first_byte_timeout(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        await asyncio.sleep(30)

    server, url = await serve(handler)
    with pytest.raises(UpstreamTimeout):
        await post(client, url, timeout=0.2)


async def test_idle_timeout_after_the_first_chunk(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    server, url = await serve(handler)
    response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=30)
    assert await response.read_available() == b"abc"
    response.set_timeout(0.2)
    with pytest.raises(UpstreamTimeout):
        await response.read_available()
    response.close()


async def test_connection_lost_mid_body(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()

    server, url = await serve(handler)
    response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=10)
    with pytest.raises(UpstreamProtocolError):
        await response.read()
    response.close()


async def test_malformed_response_head(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"NONSENSE\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    server, url = await serve(handler)
    with pytest.raises(UpstreamProtocolError):
        await post(client, url)


async def test_large_body_with_a_slow_reader(serve, client) -> None:
    payload = bytes(range(256)) * (4 * HIGH_WATER_BYTES // 256)

    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(length_response(payload))
        await writer.drain()

    server, url = await serve(handler)
    response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=10)
    received = bytearray()
    while True:
        await asyncio.sleep(0.01)  # slower than the peer: reading pauses and resumes
        data = await response.read_available()
        if not data:
            break
        received += data
    response.release()
    assert bytes(received) == payload


async def test_abandoning_a_response_closes_its_connection(serve, client) -> None:
    closed = asyncio.Event()

    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await reader.read()  # returns at EOF: the client closed
        closed.set()

    server, url = await serve(handler)
    response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=10)
    assert await response.read_available() == b"a"
    response.close()
    await asyncio.wait_for(closed.wait(), 10)


# --- strict framing (issue 13): a malformed answer fails, and its connection is never reused ---

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
MALFORMED = {
    "negative chunk size": CHUNKED_HEAD + b"-3\r\nabc\r\n0\r\n\r\n",
    "chunk size not hex": CHUNKED_HEAD + b"3x\r\nabc\r\n0\r\n\r\n",
    "chunk size overflow": CHUNKED_HEAD + b"1" + b"0" * 20 + b"\r\nabc\r\n",
    "no CRLF after chunk data": CHUNKED_HEAD + b"3\r\nabcXY0\r\n\r\n",
    "conflicting Content-Length": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "Content-Length list": b"HTTP/1.1 200 OK\r\nContent-Length: 3, 4\r\n\r\nabcd",
    "signed Content-Length": b"HTTP/1.1 200 OK\r\nContent-Length: +3\r\n\r\nabc",
    "Content-Length with chunked": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    ),
    "Transfer-Encoding gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc",
    "chunked not the final coding": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "chunked twice": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    ),
    "unrequested protocol switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nabc",
    "bare LF line ends": b"HTTP/1.1 200 OK\nContent-Length: 3\n\nabc",
    "HTTP/2 status line": b"HTTP/2.0 200 OK\r\nContent-Length: 3\r\n\r\nabc",
    "control character in the reason phrase": b"HTTP/1.1 200 O\x00K\r\nContent-Length: 3\r\n\r\nabc",
    "status below 100": b"HTTP/1.1 099 Odd\r\nContent-Length: 3\r\n\r\nabc",
    "blank line before the status line": b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw", list(MALFORMED.values()), ids=list(MALFORMED))
async def test_malformed_framing_fails_and_the_connection_is_not_reused(serve, client, raw: bytes) -> None:
    async def handler(reader, writer) -> None:
        first = server.connections == 1
        while True:
            await server.read_request(reader)
            # The first connection answers badly, then stays open: only the parser can end the exchange.
            writer.write(raw if first else length_response(b"good"))
            await writer.drain()

    server, url = await serve(handler)
    with pytest.raises(UpstreamProtocolError):
        await asyncio.wait_for(post(client, url), 10)
    assert await post(client, url) == (200, b"good")
    assert server.connections == 2


@pytest.mark.parametrize("gap", [0.0, 0.1])
async def test_bytes_after_a_complete_response_are_never_the_next_answer(serve, client, gap: float) -> None:
    """An engine's unsolicited 408 (right after the answer, or later on the idle connection)."""
    unsolicited = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"

    async def handler(reader, writer) -> None:
        first = server.connections == 1
        while True:
            await server.read_request(reader)
            writer.write(length_response(b"answer"))
            if first and gap:
                await writer.drain()
                await asyncio.sleep(gap)
            if first:
                writer.write(unsolicited)
            await writer.drain()

    server, url = await serve(handler)
    assert await post(client, url) == (200, b"answer")
    await asyncio.sleep(gap + 0.1)
    assert await post(client, url) == (200, b"answer")
    assert server.connections == 2


async def test_interim_responses_are_skipped_and_the_connection_reused(serve, client) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"

    async def handler(reader, writer) -> None:
        while True:
            await server.read_request(reader)
            writer.write(interim + chunked(b"data: x\n\n"))
            await writer.drain()

    server, url = await serve(handler)
    for _ in range(2):
        response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=10)
        assert response.status == 200 and response.header(b"link") is None
        assert await response.read() == b"data: x\n\n"
        response.release()
    assert server.connections == 1


async def test_oversized_response_head(serve, client) -> None:
    async def handler(reader, writer) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"f" * 100 + b"\r\n" * 1)
        for _ in range(1000):
            writer.write(b"X-Filler: " + b"f" * 100 + b"\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    server, url = await serve(handler)
    with pytest.raises(UpstreamProtocolError):
        await asyncio.wait_for(post(client, url), 10)


async def test_trailers_are_not_headers_and_http10_is_not_reused(serve, client) -> None:
    async def handler(reader, writer) -> None:
        while True:
            await server.read_request(reader)
            if len(server.requests) == 1:
                writer.write(chunked(b"data: x\n\n", trailers=b"X-Trailer: late\r\n"))
            else:
                writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok")
            await writer.drain()

    server, url = await serve(handler)
    response = await client.send(b"POST", url, b"/", [], b"{}", first_byte_timeout=10)
    assert await response.read() == b"data: x\n\n"
    assert response.header(b"x-trailer") is None
    response.release()
    assert await post(client, url) == (200, b"ok")
    assert await post(client, url) == (200, b"ok")
    assert server.connections == 2  # the chunked answer's connection was kept, the HTTP/1.0 one's not
