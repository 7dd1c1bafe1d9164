"""Router replicas exchange their placements: a turn routed by one router is known to the other."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kvroute.router.routing.peer_exchange import RECEIVE_BATCH, ByteBudget, PeerExchange, Placement, decode, encode
from tests.servers import RouterServer

SYSTEM = "You are a careful assistant who answers questions about routing. " * 30


def test_a_placement_survives_the_wire() -> None:
    hashes = np.array([1, 2**64 - 1, 12345], dtype=np.uint64)
    for key in ("agent-7", None):
        placement = Placement("http://10.0.0.7:8000/serving", 32, hashes, 4000, key)
        back = decode(encode(placement))
        assert (back.backend, back.block_size, back.prompt_tokens, back.session_key) == (
            "http://10.0.0.7:8000/serving",
            32,
            4000,
            key,
        )
        assert back.hashes.dtype == np.uint64 and back.hashes.tolist() == hashes.tolist()


def _head(block_size: int, url: bytes, key: bytes = b"", url_length: int | None = None) -> bytes:
    length = len(url) if url_length is None else url_length
    return struct.pack("<IIHH", block_size, 100, length, len(key)) + url + key


@pytest.mark.parametrize(
    "frames",
    [
        [b"other-topic", _head(16, b"http://a"), b""],
        [b"kvroute-placements", b"\x10\x00", b""],  # head too short
        [b"kvroute-placements", _head(16, b"http://a"), b"1234567"],  # not whole hashes
        [b"kvroute-placements", _head(0, b"http://a"), b""],  # block size 0
        [b"kvroute-placements", _head(16, b"http://a", url_length=9), b""],  # lengths disagree
        [b"kvroute-placements", _head(16, b""), b""],  # no backend
        [b"kvroute-placements", _head(16, b"http://a", b"\xff\xfe"), b""],  # not UTF-8
        [b"kvroute-placements", _head(16, b"http://a")],  # a frame missing
    ],
)
def test_malformed_messages_are_refused(frames: list[bytes]) -> None:
    with pytest.raises(ValueError):
        decode(frames)


def test_the_byte_budget_refills_at_its_rate() -> None:
    now = [0.0]
    budget = ByteBudget(1000, clock=lambda: now[0])
    assert budget.take(600) and not budget.take(600)
    now[0] = 0.5  # 400 left + 500 refilled
    assert budget.take(600) and not budget.take(400)
    now[0] = 10.0  # refills to one second's worth, no more
    assert budget.take(1000) and not budget.take(1)


def _wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _pair(sim_engines: Any, router_server: Any, **options: Any) -> tuple[RouterServer, RouterServer]:
    """Two cache_aware routers over the same four engines, subscribed to each other."""
    engines = sim_engines(4)
    first = router_server(engines, policy="cache_aware", peer_bind="tcp://127.0.0.1:*", **options)
    first_endpoint = first.state.exchange.endpoint
    second = router_server(engines, policy="cache_aware", peer_bind="tcp://127.0.0.1:*", peers=[first_endpoint])
    second_endpoint = second.state.exchange.endpoint

    async def connect() -> None:
        first.state.exchange.connect([second_endpoint])

    first.loop.run(connect())
    time.sleep(0.3)  # ZMQ subscriptions take a moment to reach the publisher
    return first, second


def _ask(router: RouterServer, messages: list[dict[str, str]]) -> tuple[str, int, str]:
    raw = router.client().chat.completions.with_raw_response.create(model="sim", messages=messages, max_tokens=8)
    reply = raw.parse().choices[0].message.content or ""
    return raw.headers["x-kvroute-backend"], int(raw.headers["x-kvroute-matched-tokens"]), reply


def test_the_next_turn_through_the_other_router_finds_its_history(sim_engines: Any, router_server: Any) -> None:
    first, second = _pair(sim_engines, router_server)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do prefix caches work?"}]
    backend, matched, reply = _ask(first, conversation)
    assert matched == 0
    _wait_for(lambda: second.state.exchange.stats.received >= 1)

    conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And eviction?"}]
    next_backend, next_matched, _ = _ask(second, conversation)
    assert next_backend == backend
    assert next_matched >= 512  # the whole system prompt and first turn, in whole blocks
    assert first.state.exchange.stats.published >= 1 and second.state.exchange.stats.malformed == 0


def test_a_peer_backend_that_is_not_ours_stays_out(sim_engines: Any, router_server: Any) -> None:
    first, second = _pair(sim_engines, router_server)
    placement = Placement("http://127.0.0.1:9/not-ours", 16, np.arange(1, 9, dtype=np.uint64))

    async def publish() -> None:
        first.state.exchange.publish(placement)

    first.loop.run(publish())
    _wait_for(lambda: second.state.exchange.stats.received >= 1)
    assert "http://127.0.0.1:9/not-ours" not in second.state.routing.index_stats().blocks


def test_over_budget_placements_are_dropped_and_counted(sim_engines: Any, router_server: Any) -> None:
    first, _ = _pair(sim_engines, router_server, peer_max_bytes_per_s=64)
    _ask(first, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    assert first.state.exchange.stats.dropped_budget == 1 and first.state.exchange.stats.published == 0


def test_the_exchange_counts_on_metrics(sim_engines: Any, router_server: Any) -> None:
    first, second = _pair(sim_engines, router_server)
    _ask(first, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])
    _wait_for(lambda: second.state.exchange.stats.received >= 1)
    published = httpx.get(first.url + "/metrics").text
    received = httpx.get(second.url + "/metrics").text
    assert 'kvroute_peer_placements_total{event="published"} 1.0' in published
    assert 'kvroute_peer_placements_total{event="received"} 1.0' in received
    assert 'kvroute_peer_placements_total{event="dropped_budget"} 0.0' in received


#: Where a publisher binds, per transport: ZMQ over TCP, and Unix stream sockets (the workers').
TRANSPORTS = ["tcp", "unix"]


def _bind(transport: str, folder: Path) -> str:
    return "tcp://127.0.0.1:*" if transport == "tcp" else f"unix://{folder / 'placements.sock'}"


async def _connected_pair(received: list[Placement], bind: str) -> tuple[PeerExchange, PeerExchange]:
    """A publishing exchange and one subscribed to it, its handshake done."""
    publisher = PeerExchange(bind=bind, peers=[], apply=lambda _: None, max_bytes_per_s=1e9)
    await publisher.start()
    endpoint = publisher.endpoint
    assert endpoint is not None
    subscriber = PeerExchange(bind=None, peers=[endpoint], apply=received.append, max_bytes_per_s=1e9)
    assert await subscriber.start(wait_for=[endpoint])
    await asyncio.sleep(0.2)  # ZMQ: the subscription itself reaches the publisher after the handshake
    return publisher, subscriber


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_burst_of_placements_arrives_whole_and_in_order(transport: str, tmp_path: Path) -> None:
    """One event-loop turn's placements leave together; the reader takes more than one
    batch of them across turns, and the counts agree on both sides."""
    burst = 3 * RECEIVE_BATCH + 7

    async def scenario() -> None:
        received: list[Placement] = []
        publisher, subscriber = await _connected_pair(received, _bind(transport, tmp_path))
        try:
            for number in range(burst):
                publisher.publish(Placement("http://b", 16, np.array([number], dtype=np.uint64), number))
            assert publisher.stats.published == 0  # queued until the next turn
            await _until(lambda: len(received) == burst)
            assert [placement.prompt_tokens for placement in received] == list(range(burst))
            assert publisher.stats.published == subscriber.stats.received == burst
            publisher.publish(Placement("http://b", 16, np.array([7], dtype=np.uint64), 7, "late"))
            await _until(lambda: len(received) == burst + 1)  # the reader still listens after a burst
            assert received[-1].session_key == "late"
        finally:
            await publisher.stop()
            await subscriber.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stopping_sends_what_is_queued(transport: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        received: list[Placement] = []
        publisher, subscriber = await _connected_pair(received, _bind(transport, tmp_path))
        try:
            publisher.publish(Placement("http://b", 16, np.array([1, 2], dtype=np.uint64), 32, "last"))
            await publisher.stop()  # in the same turn as the publish
            await _until(lambda: len(received) == 1)
            assert received[0].session_key == "last" and publisher.stats.published == 1
        finally:
            await subscriber.stop()

    asyncio.run(scenario())


def test_one_router_follows_zmq_and_unix_peers_at_once(tmp_path: Path) -> None:
    """A worker subscribes to its siblings over Unix sockets and to other routers over ZMQ."""

    async def scenario() -> None:
        publishers = [
            PeerExchange(bind=_bind(transport, tmp_path), peers=[], apply=lambda _: None, max_bytes_per_s=1e9)
            for transport in TRANSPORTS
        ]
        for publisher in publishers:
            await publisher.start()
        endpoints = [publisher.endpoint for publisher in publishers]
        assert all(endpoints) and endpoints[1] == _bind("unix", tmp_path)
        received: list[Placement] = []
        subscriber = PeerExchange(bind=None, peers=endpoints, apply=received.append, max_bytes_per_s=1e9)
        try:
            assert await subscriber.start(wait_for=endpoints)
            await asyncio.sleep(0.2)  # ZMQ: the subscription reaches the publisher after the handshake
            for number, publisher in enumerate(publishers):
                publisher.publish(Placement("http://b", 16, np.array([number], dtype=np.uint64), number))
            await _until(lambda: len(received) == 2)
            assert sorted(placement.prompt_tokens for placement in received) == [0, 1]
            assert subscriber.stats.received == 2 and subscriber.stats.malformed == 0
        finally:
            for exchange in (subscriber, *publishers):
                await exchange.stop()

    asyncio.run(scenario())
