"""The simulated engine's KV events, read with real ZeroMQ SUB and DEALER sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.benchmarks.sim_engine.config import KVEventsFormat, SimEngineConfig
from kvroute.benchmarks.sim_engine.server import SIM_ENGINE, SimEngine, build_app

pytestmark = pytest.mark.timeout(60)

TOPIC = b"kv-events"
RECEIVE_TIMEOUT_S = 10.0


@dataclass
class Batch:
    """One published message, decoded."""

    seq: int
    ts: float
    events: list[Any]
    rank: int
    payload: bytes


@dataclass
class EventFeed:
    """A sim engine with its event stream attached: HTTP URL, engine, SUB socket."""

    url: str
    engine: SimEngine
    sub: zmq.asyncio.Socket
    replay_endpoint: str
    context: zmq.asyncio.Context

    async def receive(self, timeout: float = RECEIVE_TIMEOUT_S) -> Batch:
        topic, seq, payload = await asyncio.wait_for(self.sub.recv_multipart(), timeout)
        assert topic == TOPIC and len(seq) == 8
        ts, events, rank = msgspec.msgpack.decode(payload)
        return Batch(int.from_bytes(seq, "big"), ts, events, rank, payload)

    async def receive_until(self, predicate: Any) -> list[Batch]:
        """Batches up to and including the first one holding an event that satisfies it."""
        batches = []
        while True:
            batch = await self.receive()
            batches.append(batch)
            if any(predicate(event) for event in batch.events):
                return batches

    async def complete(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        body = {"model": self.engine.config.models[0], "prompt": prompt, "max_tokens": 1, **extra}
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()

    async def reset(self) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/reset_prefix_cache") as response:
                assert response.status == 200


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def token_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, size=length).tolist()


def event_type(event: Any) -> str:
    return event["type"] if isinstance(event, dict) else event[0]


@contextlib.asynccontextmanager
async def event_feed(event_format: KVEventsFormat, **overrides: Any) -> AsyncIterator[EventFeed]:
    """A sim whose PUB socket connects to our bound SUB (everything on 127.0.0.1).

    ZeroMQ drops messages published before a subscription is in place, so the feed is
    primed: probe requests until one's events arrive, then reset the cache and wait for
    ``AllBlocksCleared``. Tests start from an empty cache and a live stream.
    """
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = SimEngineConfig(
        port=0,
        time_scale=1000.0,
        kv_events_endpoint=f"tcp://127.0.0.1:{port}",
        kv_events_replay_endpoint=replay_endpoint,
        kv_events_format=event_format,
    )
    app = build_app(replace(config, **overrides))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    feed = EventFeed(url, app[SIM_ENGINE], sub, replay_endpoint, context)
    try:
        for attempt in range(100):
            await feed.complete(token_prompt(10_000 + attempt, 40))
            with contextlib.suppress(asyncio.TimeoutError):
                await feed.receive(timeout=0.2)
                break
        else:
            raise AssertionError("no KV event reached the subscriber")
        await feed.reset()
        await feed.receive_until(lambda event: event_type(event) == "AllBlocksCleared")
        yield feed
    finally:
        await runner.cleanup()
        sub.close(linger=0)
        context.term()


def expected_hashes(engine: SimEngine, prompt: list[int], cache_salt: str | None = None) -> list[int]:
    key = engine.cache_key(engine.config.models[0], cache_salt)
    assert engine.cache is not None
    return engine.cache.hashes(np.asarray(prompt), key).tolist()


def apply(events: list[Any], held: set[int]) -> None:
    """Replay decoded map-form events onto a set of block hashes."""
    for event in events:
        if event["type"] == "BlockStored":
            held.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            held.difference_update(event["block_hashes"])
        else:
            held.clear()


async def test_map_events_describe_stores_evictions_and_resets() -> None:
    # 8 blocks of 16 tokens; max_tokens=1 so no output block is ever stored.
    async with event_feed("map", kv_capacity_tokens=128) as feed:
        first, second = token_prompt(1, 96), token_prompt(2, 64)
        held: set[int] = set()
        batches: list[Batch] = []

        await feed.complete(first)
        batches += await feed.receive_until(lambda event: event["type"] == "BlockStored")
        stored = batches[-1].events[-1]
        first_hashes = expected_hashes(feed.engine, first)
        assert stored == {
            "type": "BlockStored",
            "block_hashes": first_hashes,
            "parent_block_hash": None,
            "token_ids": first,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        assert batches[-1].rank == 0 and batches[-1].ts > 0

        await feed.complete(second)
        batches += await feed.receive_until(lambda event: event["type"] == "BlockStored")
        events = [event for batch in batches[-1:] for event in batch.events]
        removed = next(event for event in events if event["type"] == "BlockRemoved")
        # The least recently used sequence loses its tail first.
        assert sorted(removed["block_hashes"]) == sorted(first_hashes[4:])
        assert removed["medium"] == "GPU"

        # A prompt sharing first's 4 cached blocks stores only its new blocks, chained.
        branch = first[:64] + token_prompt(3, 32)
        await feed.complete(branch)
        batches += await feed.receive_until(lambda event: event["type"] == "BlockStored")
        stored = next(event for event in batches[-1].events if event["type"] == "BlockStored")
        branch_hashes = expected_hashes(feed.engine, branch)
        assert stored["parent_block_hash"] == branch_hashes[3] == first_hashes[3]
        assert stored["block_hashes"] == branch_hashes[4:]
        assert stored["token_ids"] == branch[64:]

        for batch in batches:
            apply(batch.events, held)
        assert feed.engine.cache is not None and len(held) == feed.engine.cache.blocks == 8
        # Consecutive sequence numbers, one batch per engine step.
        sequence = [batch.seq for batch in batches]
        assert sequence == list(range(sequence[0], sequence[0] + len(sequence)))

        await feed.reset()
        cleared = await feed.receive()
        assert cleared.events == [{"type": "AllBlocksCleared"}] and cleared.seq == sequence[-1] + 1


async def test_generated_blocks_are_stored_after_the_prompt_chained() -> None:
    async with event_feed("map") as feed:
        prompt = token_prompt(7, 40)  # 2 full blocks and 8 tokens of a third
        # 40 prompt + 29 generated tokens: KV exists for 68 tokens (the last sampled token
        # is never computed), i.e. 4 full blocks.
        await feed.complete(prompt, max_tokens=29)
        batches = await feed.receive_until(lambda event: len(event.get("block_hashes", ())) == 2
                                           and event.get("parent_block_hash") is not None)  # fmt: skip
        prompt_store = batches[0].events[0]
        output_store = batches[-1].events[-1]
        assert prompt_store["block_hashes"] == expected_hashes(feed.engine, prompt)
        assert output_store["parent_block_hash"] == prompt_store["block_hashes"][-1]
        sequence = prompt + output_store["token_ids"][8:]
        assert output_store["token_ids"][:8] == prompt[32:]
        assert output_store["block_hashes"] == expected_hashes(feed.engine, sequence)[2:]
        assert feed.engine.cache is not None and feed.engine.cache.index_blocks == 4


async def test_delayed_events_come_after_the_answer_in_order() -> None:
    """``kv_events_delay_s``: a step's batch is published that long after the step, so the
    answer comes first (as from vLLM), and the batches keep their order."""
    async with event_feed("map", kv_events_delay_s=1.0) as feed:
        await feed.complete(token_prompt(8, 40))
        with pytest.raises(asyncio.TimeoutError):
            await feed.receive(timeout=0.2)  # answered; its blocks not yet announced
        await feed.complete(token_prompt(9, 40))
        last = expected_hashes(feed.engine, token_prompt(9, 40))
        batches = await feed.receive_until(lambda event: event.get("block_hashes") == last)
        stores = [event for batch in batches for event in batch.events if event["type"] == "BlockStored"]
        assert [event["block_hashes"] for event in stores] == [
            expected_hashes(feed.engine, token_prompt(seed, 40)) for seed in (8, 9)
        ]
        assert [batch.seq for batch in batches] == sorted(batch.seq for batch in batches)


async def test_array_events_are_positional() -> None:
    async with event_feed("array", kv_capacity_tokens=64) as feed:
        prompt = token_prompt(4, 48)
        await feed.complete(prompt)
        stored = (await feed.receive_until(lambda event: event[0] == "BlockStored"))[-1].events[-1]
        # Trailing defaulted fields (extra_keys) are left out, as msgspec's array_like does.
        assert stored == ["BlockStored", expected_hashes(feed.engine, prompt), None, prompt, 16, None, "GPU", None]
        await feed.complete(token_prompt(5, 48))
        batches = await feed.receive_until(lambda event: event[0] == "BlockRemoved")
        removed = next(event for event in batches[-1].events if event[0] == "BlockRemoved")
        assert removed[0:1] == ["BlockRemoved"] and len(removed) == 3 and removed[2] == "GPU"
        assert set(removed[1]) <= set(expected_hashes(feed.engine, prompt))
        await feed.reset()
        assert (await feed.receive()).events == [["AllBlocksCleared"]]


async def test_salted_and_lora_blocks_carry_their_extra_keys() -> None:
    async with event_feed("map", models=("base", "adapter")) as feed:
        prompt = token_prompt(6, 40)
        await feed.complete(prompt, model="adapter", cache_salt="tenant-a")
        stored = (await feed.receive_until(lambda event: event["type"] == "BlockStored"))[-1].events[-1]
        assert stored["lora_name"] == "adapter" and stored["lora_id"] == 1
        assert stored["extra_keys"] == [["adapter", "tenant-a"], ["adapter"]]
        await feed.complete(prompt, model="base", cache_salt="tenant-a")
        salted = (await feed.receive_until(lambda event: event["type"] == "BlockStored"))[-1].events[-1]
        assert salted["lora_name"] is None and salted["extra_keys"] == [["tenant-a"], None]
        assert set(salted["block_hashes"]).isdisjoint(stored["block_hashes"])


async def test_replay_returns_the_missed_range_then_the_end_marker() -> None:
    async with event_feed("map") as feed:
        seen: list[Batch] = []
        for seed in range(4):
            await feed.complete(token_prompt(20 + seed, 33))
            seen += await feed.receive_until(lambda event: event["type"] == "BlockStored")
        start = seen[1].seq
        dealer = feed.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(feed.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replayed: list[tuple[int, bytes]] = []
            while True:
                empty, seq_bytes, payload = await asyncio.wait_for(dealer.recv_multipart(), RECEIVE_TIMEOUT_S)
                assert empty == b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    assert payload == b""
                    break
                replayed.append((seq, payload))
        finally:
            dealer.close(linger=0)
        # Everything from ``start`` on, byte for byte what the subscriber got.
        assert replayed[: len(seen) - 1] == [(batch.seq, batch.payload) for batch in seen[1:]]
        assert [seq for seq, _ in replayed] == list(range(start, start + len(replayed)))


async def test_events_bind_with_a_wildcard_endpoint() -> None:
    port = free_port()
    config = SimEngineConfig(port=0, time_scale=1000.0, kv_events_endpoint=f"tcp://*:{port}")
    app = build_app(config)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            for attempt in range(100):
                body = {"model": "sim", "prompt": token_prompt(attempt, 20), "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200
                with contextlib.suppress(asyncio.TimeoutError):
                    frames = await asyncio.wait_for(sub.recv_multipart(), 0.2)
                    break
            else:
                raise AssertionError("no KV event from the bound publisher")
        assert frames[0] == TOPIC and msgspec.msgpack.decode(frames[2])[1][0]["type"] == "BlockStored"
    finally:
        await runner.cleanup()
        sub.close(linger=0)
        context.term()
