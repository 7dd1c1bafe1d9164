"""A lean HTTP/1.1 client for the proxy's requests to engines: the hot half of every request.

Why not ``aiohttp.ClientSession``: measured on the proxy path, its per-request machinery
(URL objects, header multidicts, cookie and trace hooks, timer contexts, response objects)
cost about twice as much CPU as the aiohttp *server* side of the same request. This client
does only what a reverse proxy needs, on ``asyncio.Protocol`` (uvloop):

* one keep-alive pool per backend origin, connections reused LIFO, dropped when the
  engine closes them or after :data:`KEEPALIVE_S` idle (below uvicorn's 5 s, so the router
  never reuses a connection the engine is about to close);
* the request written in one ``write`` (head built from raw header bytes, then the body);
* responses parsed by llhttp (``httptools``, uvicorn's parser), strictly: bad or conflicting
  ``Content-Length``, a ``Transfer-Encoding`` other than one ``chunked``, bad chunk sizes or
  missing CRLFs fail the request with :class:`UpstreamProtocolError` and close the connection;
  the body is delivered as it arrives (:meth:`UpstreamResponse.read_available`);
* a connection is reused only after a complete, well-framed keep-alive response, and one
  that receives any byte while idle (an engine's unsolicited ``408``) is discarded;
* one read timer per request that is re-armed only when it fires (data arriving just
  stamps the time), switched from the first-byte to the idle timeout by the caller;
* flow control both ways: reading pauses when the client is slower than the engine;
* a request that fails on a *reused* connection before any response byte arrived (the
  engine closed it while idle) is resent once on a fresh connection, as httpx and urllib3
  do; every other failure is reported to the caller as an :class:`UpstreamError`.

TLS backends (``https://``) work through the same protocol (``ssl=`` on the connection).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import httptools

from kvroute.router.backend_url import Origin

#: Idle keep-alive connections older than this are closed instead of reused.
KEEPALIVE_S = 4.0
#: Idle connections kept per backend; more are closed when released.
MAX_IDLE_PER_ORIGIN = 512
#: The longest response head accepted.
MAX_HEAD_BYTES = 64 * 1024
#: Buffered, unread body bytes above which reading from the engine pauses.
HIGH_WATER_BYTES = 256 * 1024

RawHeaders = Sequence[tuple[bytes, bytes]]


class UpstreamError(Exception):
    """The engine could not be reached or broke the exchange."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (refused, unreachable, connect timeout): nothing was sent."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed before the response head arrived."""


class UpstreamTimeout(UpstreamError):
    """No data within the read timeout (first byte or idle between chunks)."""


class UpstreamProtocolError(UpstreamError):
    """A malformed response, or the connection closed in the middle of the body."""


_LINE_ENDS = (ord("\r"), ord("\n"))
#: What a reason phrase may hold (RFC 9112 4: HTAB, SP, VCHAR, obs-text); llhttp takes any byte.
_REASON_BYTES = bytes([9, *range(32, 127), *range(128, 256)])


class _Violation(Exception):
    """Raised from a parser callback to stop llhttp at a framing rule it does not enforce itself."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the response being read on it.

    llhttp (``httptools``) decides the framing; this class adds the rules llhttp leaves to
    its caller (one ``chunked`` coding or none, HTTP/1.x, a status of at least 100, no
    control characters in the reason phrase, no blank line before the status line, no
    unrequested upgrade, a head size limit) and the proxy's rules for the connection: it
    is reused only after a complete, well-framed, keep-alive response with nothing after
    it, and any byte that arrives while no response is expected condemns it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        # One parser for the connection's life: llhttp carries its state from one response
        # to the next (and into the interim 1xx responses before a final one).
        self._parser = httptools.HttpResponseParser(self)
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self._awaiting = False  # True from send() until the final response ended: bytes are expected
        self._head_bytes = 0
        self._head_done = False
        self._head_waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        #: The first Content-Type field's value (noted while parsing: the proxy reads it).
        self.content_type: bytes | None = None
        self.keep_alive = True
        self._codings: list[bytes] = []  # Transfer-Encoding values, as sent
        self._has_length = False
        self._until_close = False  # the body ends when the engine closes the connection
        self._violation = ""
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._body_waiter: asyncio.Future[None] | None = None
        self.body_done = False
        self._paused = False
        self.error: UpstreamError | None = None
        self._got_bytes = False
        self._timeout = 0.0
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.error is None and not self.body_done:
            if not self._head_done:
                self._fail(UpstreamDisconnected(f"connection closed before the response ({exc or 'EOF'})"))
            elif self._until_close:
                self._finish_body()
            else:
                self._fail(UpstreamProtocolError(f"connection closed in the middle of the body ({exc or 'EOF'})"))
        self._stop_timer()

    def data_received(self, data: bytes) -> None:
        if not self._awaiting:
            # Nothing was asked (an idle pooled connection, or a response already complete):
            # e.g. an engine's unsolicited 408. It must never pass for the next answer.
            self.keep_alive = False
            self.abort()
            return
        if not self._head_done:
            if not self._got_bytes and data[0] in _LINE_ENDS:
                # llhttp skips blank lines before a status line (a server's leniency for
                # requests); an answer that starts with one is not a well-formed response.
                self._got_bytes = True
                self._reject("a blank line before the status line")
                return
            self._head_bytes += len(data)
        self._got_bytes = True
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject("protocol switch (101) that was never requested")
        except httptools.HttpParserError as exc:
            self._reject(self._violation or str(exc))
        else:
            if not self._head_done and self._head_bytes > MAX_HEAD_BYTES:
                self._reject("response head too large")

    def eof_received(self) -> bool | None:
        return False  # close the transport; connection_lost settles the exchange

    # --- llhttp callbacks (called from feed_data) --------------------------------------
    def on_message_begin(self) -> None:
        if self.body_done:  # a second response to one request: pipelined garbage
            self._violation = "bytes after the complete response"
            raise _Violation
        self.headers = []
        self.content_type = None
        self._codings = []
        self._has_length = False

    def on_status(self, reason: bytes) -> None:
        if reason.translate(None, _REASON_BYTES):
            self._violation = "a control character in the reason phrase"
            raise _Violation

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._head_done:
            return  # a trailer field: not forwarded (the body was re-framed), never a header
        value = value.rstrip(b" \t")  # llhttp drops the leading whitespace only
        self.headers.append((name, value))
        size = len(name)  # names of other lengths are none of these: no lower() for them
        if size == 12:
            if self.content_type is None and name.lower() == b"content-type":
                self.content_type = value
        elif size == 17:
            if name.lower() == b"transfer-encoding":
                self._codings.append(value)
        elif size == 14 and name.lower() == b"content-length":
            self._has_length = True  # llhttp checks the value, duplicates and the clash with chunked

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if status < 200:
            if status < 100:
                self._violation = f"status {status}"
                raise _Violation
            return  # interim (1xx): the final head follows; 101 stops llhttp as an upgrade
        version = parser.get_http_version()
        if version != "1.1":
            if version != "1.0":
                self._violation = f"unsupported HTTP version {version}"
                raise _Violation
            self.keep_alive = False  # HTTP/1.0 keep-alive is a legacy extension: not worth the doubt
        codings = self._codings
        # Only one coding, chunked: a proxy that re-frames the body must not drop another one.
        if codings and (len(codings) > 1 or codings[0].lower() != b"chunked"):
            self._violation = f"unsupported Transfer-Encoding {b', '.join(codings)[:80]!r}"
            raise _Violation
        self.status = status
        self._head_done = True
        self._until_close = not codings and not self._has_length and status not in (204, 304)
        if self._until_close:
            self.keep_alive = False
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_body(self, data: bytes) -> None:
        self._deliver(data)

    def on_message_complete(self) -> None:
        if not self._head_done:
            return  # the end of an interim response
        self.keep_alive = self.keep_alive and self._parser.should_keep_alive()
        self._finish_body()

    # --- request -------------------------------------------------------------------------
    def send(self, head: bytes, body: bytes, first_byte_timeout: float) -> None:
        assert self.transport is not None
        if self.closed:  # condemned between connect and send (it spoke first)
            self._fail(UpstreamDisconnected("connection closed before the request was sent"))
            return
        self._awaiting = True
        self._timeout = first_byte_timeout
        self._last_data = self._loop.time()
        self._timer = self._loop.call_later(first_byte_timeout, self._on_timer)
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)

    def head_waiter(self) -> asyncio.Future[None] | None:
        """What to await until the response head arrived (or the exchange failed); None when
        that already happened. A plain method rather than a coroutine: the caller awaits the
        future itself, one coroutine fewer per request."""
        if self._head_done or self.error is not None:
            return None
        waiter = self._head_waiter = self._loop.create_future()
        return waiter

    # --- response body -------------------------------------------------------------------
    def _deliver(self, data: bytes) -> None:
        self._body.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and not self.closed:
            self._paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake_body()

    def _finish_body(self) -> None:
        self.body_done = True
        self._awaiting = False
        self._stop_timer()
        self._wake_body()

    def _wake_body(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read_available(self) -> bytes:
        while not self._body:
            if self.error is not None:
                raise self.error
            if self.body_done:
                return b""
            self._body_waiter = self._loop.create_future()
            await self._body_waiter
        return self._take_body()

    def read_complete(self) -> bytes | None:
        """The whole rest of the body when it has all arrived (nearly every non-streamed
        answer: it comes in the head's read), without awaiting; None otherwise."""
        if not self.body_done or self.error is not None:
            return None
        return self._take_body() if self._body else b""

    def _take_body(self) -> bytes:
        body = self._body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._paused and not self.closed:
            self._paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return data

    # --- timeouts and failures -----------------------------------------------------------
    def set_timeout(self, timeout: float) -> None:
        """From now on, fail when no data arrives for ``timeout`` seconds."""
        self._timeout = timeout
        self._last_data = self._loop.time()
        self._stop_timer()
        if not self.body_done and self.error is None:
            self._timer = self._loop.call_later(timeout, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.body_done or self.error is not None:
            return
        left = self._last_data + self._timeout - self._loop.time()
        if left > 0:
            self._timer = self._loop.call_later(left, self._on_timer)
            return
        self._fail(UpstreamTimeout(f"no data for {self._timeout:g} s"))
        self.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _reject(self, reason: str) -> None:
        """Malformed bytes: fail the response unless it was already complete, and close."""
        if not self.body_done:
            # Unread bytes may be the malformed chunk's own (llhttp hands them over before
            # it sees the missing CRLF): the caller gets the error, never them.
            self._body.clear()
            self._buffered = 0
            self._fail(UpstreamProtocolError(f"malformed response: {reason}"))
        self.abort()

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.keep_alive = False
        for waiter in (self._head_waiter, self._body_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def abort(self) -> None:
        """Close the connection now (the engine sees the client's abort)."""
        self.keep_alive = False
        self._stop_timer()
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    @property
    def got_bytes(self) -> bool:
        return self._got_bytes

    def reusable(self) -> bool:
        return self.keep_alive and self.body_done and self.error is None and not self.closed

    def recycle(self) -> None:
        """Ready for the next request on this connection (now idle in its pool)."""
        self._reset_exchange()
        self.reused = True
        self.idle_since = self._loop.time()


class UpstreamResponse:
    """The head of an engine's answer, and its body as it arrives."""

    __slots__ = ("_connection", "_pool", "raw_headers", "read_available", "status")

    def __init__(self, connection: _Connection, pool: _OriginPool) -> None:
        self.status = connection.status
        self.raw_headers = connection.headers
        self._connection = connection
        self._pool = pool
        #: Everything received and not yet read (waits for at least one byte); b"" at the
        #: end. The connection's own method: no wrapping coroutine per chunk of a stream.
        self.read_available: Callable[[], Coroutine[Any, Any, bytes]] = connection.read_available

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (``name`` in lower case)."""
        for key, value in self.raw_headers:
            if key.lower() == name:
                return value
        return None

    @property
    def is_event_stream(self) -> bool:
        content_type = self._connection.content_type
        return content_type is not None and content_type.lower().startswith(b"text/event-stream")

    async def read(self) -> bytes:
        """The whole body."""
        connection = self._connection
        complete = connection.read_complete()
        if complete is not None:
            return complete
        parts: list[bytes] = []
        while True:
            data = await connection.read_available()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def set_timeout(self, timeout: float) -> None:
        """Switch to ``timeout`` seconds without data (e.g. from first-byte to idle)."""
        self._connection.set_timeout(timeout)

    def release(self) -> None:
        """Done with the response: a fully read one returns its connection to the pool."""
        connection = self._connection
        if connection.reusable():
            self._pool.put(connection)
        else:
            connection.abort()

    def close(self) -> None:
        """Abandon the response: the connection is closed so the engine stops its work."""
        self._connection.abort()


class _OriginPool:
    """Idle keep-alive connections to one origin."""

    def __init__(self, origin: Origin, ssl_context: ssl.SSLContext | None) -> None:
        self.origin = origin
        self._ssl = ssl_context if origin.ssl else None
        self._idle: list[_Connection] = []

    def take_idle(self) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            # The connection's own loop for the time: asyncio.get_running_loop() costs a
            # getpid system call on CPython 3.11.
            if not connection.closed and connection._loop.time() - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.abort()
        return None

    async def connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> _Connection:
        origin = self.origin
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop),
                    origin.host,
                    origin.port,
                    ssl=self._ssl,
                    server_hostname=origin.host if self._ssl else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(f"connect timeout after {timeout:g} s") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc.strerror or exc}") from None
        return connection

    def put(self, connection: _Connection) -> None:
        if len(self._idle) >= MAX_IDLE_PER_ORIGIN:
            connection.abort()
            return
        connection.recycle()
        self._idle.append(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.abort()
        self._idle.clear()


class UpstreamClient:
    """Sends proxied requests to backends; one per application."""

    def __init__(self, *, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._pools: dict[str, _OriginPool] = {}

    def _pool(self, target: Origin | str) -> _OriginPool:
        key = target if isinstance(target, str) else target.key
        pool = self._pools.get(key)
        if pool is None:
            origin = Origin(target) if isinstance(target, str) else target
            context = origin.ssl_context or self._ssl
            if context is None and origin.ssl:
                context = self._ssl = ssl.create_default_context()
            pool = self._pools[key] = _OriginPool(origin, context)
        return pool

    async def send(
        self,
        method: bytes,
        target: Origin | str,
        path: bytes,
        headers: RawHeaders,
        body: bytes,
        *,
        first_byte_timeout: float,
    ) -> UpstreamResponse:
        """Send ``method`` with ``body`` to ``path`` under the backend ``target`` (its
        :class:`Origin`, or its URL); returns once the response head arrived. The origin's
        path prefix goes first.

        ``headers`` must not contain Host, Content-Length or Transfer-Encoding. Raises
        :class:`UpstreamConnectError` (nothing sent), :class:`UpstreamDisconnected`,
        :class:`UpstreamTimeout` or :class:`UpstreamProtocolError`.
        """
        pool = self._pool(target)
        origin = pool.origin
        target_path = origin.prefix + path if origin.prefix else path
        head = _request_head(method, target_path, origin.host_header, headers, len(body))
        for attempt in (0, 1):
            connection = pool.take_idle() if attempt == 0 else None
            if connection is None:
                connection = await pool.connect(asyncio.get_running_loop(), self._connect_timeout)
            try:
                connection.send(head, body, first_byte_timeout)
                waiter = connection.head_waiter()
                if waiter is not None:
                    await waiter
                if connection.error is not None:
                    raise connection.error
                return UpstreamResponse(connection, pool)
            except UpstreamDisconnected:
                connection.abort()
                # A reused connection the engine closed while idle: nothing was processed,
                # so the request goes once more on a fresh connection.
                if attempt or not connection.reused or connection.got_bytes:
                    raise
            except BaseException:
                connection.abort()
                raise
        raise AssertionError("unreachable")

    def forget(self, base_url: str) -> None:
        """Close the idle connections of a backend that left the pool (``base_url``: its
        identity, :attr:`Origin.key`)."""
        pool = self._pools.pop(base_url, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Close every idle connection."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _request_head(method: bytes, path: bytes, host: bytes, headers: RawHeaders, length: int) -> bytes:
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: " + host]
    if length or method == b"POST":  # a GET or DELETE without a body has no Content-Length (RFC 9110 8.6)
        lines.append(b"Content-Length: %d" % length)
    lines += [name + b": " + value for name, value in headers]
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
