"""aiohttp's side of the proxy's I/O seam (:mod:`kvroute.router.forwarding.exchange`): an
aiohttp ``web.Request`` as a :class:`ClientRequest`, and a :class:`ResponseSink` that builds
the ``web.Response`` / ``web.StreamResponse`` the aiohttp handler returns.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvroute.router.forwarding.exchange import (
    ClientRequest,
    ResponseHeaders,
    body_timeout,
    body_too_large,
)


def client_request(request: web.Request, *, max_body_bytes: int, read_timeout_s: float) -> ClientRequest:
    """``request`` as the proxy reads it; its body read within the limits (413, 408)."""
    length = request.content_length
    content = request.content
    body: bytes | None = None
    if (length is None or length <= max_body_bytes) and content.is_eof():
        # The whole body came with the head (nearly always): take it as is, no timer.
        body = content.read_nowait()
        if len(body) > max_body_bytes:
            body = None

    async def read() -> bytes:
        if length is not None and length > max_body_bytes:
            # Refused before reading it; the connection closes rather than swallow the rest.
            raise body_too_large(max_body_bytes, length)
        if content.is_eof():  # complete, so over the limit
            raise body_too_large(max_body_bytes)
        try:
            async with asyncio.timeout(read_timeout_s):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise body_too_large(max_body_bytes) from None
        except TimeoutError:
            raise body_timeout(read_timeout_s) from None

    return ClientRequest(
        method=request.method,
        raw_path=request.raw_path,
        headers=request.headers,
        raw_headers=request.raw_headers,
        remote=request.remote,
        body=body if body is not None else read,
    )


class AiohttpSink:
    """A :class:`~kvroute.router.forwarding.exchange.ResponseSink` for one aiohttp request:
    :attr:`response` is what the handler returns to aiohttp."""

    __slots__ = ("_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None

    def send(self, status: int, headers: ResponseHeaders, body: bytes, *, close: bool = False) -> None:
        response = web.Response(status=status, body=body)
        _add(response, headers)
        if close:
            response.force_close()
        self.response = response

    async def start(self, status: int, headers: ResponseHeaders) -> None:
        response = web.StreamResponse(status=status)
        _add(response, headers)
        self.response = response
        await response.prepare(self._request)

    async def write(self, chunk: bytes) -> None:
        assert self.response is not None, "start() comes first"
        await self.response.write(chunk)

    async def end(self) -> None:
        assert self.response is not None, "start() comes first"
        await self.response.write_eof()

    def finished(self) -> web.StreamResponse:
        """The response, once the proxy has answered."""
        if self.response is None:
            raise RuntimeError("the proxy returned without answering")
        return self.response


def _add(response: web.StreamResponse, headers: ResponseHeaders) -> None:
    # Straight into the response's own header map (a map passed to the constructor would be
    # copied); latin-1, as the engine's header bytes were relayed before this seam existed.
    add = response.headers.add
    for name, value in headers:
        add(name.decode("latin-1"), value.decode("latin-1"))
