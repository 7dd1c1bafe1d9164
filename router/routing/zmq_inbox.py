"""A ZMQ socket read on the event loop without a future per message.

zmq.asyncio's ``recv`` makes a future per message and registers and drops the socket's
descriptor with the loop around it: on this project's 2-core VM that cost ~110-150 us of
CPU per message, more than the message's own work (``benchmarks/README.md``, "Workers").
An :class:`Inbox` keeps the descriptor registered and reads the socket directly.

ZMQ's descriptor is edge-triggered: it signals when the socket's events change, not while
messages wait, so a reader takes messages until ``EVENTS`` (which also runs ZMQ's pending
commands) shows none left, and only then waits for the next signal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq


class Inbox:
    """The messages of a receiving ZMQ socket, taken on the running event loop.

    ``on_ready`` is called (on the loop) whenever the socket may have messages; without
    it, :meth:`next` waits for them. Either way the caller takes them with :meth:`take`
    until it returns None. :meth:`close` before closing the socket.
    """

    def __init__(self, socket: zmq.Socket[Any], on_ready: Callable[[], None] | None = None) -> None:
        # The same socket without an asyncio wrapper (if it had one): plain non-blocking reads.
        self._socket: zmq.Socket[bytes] = zmq.Socket.shadow(socket.underlying)
        self._ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._callback = on_ready if on_ready is not None else self._ready.set
        self._held: list[bytes] | None = None
        #: The descriptor signalled since a take found nothing (messages may be waiting).
        self._signalled = True  # what came before the descriptor was watched
        self._loop.add_reader(self._socket, self._signal)
        self._loop.call_soon(self._callback)
        self._open = True

    def _signal(self) -> None:
        self._signalled = True
        self._callback()

    def signalled(self) -> bool:
        """Whether messages may be waiting, known without asking the socket (cheap): the
        descriptor signalled, or a message was put back, since a take last found nothing."""
        return self._open and (self._signalled or self._held is not None)

    def pending(self) -> bool:
        """Whether a message is waiting (false also once closed)."""
        if not self._open:
            return False
        return self._held is not None or bool(int(self._socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def take(self) -> list[bytes] | None:
        """The next message's frames, or None when none is waiting."""
        held = self._held
        if held is not None:
            self._held = None
            return held
        if not self.pending():
            self._signalled = False
            return None
        try:
            return self._socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            self._signalled = False
            return None

    def put_back(self, frames: list[bytes]) -> None:
        """Return a message taken (one at most): the next :meth:`take` gives it again, and
        the reader is told, as for a message that arrived."""
        self._held = frames
        self._loop.call_soon(self._callback)

    async def next(self) -> list[bytes]:
        """The next message, waiting for one if none is there (only without ``on_ready``)."""
        while True:
            frames = self.take()
            if frames is not None:
                return frames
            self._ready.clear()
            # One may have come between the take and the clear, its signal cleared with it.
            frames = self.take()
            if frames is not None:
                return frames
            await self._ready.wait()

    def close(self) -> None:
        """Stop watching the socket (the caller closes it)."""
        if self._open:
            self._open = False
            self._loop.remove_reader(self._socket)
