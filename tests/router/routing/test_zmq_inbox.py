"""The ZMQ inbox: every message taken, in order, whether it came before or while waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from kvroute.router.routing.zmq_inbox import Inbox

Scenario = Callable[["zmq.Socket[bytes]", zmq.asyncio.Socket], Awaitable[None]]


def run_with_pair(scenario: Scenario) -> None:
    """Run ``scenario(sender, receiver)`` on a fresh event loop with a connected PUSH and
    PULL socket; both, and the context, are closed afterwards."""

    async def run() -> None:
        context = zmq.asyncio.Context()
        receiver = context.socket(zmq.PULL)
        receiver.setsockopt(zmq.LINGER, 0)
        port = receiver.bind_to_random_port("tcp://127.0.0.1")
        sender: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        sender.setsockopt(zmq.LINGER, 0)
        sender.connect(f"tcp://127.0.0.1:{port}")
        try:
            await scenario(sender, receiver)
        finally:
            sender.close()
            receiver.close()
            context.term()

    asyncio.run(run())


def test_next_takes_what_came_before_and_waits_for_what_comes_later() -> None:
    async def scenario(sender: zmq.Socket[bytes], receiver: zmq.asyncio.Socket) -> None:
        for number in range(3):
            sender.send_multipart([b"early", str(number).encode()])
        await asyncio.sleep(0.2)  # queued before the inbox watches the socket
        inbox = Inbox(receiver)
        assert [await asyncio.wait_for(inbox.next(), 5) for _ in range(3)] == [
            [b"early", b"0"],
            [b"early", b"1"],
            [b"early", b"2"],
        ]
        assert inbox.take() is None and not inbox.pending()
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        sender.send_multipart([b"late"])
        assert await asyncio.wait_for(waiting, 5) == [b"late"]
        inbox.close()
        sender.send_multipart([b"after close"])
        await asyncio.sleep(0.1)
        assert not inbox.pending() and inbox.take() is None

    run_with_pair(scenario)


def test_on_ready_is_called_until_a_burst_is_drained() -> None:
    async def scenario(sender: zmq.Socket[bytes], receiver: zmq.asyncio.Socket) -> None:
        taken: list[bytes] = []
        inbox: Inbox | None = None

        def on_ready() -> None:
            assert inbox is not None
            while (frames := inbox.take()) is not None:
                taken.append(frames[0])

        inbox = Inbox(receiver, on_ready=on_ready)
        for round_ in range(3):  # each burst arrives after the last was drained
            burst = [f"{round_}-{number}".encode() for number in range(500)]
            for message in burst:
                sender.send(message)
            for _ in range(500):
                if len(taken) == 500 * (round_ + 1):
                    break
                await asyncio.sleep(0.01)
            assert taken[-500:] == burst
        inbox.close()

    run_with_pair(scenario)


def test_a_message_put_back_is_taken_again_and_wakes_the_reader() -> None:
    async def scenario(sender: zmq.Socket[bytes], receiver: zmq.asyncio.Socket) -> None:
        inbox = Inbox(receiver)
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0.05)
        sender.send_multipart([b"first"])
        sender.send_multipart([b"second"])
        assert await asyncio.wait_for(waiting, 5) == [b"first"]
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0.1)
        taken = waiting.result()
        assert taken == [b"second"] and not inbox.pending()
        inbox.put_back(taken)  # taken by someone else first, then handed back
        assert inbox.pending()
        assert await asyncio.wait_for(inbox.next(), 5) == [b"second"]
        assert inbox.take() is None
        waiting = asyncio.ensure_future(inbox.next())
        await asyncio.sleep(0.05)
        inbox.put_back([b"again"])  # a reader already waiting wakes for it
        assert await asyncio.wait_for(waiting, 5) == [b"again"]
        inbox.close()

    run_with_pair(scenario)
