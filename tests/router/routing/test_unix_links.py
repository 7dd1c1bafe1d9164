"""Two-part messages over Unix stream sockets, as the workers' placement exchange sends them."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import pytest

from kvroute.router.routing import unix_links
from kvroute.router.routing.unix_links import HELLO, RECEIVE_BATCH, UnixPublisher, UnixSubscriber, frame, unix_path
from tests.servers import until


def _run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout=20))


class _Received:
    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self.refused = 0

    def subscriber(self) -> UnixSubscriber:
        return UnixSubscriber(lambda head, body: self.messages.append((head, body)), self._refused)

    def _refused(self) -> None:
        self.refused += 1


def test_unix_endpoints_name_a_path() -> None:
    assert unix_path("unix:///run/kvroute/worker-0.placements") == "/run/kvroute/worker-0.placements"
    assert unix_path("ipc:///run/x") is None and unix_path("tcp://127.0.0.1:5600") is None


def test_messages_arrive_whole_and_in_order(tmp_path: Path) -> None:
    """Bursts beyond one turn's batch, and a message larger than a socket read."""
    path = str(tmp_path / "p.sock")
    big = bytes(range(256)) * 4096  # 1 MiB: arrives over many reads

    async def scenario() -> None:
        received = _Received()
        publisher = UnixPublisher(path)
        await publisher.start()
        subscriber = received.subscriber()
        subscriber.connect([path])
        assert await subscriber.wait_ready([path], timeout_s=5)
        try:
            burst = [(b"head-%d" % number, b"body-%d" % number) for number in range(2 * RECEIVE_BATCH + 3)]
            assert publisher.send(b"".join(frame(head, body) for head, body in burst)) == 0
            assert publisher.send(frame(b"", big) + frame(b"after", b"")) == 0
            await until(lambda: len(received.messages) == len(burst) + 2)
            assert received.messages[: len(burst)] == burst
            assert received.messages[len(burst) :] == [(b"", big), (b"after", b"")]
            assert received.refused == 0 and publisher.readers == 1
        finally:
            subscriber.close()
            publisher.close()

    _run(scenario)


def test_a_subscriber_waits_for_a_publisher_that_starts_later_and_one_that_restarts(tmp_path: Path) -> None:
    path = str(tmp_path / "p.sock")

    async def scenario() -> None:
        received = _Received()
        subscriber = received.subscriber()
        subscriber.connect([path])
        assert not await subscriber.wait_ready([path], timeout_s=0.2)  # nobody listens yet
        assert not await subscriber.wait_ready([str(tmp_path / "never-connected")], timeout_s=0.1)
        publisher = UnixPublisher(path)
        await publisher.start()
        try:
            assert await subscriber.wait_ready([path], timeout_s=5)
            publisher.send(frame(b"one", b""))
            await until(lambda: len(received.messages) == 1)
            publisher.close()  # a worker that died; its successor binds the same path
            publisher = UnixPublisher(path)
            await publisher.start()
            await until(lambda: publisher.readers == 1)
            publisher.send(frame(b"two", b""))
            await until(lambda: len(received.messages) == 2)
            assert [head for head, _ in received.messages] == [b"one", b"two"]
        finally:
            subscriber.close()
            publisher.close()

    _run(scenario)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n",  # not a publisher of placements
        HELLO + struct.pack("<II", unix_links.MAX_PART_BYTES + 1, 0),  # a part past the limit
    ],
)
def test_a_peer_sending_anything_else_is_disconnected_and_counted(tmp_path: Path, garbage: bytes) -> None:
    path = str(tmp_path / "p.sock")

    async def scenario() -> None:
        connections: list[asyncio.Transport] = []

        class Impostor(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                connections.append(cast(asyncio.Transport, transport))
                connections[-1].write(garbage)

        server = await asyncio.get_running_loop().create_unix_server(Impostor, path)
        received = _Received()
        subscriber = received.subscriber()
        subscriber.connect([path])
        try:
            await until(lambda: received.refused >= 1)
            assert received.messages == []
            await until(lambda: connections[0].is_closing())
        finally:
            subscriber.close()
            server.close()

    _run(scenario)


def test_a_reader_too_far_behind_loses_messages_and_the_publisher_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that stops reading fills the socket, then the publisher's buffer up to the
    limit; past it the publisher skips that reader instead of queueing without bound."""
    monkeypatch.setattr(unix_links, "SEND_LIMIT_BYTES", 64 * 1024)
    path = str(tmp_path / "p.sock")

    async def scenario() -> None:
        publisher = UnixPublisher(path)
        await publisher.start()
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(path)  # never reads
        try:
            await until(lambda: publisher.readers == 1)
            message = frame(b"h", bytes(64 * 1024))
            behind = 0
            for _ in range(200):  # 12.8 MiB: far past the socket's buffers and the limit
                behind += publisher.send(message)
                await asyncio.sleep(0)
            assert behind > 0
        finally:
            stalled.close()
            publisher.close()

    _run(scenario)
