"""Two-part messages between processes on one host over Unix stream sockets.

The placement exchange's ``unix://PATH`` endpoints (:mod:`kvroute.router.routing.peer_exchange`),
which join the workers of ``kvroute serve --workers N``. ZMQ hands every message to its
I/O thread and wakes the reader's through another: ~22-28 us of CPU per message on each
side on a 2-core VM, where a write from the event loop into a Unix socket and a read in
the other loop's callback cost ~8-10 us (``python -m kvroute.benchmarks.bench_peer_exchange``).
Every request a worker routes crosses the exchange once; in a loaded router, with those
threads competing for the cores, two workers spend ~12 % less CPU per request this way
(``benchmarks/README.md``, "Workers").

The same roles as ZMQ's PUB and SUB: a :class:`UnixPublisher` listens on a path and sends
every message to each reader connected to it; a :class:`UnixSubscriber` connects to
publishers' paths, retrying while a path is missing or after a publisher went away (a
restarted worker), and hands each message it reads to a callback. A publisher greets each
reader with :data:`HELLO` once it has taken the connection, so a reader knows from when on
nothing is lost (:meth:`UnixSubscriber.wait_ready`). A frame is two little-endian ``u32``
lengths and the two parts. A reader more than :data:`SEND_LIMIT_BYTES` behind loses
messages, counted, never queued without bound; one sending anything but frames is
disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Sequence
from typing import cast

log = logging.getLogger(__name__)

SCHEME = "unix://"
HELLO = b"kvroute-placements/1\n"
_LENGTHS = struct.Struct("<II")
#: Largest part accepted (a 1M-token prompt's hashes at block size 16 are ~500 KB).
MAX_PART_BYTES = 64 * 1024 * 1024
#: Bytes a reader may have waiting in the publisher's buffer before messages drop for it.
SEND_LIMIT_BYTES = 16 * 1024 * 1024
#: Messages handed on per event-loop turn before a reader lets other work run.
RECEIVE_BATCH = 256
#: Pause between attempts to reach a publisher that is not (or no longer) there.
RETRY_S = 0.05
#: Pause before trying again a path whose listener sent something other than placements.
REFUSED_RETRY_S = 5.0


def unix_path(endpoint: str) -> str | None:
    """The socket path of a ``unix://PATH`` endpoint, else None."""
    return endpoint[len(SCHEME) :] if endpoint.startswith(SCHEME) else None


def frame(head: bytes, body: bytes) -> bytes:
    """One message as it travels."""
    return _LENGTHS.pack(len(head), len(body)) + head + body


class UnixPublisher:
    """Listens on ``path`` and sends every message to each connected reader."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._readers: set[asyncio.WriteTransport] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Greeter(self._readers), self.path)

    @property
    def readers(self) -> int:
        return len(self._readers)

    def send(self, data: bytes) -> int:
        """Write ``data`` (whole frames) to every reader that is not too far behind; how
        many readers were, and lost it."""
        behind = 0
        for reader in self._readers:
            if reader.get_write_buffer_size() > SEND_LIMIT_BYTES:
                behind += 1
            else:
                reader.write(data)
        return behind

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for reader in list(self._readers):
            reader.close()
        self._readers.clear()


class _Greeter(asyncio.Protocol):
    """The publisher's side of one reader's connection: greets it, ignores what it sends."""

    def __init__(self, readers: set[asyncio.WriteTransport]) -> None:
        self._readers = readers
        self._transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        writer = cast(asyncio.WriteTransport, transport)  # uvloop's are not asyncio's classes
        self._transport = writer
        writer.write(HELLO)
        self._readers.add(writer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._readers.discard(self._transport)


class UnixSubscriber:
    """Reads the messages of every publisher it is connected to, reconnecting when one goes."""

    def __init__(self, on_message: Callable[[bytes, bytes], None], on_refused: Callable[[], None]) -> None:
        """``on_message(head, body)`` for every message; ``on_refused()`` when a connection
        is closed for sending something other than frames."""
        self._on_message = on_message
        self._on_refused = on_refused
        self._links: dict[str, _Link] = {}

    def connect(self, paths: Sequence[str]) -> None:
        loop = asyncio.get_running_loop()
        for path in paths:
            if path not in self._links:
                link = self._links[path] = _Link(path, self._on_message, self._on_refused)
                link.task = loop.create_task(link.run(), name=f"kvroute-unix-link:{path}")

    def states(self) -> dict[str, str]:
        """Each publisher's path: ``connected`` while its connection is up, else ``connecting``."""
        return {path: "connected" if link.connected else "connecting" for path, link in self._links.items()}

    async def wait_ready(self, paths: Sequence[str], timeout_s: float) -> bool:
        """Whether every publisher in ``paths`` greeted this subscriber within ``timeout_s``."""
        links = [self._links.get(path) for path in paths]
        waits = [link.greeted for link in links if link is not None]
        if len(waits) < len(links):
            return False  # not connected to it at all
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        return not pending

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


class _Link(asyncio.Protocol):
    """One publisher's connection, re-established while the subscriber lasts."""

    def __init__(self, path: str, on_message: Callable[[bytes, bytes], None], on_refused: Callable[[], None]) -> None:
        self.path = path
        self._on_message = on_message
        self._on_refused = on_refused
        self.task: asyncio.Task[None] | None = None
        self.greeted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._lost: asyncio.Future[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._hello_pending = True
        self._draining = False
        self._refused = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._lost = loop.create_future()
            try:
                await loop.create_unix_connection(lambda: self, self.path)
            except OSError:
                await asyncio.sleep(RETRY_S)  # not listening yet, or gone
                continue
            await self._lost
            await asyncio.sleep(REFUSED_RETRY_S if self._refused else RETRY_S)
            self._refused = False

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self._transport is not None:
            self._transport.close()
        if not self.greeted.done():
            self.greeted.cancel()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio's classes
        self._buffer.clear()
        self._hello_pending = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._draining:
            self._drain()

    def _drain(self) -> None:
        """Hand on up to :data:`RECEIVE_BATCH` whole messages; the rest after other work."""
        self._draining = False
        transport = self._transport
        if transport is None:
            return
        buffer = self._buffer
        position = 0
        if self._hello_pending:
            if buffer[: len(HELLO)] != HELLO[: len(buffer)]:
                return self._refuse(transport)
            if len(buffer) < len(HELLO):
                return
            position = len(HELLO)
            self._hello_pending = False
            if not self.greeted.done():
                self.greeted.set_result(None)
        handed = 0
        on_message = self._on_message
        while handed < RECEIVE_BATCH and len(buffer) - position >= _LENGTHS.size:
            head_bytes, body_bytes = _LENGTHS.unpack_from(buffer, position)
            if head_bytes > MAX_PART_BYTES or body_bytes > MAX_PART_BYTES:
                return self._refuse(transport)
            start = position + _LENGTHS.size
            end = start + head_bytes + body_bytes
            if end > len(buffer):
                break
            head = bytes(buffer[start : start + head_bytes])
            body = bytes(buffer[start + head_bytes : end])
            position = end
            handed += 1
            on_message(head, body)
        del buffer[:position]
        if handed == RECEIVE_BATCH and len(buffer) >= _LENGTHS.size:
            self._draining = True
            transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._drain()
        if not self._draining and self._transport is not None:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self._transport.resume_reading()

    def _refuse(self, transport: asyncio.Transport) -> None:
        self._refused = True
        self._on_refused()
        log.warning("placement exchange: %s sent something other than placements; disconnected", self.path)
        self._buffer.clear()
        transport.close()
