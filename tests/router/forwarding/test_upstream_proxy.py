"""An engine that breaks HTTP framing, seen through the real router by the ``openai`` client.

The engine is a raw TCP server (health checks and the model list answered properly, the
completion with exact malformed bytes): before the first byte reached the client the router
answers a 502 in OpenAI error form; after it, the stream ends with an SSE error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.helpers import GREETING, assert_openai_error
from tests.servers import ServerLoop

EVENT = orjson.dumps(
    {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "sim",
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
    }
)
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}".encode() + b"\r\n" + data + b"\r\n"


def plain(status: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
    return head + str(len(body)).encode() + b"\r\n\r\n" + body


class BrokenEngine:
    """Answers ``/health`` and ``/v1/models`` well and every POST with ``answer`` (raw bytes)."""

    def __init__(self, answer: list[bytes]) -> None:
        self.answer = answer  # written piece by piece, with a pause between pieces
        self.posts = 0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:  # the router's pooled connections: their handlers end
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), 0
                )
                await reader.readexactly(length)
                if head.startswith(b"POST "):
                    self.posts += 1
                    for piece in self.answer:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.05)
                    await reader.read()  # the exchange is the router's to end: it must close
                    return
                if head.startswith(b"GET /v1/models "):
                    writer.write(plain(b"200 OK", b'{"object": "list", "data": [{"id": "sim", "object": "model"}]}'))
                elif head.startswith(b"GET /health "):
                    writer.write(plain(b"200 OK", b"{}"))
                else:
                    writer.write(plain(b"404 Not Found", b"{}"))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


@pytest.fixture
def broken_engine(server_loop: ServerLoop) -> Iterator[Any]:
    started: list[BrokenEngine] = []

    def start(*answer: bytes) -> BrokenEngine:
        engine = BrokenEngine(list(answer))
        server_loop.run(engine.start())
        started.append(engine)
        return engine

    yield start
    for engine in started:
        server_loop.run(engine.stop())


@pytest.mark.parametrize(
    "answer",
    [
        SSE_HEAD + b"-3\r\nabc\r\n",  # negative chunk size
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    ],
    ids=["negative chunk size", "conflicting Content-Length", "gzip coding"],
)
def test_malformed_answer_before_any_byte_is_an_openai_502(
    broken_engine: Any, router_server: Any, answer: bytes
) -> None:
    engine = broken_engine(answer)
    router = router_server([engine.url])
    response = httpx.post(router.v1 + "/chat/completions", json={"model": "sim", "messages": GREETING}, timeout=30)
    assert_openai_error(response, 502, "bad_gateway")
    with pytest.raises(openai.InternalServerError) as raised:
        router.client().chat.completions.create(model="sim", messages=GREETING, stream=True)
    assert raised.value.status_code == 502
    assert engine.posts == 2


def test_malformed_chunk_mid_stream_ends_it_with_an_error_event(broken_engine: Any, router_server: Any) -> None:
    # One good event, then chunk data without its CRLF.
    engine = broken_engine(SSE_HEAD + chunk(b"data: " + EVENT + b"\n\n"), b"5\r\nabcdeXY0\r\n\r\n")
    router = router_server([engine.url])
    with httpx.stream(
        "POST",
        router.v1 + "/chat/completions",
        json={"model": "sim", "messages": GREETING, "stream": True},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        body = response.read()
    assert body.startswith(b"data: " + EVENT + b"\n\n")
    assert b"event: error" in body and b"malformed response" in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert b"abcde" not in body  # nothing of the malformed chunk reached the client

    stream = router.client().chat.completions.create(model="sim", messages=GREETING, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.content == "hi"
    with pytest.raises(openai.APIError, match="malformed response"):
        for _ in stream:
            pass
