"""KV cache events in vLLM's wire format, published over ZeroMQ.

Framing, as vLLM's ``ZmqEventPublisher`` sends it:

* PUB socket, one message per scheduler step: 3 frames
  ``[topic, sequence number (8 bytes, big-endian), msgpack payload]``; the payload is
  ``[timestamp, [event, ...], data_parallel_rank]``.
* Events either as msgpack maps with a ``type`` key (``map``) or as positional arrays
  whose first element is the type name (``array``), trailing defaulted fields omitted.
* Optional ROUTER replay socket: a DEALER sends ``["", start_seq]`` and gets one
  ``["", seq, payload]`` message per buffered batch with ``seq >= start_seq``, then
  ``["", -1 (8 bytes, signed), b""]``.

An endpoint with ``*`` (or ``ipc://`` / ``inproc://``) is bound, any other is connected to,
which is vLLM's rule too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvroute.benchmarks.sim_engine.config import KVEventsFormat

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that became cached; ``parent_block_hash`` is the block before the first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole cache was dropped (``/reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_as_map(event: KVEvent) -> dict[str, Any]:
    """vLLM's tagged-struct map form; optional fields left out when unset."""
    if isinstance(event, BlockStored):
        encoded: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            encoded["extra_keys"] = event.extra_keys
        return encoded
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def event_as_array(event: KVEvent) -> list[Any]:
    """vLLM's ``array_like`` form: positional, trailing defaulted fields omitted."""
    if isinstance(event, BlockStored):
        encoded: list[Any] = [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        ]
        if event.extra_keys is not None:
            encoded.append(event.extra_keys)
        return encoded
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Collects a step's events and publishes them as one numbered batch.

    Publishing is a non-blocking PUB send from the event loop (PUB drops at its high-water
    mark rather than block, as in vLLM); the replay socket is served by one asyncio task.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        event_format: KVEventsFormat = "map",
        topic: str = "kv-events",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        hwm: int = 100_000,
        delay_s: float = 0.0,
    ) -> None:
        self._encode_event = event_as_map if event_format == "map" else event_as_array
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[KVEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._delay_s = delay_s
        self._closed = False
        # PUB is a plain synchronous socket (its sends never block); the replay ROUTER lives
        # on an asyncio shadow of the same context so one task can await requests.
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = zmq.asyncio.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._ctx.term()
            raise ValueError(f"KV events endpoint {endpoint!r} / {replay_endpoint!r}: {exc}") from None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_sequence(self) -> int:
        """The sequence number the next published batch will carry."""
        return self._next_seq

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def add(self, event: KVEvent) -> None:
        """Queue an event for the current step's batch."""
        self._pending.append(event)

    def flush(self) -> None:
        """Publish the queued events (if any) as one batch with the next sequence number."""
        if not self._pending:
            return
        events = [self._encode_event(event) for event in self._pending]
        self._pending = []
        payload = self._encoder.encode([time.time(), events, self._rank])
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        frames = (self._topic, seq.to_bytes(8, "big"), payload)
        if self._delay_s > 0:
            # (call_later keeps the batches in order: their times only grow)
            asyncio.get_running_loop().call_later(self._delay_s, self._send, frames)
        else:
            self._send(frames)

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        if self._closed:  # (a delayed batch after close: dropped, as by a stopped engine)
            return
        with contextlib.suppress(zmq.Again):
            # At the high-water mark PUB drops rather than block, like vLLM's publisher.
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 3:
                log.warning("ignoring malformed replay request with %d frames", len(frames))
                continue
            client_id, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client_id, b"", END_OF_REPLAY, b""))

    async def close(self) -> None:
        """Stop the replay task and close the sockets."""
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._closed = True
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
