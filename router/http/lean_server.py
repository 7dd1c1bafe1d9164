"""A lean HTTP/1.1 server for the proxied POST endpoints: llhttp on an ``asyncio.Protocol``.

Why: aiohttp's server, as the router runs it, costs 72-86 us of CPU per request above an
``asyncio.Protocol`` on uvloop with llhttp (``python3 -m kvroute.benchmarks.server_floor``),
about what separates the router's ``round_robin`` from sglang-router's. This server does
only what a proxied POST needs; everything else stays with aiohttp, byte for byte:

* A connection starts here (:class:`LeanServer` is the sites' protocol factory). Each
  request head is found (the first blank line), parsed by llhttp (``httptools``, strict, as
  the upstream client's) and served here only if it is exactly what aiohttp's direct route
  would serve (``kvroute.router.http.app._dispatch_with_direct_routes``): ``POST``, HTTP/1.0
  or 1.1, a route's path as sent (no percent-encoding, no dot segments: those go to aiohttp,
  whose matching decides), a ``Content-Length`` body or none, and none of what aiohttp
  treats specially. Calls on a stored Responses answer (:class:`StoredCalls`: its ``GET``,
  ``DELETE``, ``/cancel``...) are taken too where their id is a plain segment, so a client
  polling one does not move its connection to aiohttp; the rest as for the POSTs, none of what aiohttp
  treats specially (``Expect``, ``Transfer-Encoding``, ``Upgrade``, ``Content-Encoding``,
  a missing ``Host`` on 1.1, duplicate singleton fields, over 128 fields, a head over
  ``max_header_bytes``, anything llhttp rejects).
* Anything else hands the connection over to aiohttp for good: the aiohttp protocol
  (:class:`~kvroute.router.errors.JsonErrorServer`'s) is created, put on the transport, and
  fed every byte received from the start of that request. So admin, ``/metrics``, errors,
  100-continue, 400/431 answers keep aiohttp's exact behaviour.
* One request at a time per connection: pipelined requests wait in the buffer (reading
  pauses above :data:`PIPELINE_BUFFER_BYTES`) and are answered in order.
* The limits and timeouts are aiohttp's as the router configures them: the connection
  closes when no complete request head arrives within ``request_read_timeout_s`` of its
  start or of the last answer (slowloris, idle keep-alive); the body has that long once
  the proxy asks for it (408, from this server's body reader); a body over
  ``max_body_bytes`` is refused unread (413, close). A connection that closes after an
  answer first reads and drops the rest of an unread body for up to :data:`LINGER_S`
  (aiohttp's lingering close), so the client reads the answer rather than a reset.
* A client hanging up cancels its request's task (as aiohttp's ``handler_cancellation``):
  the proxy closes the upstream connection and returns its counters.
* Streams are written as chunks arrive, and a write waits while the transport is paused
  (its buffer above the high-water mark): a slow client slows the relay instead of the
  router buffering without bound.
* The drain on SIGTERM (the runner's cleanup): idle connections close at once, busy ones
  after their answer, in-flight requests get up to ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.web_protocol import RequestHandler

from kvroute.router.errors import JsonErrorServer, RouterError
from kvroute.router.forwarding.exchange import (
    ClientRequest,
    Headers,
    ResponseHeaders,
    ResponseSink,
    body_timeout,
    body_too_large,
    send_error,
)

log = logging.getLogger("kvroute.lean_server")

#: What the lean server calls for a request to a proxied endpoint.
LeanRoute = Callable[[ClientRequest, ResponseSink], Awaitable[None]]
#: What it calls for a call on a stored response, with the id from its path.
LeanStoredRoute = Callable[[ClientRequest, ResponseSink, str], Awaitable[None]]
#: A path segment aiohttp's router matches as it is sent (no escapes, no dot segments).
_PLAIN_SEGMENT = re.compile(rb"[A-Za-z0-9_\-]+")
#: Bytes of later (pipelined) requests buffered while one is served; reading pauses above.
PIPELINE_BUFFER_BYTES = 256 * 1024
#: How long a connection closing after an answer reads the rest of an unread body (aiohttp's
#: ``lingering_time``).
LINGER_S = 10.0
#: aiohttp's default limit on a request's header fields (``max_headers``): more are its 400.
MAX_HEADER_FIELDS = 128
#: Fields aiohttp handles in ways this server does not (100-continue, request decompression,
#: chunked bodies, protocol switches, the old WebSocket handshake it refuses).
_HAND_OVER_FIELDS = frozenset({b"expect", b"transfer-encoding", b"upgrade", b"content-encoding", b"sec-websocket-key1"})
#: Fields aiohttp's request parser accepts once only (a second is its 400).
_SINGLETON_FIELDS = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)
#: Response fields the server adds unless the answer has them (as aiohttp's ``setdefault``).
_DEFAULTED_FIELDS = frozenset({b"content-type", b"date", b"server"})
_SERVER = b"Server: " + SERVER_SOFTWARE.encode() + b"\r\n"
_OCTET_STREAM = b"Content-Type: application/octet-stream\r\n"
_CONNECTION_CLOSE = b"Connection: close\r\n"
_CONNECTION_KEEP_ALIVE = b"Connection: keep-alive\r\n"
_CHUNKED = b"Transfer-Encoding: chunked\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def _status_lines(version: bytes) -> dict[int, bytes]:
    # aiohttp's reason phrase: HTTPStatus's, or none for a code it does not know.
    phrases = {status.value: status.phrase for status in HTTPStatus}
    return {code: b"HTTP/%b %d %b\r\n" % (version, code, phrases.get(code, "").encode()) for code in range(100, 600)}


_STATUS_LINES = {False: _status_lines(b"1.1"), True: _status_lines(b"1.0")}  # keyed by "is HTTP/1.0"


def _internal_error() -> RouterError:
    # As error_middleware's answer to an unexpected exception.
    return RouterError(500, "internal router error", code="internal_error")


class _DateField:
    """The ``Date`` field, formatted once a second (as aiohttp caches it)."""

    __slots__ = ("_field", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._field = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._field = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._field


_DATE = _DateField()


@dataclass(frozen=True, slots=True)
class StoredCalls:
    """The calls on a stored response the lean server takes: each ``(method, suffix)`` of
    a ``PREFIX{id}SUFFIX`` route, and their handler."""

    prefix: bytes
    routes: frozenset[tuple[bytes, bytes]]
    handler: LeanStoredRoute

    @classmethod
    def of(
        cls, routes: Iterable[tuple[str, str]], handler: LeanStoredRoute, name: str = "{response_id}"
    ) -> StoredCalls:
        """From aiohttp's ``(method, path pattern)`` routes, each holding ``name`` once after
        one shared prefix."""
        prefixes: set[bytes] = set()
        taken: set[tuple[bytes, bytes]] = set()
        for method, pattern in routes:
            head, _, suffix = pattern.partition(name)
            prefixes.add(head.encode())
            taken.add((method.encode(), suffix.encode()))
        (prefix,) = prefixes
        return cls(prefix, frozenset(taken), handler)

    def route(self, method: bytes, path: bytes) -> LeanRoute | None:
        """The handler of ``method`` on ``path`` with the id bound, or None (aiohttp's)."""
        if not path.startswith(self.prefix):
            return None
        response_id, slash, rest = path[len(self.prefix) :].partition(b"/")
        if (method, slash + rest) not in self.routes or not _PLAIN_SEGMENT.fullmatch(response_id):
            return None
        handler, stored_id = self.handler, response_id.decode()

        def call(request: ClientRequest, sink: ResponseSink) -> Awaitable[None]:
            return handler(request, sink, stored_id)

        return call


@dataclass(frozen=True, slots=True)
class LeanLimits:
    """The router's request limits, as aiohttp's server applies them."""

    max_header_bytes: int
    max_body_bytes: int
    #: Request head (from connection start or the last answer) and body, in seconds.
    read_timeout_s: float


class _Head:
    """llhttp's callbacks for one request (one parser per connection carries its state)."""

    __slots__ = ("fields", "headers_complete", "url")

    def __init__(self) -> None:
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.headers_complete = False

    def reset(self) -> None:
        self.url = b""
        self.fields = []
        self.headers_complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value.rstrip(b" \t")))  # llhttp drops the leading whitespace only

    def on_headers_complete(self) -> None:
        self.headers_complete = True


class LeanResponse:
    """The answer to one lean request (a :class:`~kvroute.router.forwarding.exchange.ResponseSink`):
    framed as aiohttp frames it (``Content-Length``, or chunked on HTTP/1.1, or until close on
    HTTP/1.0), with aiohttp's ``Date``, ``Server``, ``Connection`` and default ``Content-Type``."""

    __slots__ = ("_chunked", "_connection", "_has_type", "_head", "_http10", "ended", "keep_alive", "started")

    def __init__(self, connection: LeanConnection, *, http10: bool, keep_alive: bool) -> None:
        self._connection = connection
        self._http10 = http10
        self.keep_alive = keep_alive
        self.started = False
        self.ended = False
        self._chunked = False
        self._head = b""  # a stream's head, written with its first chunk
        self._has_type = False

    def send(self, status: int, headers: ResponseHeaders, body: bytes, *, close: bool = False) -> None:
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = self.ended = True
        if close or self._connection.draining:
            self.keep_alive = False
        head = self._fields(status, headers)
        if status in (204, 304) or status < 200:
            body = b""  # no body, no Content-Length (aiohttp's must_be_empty_body)
        else:
            head += b"Content-Length: %d\r\n" % len(body)
            if body and not self._has_type:
                head += _OCTET_STREAM
        self._connection.write(head + self._connection_field() + b"\r\n" + body)

    async def start(self, status: int, headers: ResponseHeaders) -> None:
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = True
        if self._connection.draining:
            self.keep_alive = False
        head = self._fields(status, headers)
        if self._http10:
            self.keep_alive = False  # no chunked coding on 1.0: the body ends with the connection
        else:
            self._chunked = True
            head += _CHUNKED
        if not self._has_type:
            head += _OCTET_STREAM
        self._head = head + self._connection_field() + b"\r\n"

    async def write(self, chunk: bytes) -> None:
        if not chunk:
            return  # an empty chunk would end a chunked body
        connection = self._connection
        if connection.closing:
            raise ConnectionResetError("the client closed the connection")
        data = b"%x\r\n%b\r\n" % (len(chunk), chunk) if self._chunked else chunk
        if self._head:
            data = self._head + data
            self._head = b""
        connection.write(data)
        if connection.write_paused:
            await connection.drain()

    async def end(self) -> None:
        connection = self._connection
        if connection.closing:
            raise ConnectionResetError("the client closed the connection")
        data = self._head + (_LAST_CHUNK if self._chunked else b"")
        self._head = b""
        self.ended = True
        if data:
            connection.write(data)

    def _fields(self, status: int, headers: ResponseHeaders) -> bytes:
        lines = [_STATUS_LINES[self._http10].get(status) or b"HTTP/1.%d %d \r\n" % (0 if self._http10 else 1, status)]
        present: set[bytes] = set()
        for name, value in headers:
            lines.append(name + b": " + value + b"\r\n")
            lower = name.lower()
            if lower in _DEFAULTED_FIELDS:
                present.add(lower)
        if b"date" not in present:
            lines.append(_DATE.get())
        if b"server" not in present:
            lines.append(_SERVER)
        self._has_type = b"content-type" in present
        return b"".join(lines)

    def _connection_field(self) -> bytes:
        if self.keep_alive:
            return _CONNECTION_KEEP_ALIVE if self._http10 else b""
        return b"" if self._http10 else _CONNECTION_CLOSE


@dataclass(slots=True)
class _Current:
    """The request a connection is serving, from its head until its answer and body are done."""

    head_end: int
    #: Where the request ends in the connection's buffer (head and body).
    end: int
    response: LeanResponse
    #: The body is over max_body_bytes: refused unread, its bytes dropped as they come.
    too_large: bool
    #: Bytes of a too large body dropped so far.
    dropped: int = 0
    task: asyncio.Task[None] | None = None
    body: bytes | None = None
    body_waiter: asyncio.Future[bytes] | None = None


class LeanConnection(asyncio.Protocol):
    """One client connection, served here until a request that is not a lean one arrives."""

    def __init__(self, server: LeanServer) -> None:
        self._server = server
        self._loop = server.loop
        self._limits = server.limits
        self._routes = server.routes
        self._stored_calls = server.stored_calls
        self._transport: asyncio.Transport | None = None
        self._remote: str | None = None
        self._buffer: bytes | bytearray = b""
        self._head = _Head()
        self._parser = httptools.HttpRequestParser(self._head)
        self._current: _Current | None = None
        #: Bytes of an incomplete request head already given to llhttp.
        self._head_fed = 0
        #: Closing after an answer: body bytes still to be read and dropped (aiohttp's lingering close).
        self._linger_left = 0
        self._reading_paused = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self.closing = False
        self.draining = False
        self._idle_deadline = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # As aiohttp's connections: small answers and stream chunks leave at once.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        peer = transport.get_extra_info("peername")
        self._remote = peer[0] if isinstance(peer, (list, tuple)) and peer else None
        self._server.connection_started(self)
        self._arm_idle_timer()
        if self._server.draining:
            self.stop_serving()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._server.connection_ended(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        current = self._current
        if current is not None:
            if current.task is not None:
                current.task.cancel()  # the client hung up: the proxy aborts the upstream request
            if current.body_waiter is not None and not current.body_waiter.done():
                current.body_waiter.cancel()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self._linger_left:
            self._linger_left -= len(data)
            if self._linger_left <= 0:
                self.close()
            return
        buffer = self._buffer
        if not buffer:
            self._buffer = data
        elif isinstance(buffer, bytearray):
            buffer += data
        else:
            self._buffer = bytearray(buffer) + data
        current = self._current
        if current is None:
            self._serve_next()
            return
        if current.too_large:
            # The 413 closes the connection; nothing of the body is kept, only counted.
            current.dropped += len(self._buffer)
            self._buffer = b""
            return
        if current.body is None and len(self._buffer) >= current.end:
            self._body_arrived(current)
        if current.task is None and current.body is not None:
            self._advance()  # the answer went out before the body was in: the body is now done
        elif not self._reading_paused and len(self._buffer) - current.end > PIPELINE_BUFFER_BYTES:
            self._reading_paused = True
            self._transport.pause_reading()  # type: ignore[union-attr]

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None:
            self._drain_waiter = None
            if not waiter.done():
                waiter.set_result(None)
        if self._current is None and not self.closing:
            self._serve_next()  # requests wait while the previous answer has not drained

    # --- writing (for LeanResponse) ----------------------------------------------------
    def write(self, data: bytes) -> None:
        if not self.closing:
            self._transport.write(data)  # type: ignore[union-attr]

    async def drain(self) -> None:
        if self.closing:
            raise ConnectionResetError("the client closed the connection")
        if self.write_paused:
            if self._drain_waiter is None:
                self._drain_waiter = self._loop.create_future()
            await self._drain_waiter

    # --- the drain on SIGTERM ----------------------------------------------------------
    def stop_serving(self) -> None:
        """Close now if idle, else after the answer in progress (which says ``Connection: close``)."""
        self.draining = True
        if self._current is None:
            self.close()
        elif self._current.task is None:
            self.close()  # answered, waiting only for the rest of a body no one reads

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._current.task if self._current is not None else None

    def close(self) -> None:
        if self._transport is not None and not self.closing:
            self.closing = True
            self._transport.close()

    # --- requests ----------------------------------------------------------------------
    def _serve_next(self) -> None:
        """Serve the request at the start of the buffer here, or hand the connection to aiohttp."""
        if self.write_paused or self.draining:
            return  # resume_writing comes back here; a draining connection takes no more
        buffer = self._buffer
        if not buffer:
            return
        limits = self._limits
        parser = self._parser
        head_end = buffer.find(b"\r\n\r\n")
        fed = self._head_fed
        try:
            if head_end < 0:
                if len(buffer) > limits.max_header_bytes:
                    self._hand_over()  # aiohttp answers 431 (or serves it, if its lines are short)
                    return
                # An incomplete head goes to llhttp as it comes: one that is already wrong
                # is aiohttp's 400 now, as aiohttp answers it, not a close after the timeout.
                parser.feed_data(buffer[fed:])
                self._head_fed = len(buffer)
                return
            head_end += 4
            if head_end > limits.max_header_bytes:
                self._hand_over()
                return
            parser.feed_data(buffer[fed:head_end] if fed else buffer[:head_end])
        except httptools.HttpParserError:  # includes HttpParserUpgrade
            self._hand_over()  # aiohttp answers its 400
            return
        self._head_fed = 0
        head = self._head
        if not head.headers_complete:
            self._hand_over()
            return
        method = parser.get_method()
        http_version = parser.get_http_version()
        route = self._route(head, http_version, method)
        if route is None:
            self._hand_over()
            return
        handler, length, by_name = route
        keep_alive = parser.should_keep_alive()
        response = LeanResponse(self, http10=http_version == "1.0", keep_alive=keep_alive)
        too_large = length > limits.max_body_bytes
        current = _Current(head_end=head_end, end=head_end + length, response=response, too_large=too_large)
        self._current = current
        if too_large:
            current.dropped = len(buffer)
            self._buffer = b""
        elif len(buffer) >= current.end:
            self._body_arrived(current)
        request = ClientRequest(
            method="POST" if method == b"POST" else method.decode(),
            raw_path=head.url.decode("utf-8", "surrogateescape"),
            headers=Headers.from_lowered(by_name),
            raw_headers=head.fields,
            remote=self._remote,
            body=current.body if current.body is not None else self._body_reader(current, length, too_large),
        )
        current.task = self._loop.create_task(self._run(handler, request, current))

    def _route(self, head: _Head, http_version: str, method: bytes) -> tuple[LeanRoute, int, dict[bytes, bytes]] | None:
        """The handler, body length and fields by lower-case name (the first of each) of a
        request this server takes, or None for aiohttp's."""
        if http_version != "1.1" and http_version != "1.0":
            return None
        path, _, _ = head.url.partition(b"?")
        handler = self._routes.get(path) if method == b"POST" else None
        if handler is None:
            stored_calls = self._stored_calls
            handler = stored_calls.route(method, path) if stored_calls is not None else None
            if handler is None:
                return None
        fields = head.fields
        if len(fields) > MAX_HEADER_FIELDS:
            return None
        length = 0
        by_name: dict[bytes, bytes] = {}
        for name, value in fields:
            lower = name.lower()
            if lower in _HAND_OVER_FIELDS:
                return None
            if lower in by_name:
                if lower in _SINGLETON_FIELDS:
                    return None
                continue  # a repeated field: lookups see its first value
            by_name[lower] = value
            if lower == b"content-length":
                length = int(value)  # llhttp checked it: digits only
        if http_version == "1.1" and b"host" not in by_name:
            return None
        return handler, length, by_name

    def _body_reader(self, current: _Current, length: int, too_large: bool) -> Callable[[], Awaitable[bytes]]:
        timeout_s = self._limits.read_timeout_s
        limit = self._limits.max_body_bytes

        async def read() -> bytes:
            if too_large:
                # Refused before reading it; the connection closes rather than swallow the rest.
                raise body_too_large(limit, length)
            if current.body is not None:
                return current.body
            waiter = current.body_waiter = self._loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    return await waiter
            except TimeoutError:
                raise body_timeout(timeout_s) from None

        return read

    def _body_arrived(self, current: _Current) -> None:
        body = bytes(self._buffer[current.head_end : current.end])
        current.body = body
        if body:
            try:
                self._parser.feed_data(body)  # llhttp's state moves on to the next request
            except httptools.HttpParserError:  # pragma: no cover - a Content-Length body is opaque to llhttp
                current.response.keep_alive = False
        waiter = current.body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(body)

    async def _run(self, handler: LeanRoute, request: ClientRequest, current: _Current) -> None:
        response = current.response
        try:
            await handler(request, response)
        except asyncio.CancelledError:
            # The client hung up, or the drain's time ran out: the connection is done.
            current.task = None
            self.close()
            raise
        except Exception:
            # As error_middleware: logged with its traceback, answered as a JSON 500.
            log.exception("unhandled error in %s %s", request.method, request.raw_path.partition("?")[0])
            if not response.started:
                send_error(response, _internal_error())
            else:
                response.keep_alive = False  # a broken stream: the connection closes instead
        finally:
            current.task = None
            self._finished(current)

    def _finished(self, current: _Current) -> None:
        """The answer is done: close, or go on with the next request once the body is in."""
        if self.closing:
            return
        response = current.response
        if not response.started:
            # The handler returned without answering (never, by the proxy's contract).
            send_error(response, _internal_error())
        if not response.ended or self.draining:
            self.close()
            return
        if not response.keep_alive or current.too_large:
            if current.body is None:
                self._linger(current)
            else:
                self.close()
            return
        if current.body is not None:
            self._advance()
        else:
            # The answer went out before the whole body arrived (e.g. a 401): the rest is
            # read (data_received) before the next request, within the read timeout.
            self._arm_idle_timer()

    def _linger(self, current: _Current) -> None:
        """Close once the rest of the body is in, or after :data:`LINGER_S`: as aiohttp's
        lingering close, so that the client reads the answer rather than a reset (closing
        with unread bytes in the socket sends one)."""
        left = current.end - len(self._buffer) - current.dropped
        self._buffer = b""
        if left <= 0:
            self.close()
            return
        self._linger_left = left
        self._loop.call_later(LINGER_S, self.close)

    def _advance(self) -> None:
        """Drop the finished request from the buffer and serve the next one."""
        current = self._current
        assert current is not None
        self._current = None
        self._head.reset()
        self._buffer = self._buffer[current.end :]
        self._arm_idle_timer()
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()  # type: ignore[union-attr]
        self._serve_next()

    # --- the read timeout of request heads (aiohttp's keepalive_timeout) ------------------
    def _arm_idle_timer(self) -> None:
        # One timer per connection, moved forward by a deadline rather than re-armed per
        # request: when it fires early, it re-arms itself for the deadline.
        self._idle_deadline = self._loop.time() + self._limits.read_timeout_s
        if self._idle_timer is None:
            self._idle_timer = self._loop.call_at(self._idle_deadline, self._on_idle_timer)

    def _on_idle_timer(self) -> None:
        self._idle_timer = None
        current = self._current
        if self.closing or (current is not None and current.task is not None):
            return  # busy: the end of the answer re-arms it
        if self._loop.time() < self._idle_deadline:
            self._idle_timer = self._loop.call_at(self._idle_deadline, self._on_idle_timer)
            return
        self.close()  # no complete request in time (idle keep-alive, a slow head, an unread body)

    # --- handing over ------------------------------------------------------------------
    def _hand_over(self) -> None:
        """From the request at the start of the buffer on, the connection is aiohttp's."""
        transport = self._transport
        assert transport is not None and self._current is None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self.closing = True  # nothing more for this protocol
        self._server.connection_ended(self)
        protocol = self._server.aiohttp_protocol()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        data = bytes(self._buffer)
        self._buffer = b""
        protocol.data_received(data)


class LeanServer(JsonErrorServer):
    """The router's server with lean connections: the sites' protocol factory.

    Each connection starts as a :class:`LeanConnection`; those handed over, and the drain,
    use aiohttp's :class:`~kvroute.router.errors.JsonErrorServer` machinery as before.
    """

    def __init__(
        self,
        serving: web.Server,
        *,
        routes: Mapping[bytes, LeanRoute],
        limits: LeanLimits,
        stored_calls: StoredCalls | None = None,
        **connection_options: Any,
    ) -> None:
        super().__init__(serving, **connection_options)
        self.loop = asyncio.get_running_loop()
        self.routes = routes
        self.stored_calls = stored_calls
        self.limits = limits
        self.draining = False
        self._lean: set[LeanConnection] = set()

    def __call__(self) -> LeanConnection:  # type: ignore[override]
        # The sites call the server for each accepted connection; lean first.
        return LeanConnection(self)

    def aiohttp_protocol(self) -> RequestHandler:
        """A connection's aiohttp protocol (for a connection handed over)."""
        return super().__call__()

    def connection_started(self, connection: LeanConnection) -> None:
        self._lean.add(connection)

    def connection_ended(self, connection: LeanConnection) -> None:
        self._lean.discard(connection)

    @property
    def lean_connections(self) -> int:
        """Connections now served here (not handed over)."""
        return len(self._lean)

    def pre_shutdown(self) -> None:
        # The sites stopped accepting: idle connections close now, busy ones after their answer.
        super().pre_shutdown()
        self.draining = True
        for connection in list(self._lean):
            connection.stop_serving()

    async def shutdown(self, timeout: float | None = None) -> None:
        await asyncio.gather(super().shutdown(timeout), self._drain(timeout))

    async def _drain(self, timeout: float | None) -> None:
        """In-flight lean requests get up to ``timeout``; then they are cancelled and closed."""
        tasks = {task for connection in self._lean if (task := connection.task) is not None}
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for connection in list(self._lean):
            connection.close()
