"""Router replicas exchange their placements: a turn routed by one router is known to the other."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvroute.router.routing import computing, peer_exchange, peer_load
from kvroute.router.routing.peer_evidence import EVIDENCE_TOPIC, Answers
from kvroute.router.routing.peer_exchange import RECEIVE_BATCH, ByteBudget, PeerExchange, Placement, decode, encode
from kvroute.router.routing.peer_load import LOAD_TOPIC, NO_LOAD, BackendLoad, LoadReport, encode_report
from kvroute.router.routing.peer_responses import RESPONSES_TOPIC
from kvroute.router.routing.routing_engine import RoutePlan
from tests.servers import RouterServer, until

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


def test_a_long_placement_reaches_the_peers_index_a_slice_per_loop_turn(
    sim_engines: Any, router_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvroute.router.routing import sliced_insert

    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    first, second = _pair(sim_engines, router_server)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do prefix caches work?"}]
    backend, _, reply = _ask(first, conversation)
    blocks = first.metrics().value("kvroute_index_blocks", backend=backend)
    assert blocks > 8 * 4
    _wait_for(lambda: second.metrics().value("kvroute_index_blocks", backend=backend) == blocks)
    conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And eviction?"}]
    next_backend, next_matched, _ = _ask(second, conversation)
    assert next_backend == backend and next_matched == blocks * 16


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
            await until(lambda: len(received) == burst)
            assert [placement.prompt_tokens for placement in received] == list(range(burst))
            assert publisher.stats.published == subscriber.stats.received == burst
            publisher.publish(Placement("http://b", 16, np.array([7], dtype=np.uint64), 7, "late"))
            await until(lambda: len(received) == burst + 1)  # the reader still listens after a burst
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
            await until(lambda: len(received) == 1)
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
            await until(lambda: len(received) == 2)
            assert sorted(placement.prompt_tokens for placement in received) == [0, 1]
            assert subscriber.stats.received == 2 and subscriber.stats.malformed == 0
        finally:
            for exchange in (subscriber, *publishers):
                await exchange.stop()

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def _linked(
    bind: str, publishing: dict[str, Any], hearing: dict[str, Any]
) -> AsyncIterator[tuple[PeerExchange, PeerExchange]]:
    """A router publishing on ``bind`` and one subscribed to it, with these further
    PeerExchange arguments each (both stopped on leaving)."""
    publisher = PeerExchange(bind=bind, peers=[], apply=lambda _: None, max_bytes_per_s=1e9, **publishing)
    await publisher.start()
    endpoint = publisher.endpoint
    assert endpoint is not None
    subscriber = PeerExchange(bind=None, peers=[endpoint], apply=lambda _: None, max_bytes_per_s=1e9, **hearing)
    try:
        assert await subscriber.start(wait_for=[endpoint])
        await asyncio.sleep(0.2)  # ZMQ: the subscription reaches the publisher after the handshake
        yield publisher, subscriber
    finally:
        await publisher.stop()
        await subscriber.stop()


@contextlib.asynccontextmanager
async def _reporting(
    bind: str, own: dict[str, BackendLoad]
) -> AsyncIterator[tuple[PeerExchange, PeerExchange, dict[str, BackendLoad]]]:
    """A router reporting ``own`` as its requests in flight, and one subscribed to it, with
    the sums it heard (both stopped on leaving)."""
    heard: dict[str, BackendLoad] = {}
    async with _linked(bind, {"own_load": own.copy}, {"apply_load": heard.__setitem__}) as (publisher, subscriber):
        yield publisher, subscriber, heard


async def _rogue_sends(subscriber: PeerExchange, frames: list[bytes], taken: Callable[[], bool]) -> None:
    """A plain ZMQ publisher the subscriber connects to sends it ``frames``; returns once
    ``taken()`` says the subscriber dealt with them."""
    rogue = zmq.asyncio.Context.instance().socket(zmq.PUB)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    subscriber.connect([f"tcp://127.0.0.1:{port}"])
    await asyncio.sleep(0.2)
    await rogue.send_multipart(frames)
    await until(taken)
    rogue.close(linger=0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_routers_requests_in_flight_reach_its_peers(transport: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        own: dict[str, BackendLoad] = {}
        async with _reporting(_bind(transport, tmp_path), own) as (publisher, subscriber, heard):
            own.update({"http://a": BackendLoad(1, 100), "http://b": NO_LOAD})
            publisher.load_changed()
            own["http://a"] = BackendLoad(2, 250, ((0, 2**63 + 5), (7, 12)))  # and the blocks they compute
            publisher.load_changed()  # the same turn: one report, with the counts at its end
            await until(lambda: heard.get("http://a") == BackendLoad(2, 250, ((0, 2**63 + 5), (7, 12))))
            assert publisher.load_stats.published == 1 and subscriber.load_stats.received == 1
            assert "http://b" not in heard  # nothing there, nothing to say
            own["http://a"] = NO_LOAD
            publisher.load_changed()
            await until(lambda: heard["http://a"] == NO_LOAD)
            assert subscriber.load_stats.malformed == 0 and subscriber.stats.received == 0

    asyncio.run(scenario())


def test_reports_repeat_while_requests_run_and_a_silent_peer_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_exchange, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(peer_load, "REPORT_TTL_S", 0.3)

    async def scenario() -> None:
        own = {"http://a": BackendLoad(1, 100)}
        async with _reporting(_bind("unix", tmp_path), own) as (publisher, subscriber, heard):
            publisher.load_changed()
            await until(lambda: subscriber.load_stats.received >= 3)  # no change, still reported
            own["http://a"] = NO_LOAD
            publisher.load_changed()
            await until(lambda: heard["http://a"] == NO_LOAD)
            published = publisher.load_stats.published
            await asyncio.sleep(0.3)
            assert publisher.load_stats.published == published  # nothing in flight: quiet
            # A peer that stops talking with requests in flight (crashed) is forgotten.
            silent = zmq.asyncio.Context.instance().socket(zmq.PUB)
            port = silent.bind_to_random_port("tcp://127.0.0.1")
            subscriber.connect([f"tcp://127.0.0.1:{port}"])
            await asyncio.sleep(0.2)
            await silent.send_multipart(
                [LOAD_TOPIC, encode_report(LoadReport("gone", {"http://a": BackendLoad(4, 1)}))]
            )
            await silent.send_multipart([LOAD_TOPIC, b'{"sender": "gone"}'])
            await until(lambda: heard["http://a"] == BackendLoad(4, 1))
            silent.close(linger=0)
            await until(lambda: heard["http://a"] == NO_LOAD)
            assert subscriber.load_stats.expired == 1 and subscriber.load_stats.malformed == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_routers_eviction_evidence_reaches_its_peers(transport: str, tmp_path: Path) -> None:
    """One event-loop turn's answers leave as one message of counts per backend; a
    malformed one is counted and dropped."""

    async def scenario() -> None:
        heard: list[tuple[str, Answers]] = []
        publishing = {"apply_evidence": lambda url, answers: None}
        hearing = {"apply_evidence": lambda url, answers: heard.append((url, answers))}
        async with _linked(_bind(transport, tmp_path), publishing, hearing) as (publisher, subscriber):
            for evicted in (True, False, True):
                publisher.answered("http://a", evicted)
            publisher.answered("http://b", False)
            await until(lambda: len(heard) == 2)
            assert dict(heard) == {"http://a": Answers(3, 2), "http://b": Answers(1, 0)}
            publisher.answered("http://a", False)
            await until(lambda: len(heard) == 3)
            assert heard[-1] == ("http://a", Answers(1, 0))  # a delta: the next turn's answers only
            if transport == "tcp":
                malformed = [EVIDENCE_TOPIC, b'{"http://a": [1, 5]}']
                await _rogue_sends(subscriber, malformed, lambda: subscriber.evidence_stats.malformed == 1)
            assert len(heard) == 3 and subscriber.stats.received == 0
            assert (publisher.evidence_stats.published, subscriber.evidence_stats.received) == (2, 2)

    asyncio.run(scenario())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_where_responses_are_stored_reaches_the_peers(transport: str, tmp_path: Path) -> None:
    """One event-loop turn's stored responses leave as one message; a malformed one is
    counted and dropped."""

    async def scenario() -> None:
        heard: list[tuple[str, str]] = []
        publishing = {"apply_stored": lambda response_id, url: None}
        hearing = {"apply_stored": lambda response_id, url: heard.append((response_id, url))}
        async with _linked(_bind(transport, tmp_path), publishing, hearing) as (publisher, subscriber):
            publisher.stored("resp_1", "http://a")
            publisher.stored("resp_2", "http://b")
            await until(lambda: len(heard) == 2)
            publisher.stored("resp_3", "http://a")
            await until(lambda: len(heard) == 3)
            assert heard == [("resp_1", "http://a"), ("resp_2", "http://b"), ("resp_3", "http://a")]
            if transport == "tcp":
                malformed = [RESPONSES_TOPIC, b'{"resp_4": 5}']
                await _rogue_sends(subscriber, malformed, lambda: subscriber.stored_stats.malformed == 1)
            assert len(heard) == 3 and subscriber.stats.received == 0
            assert (publisher.stored_stats.published, subscriber.stored_stats.received) == (2, 2)

    asyncio.run(scenario())


def test_a_continuation_through_the_other_router_goes_home_without_a_search(
    response_stores: Any, router_server: Any
) -> None:
    """A Responses answer relayed by one router, and one it found by searching, are known
    to its peer: their continuations through the peer go straight to the replica storing
    them."""
    urls, asked = response_stores
    first = router_server(urls, policy="round_robin", peer_bind="tcp://127.0.0.1:*")
    second = router_server(urls, policy="round_robin", peers=[first.state.exchange.endpoint])
    time.sleep(0.3)  # ZMQ subscriptions take a moment to reach the publisher
    created = httpx.post(first.url + "/v1/responses", json={"model": "m", "input": "hi"}, timeout=30).json()["id"]
    searched = httpx.get(first.url + "/v1/responses/resp_c", timeout=30)
    assert searched.headers["x-kvroute-reason"] == "search"
    _wait_for(lambda: second.state.exchange.stored_stats.received >= 2)
    for response_id in (created, "resp_c"):
        asked.clear()
        body = {"model": "m", "input": "and?", "previous_response_id": response_id}
        continued = httpx.post(second.url + "/v1/responses", json=body, timeout=30)
        assert continued.headers["x-kvroute-reason"] == "stored_response", response_id
        assert len(asked) == 1 and response_id.startswith(f"resp_{asked[0][0]}")
    metrics = httpx.get(second.url + "/metrics").text
    assert 'kvroute_peer_stored_responses_total{event="received"}' in metrics


def test_peer_routers_weigh_each_others_eviction_evidence(sim_engines: Any, router_server: Any) -> None:
    """An answer one router checks moves the other's eviction rate for that backend too."""
    first, second = _pair(sim_engines, router_server)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do prefix caches work?"}]
    backend, _, reply = _ask(first, conversation)
    conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And eviction?"}]
    assert _ask(first, conversation)[0] == backend  # its model predicted the history: an answer checks it
    _wait_for(lambda: first.state.routing.cache_model.eviction_rate(backend) is not None)
    _wait_for(lambda: second.state.routing.cache_model.eviction_rate(backend) is not None)
    assert second.state.routing.cache_model.eviction_rate(backend) == 0.0  # the engine held it all
    assert second.state.exchange.evidence_stats.malformed == 0
    metrics = httpx.get(second.url + "/metrics").text
    assert 'kvroute_peer_evidence_total{event="received"}' in metrics


STORY = [{"role": "user", "content": "Tell me a long story. " * 20}]
CHAT_PATH = "/v1/chat/completions"


def test_peer_routers_see_each_others_requests_in_flight(sim_engines: Any, router_server: Any) -> None:
    engines = sim_engines(2, time_scale=1.0)
    first = router_server(engines, policy="cache_aware", peer_bind="tcp://127.0.0.1:*")
    second = router_server(engines, policy="cache_aware", peers=[first.state.exchange.endpoint])
    time.sleep(0.3)  # ZMQ subscriptions take a moment to reach the publisher
    stream = first.client().chat.completions.create(model="sim", messages=STORY, max_tokens=2000, stream=True)
    try:
        next(iter(stream))  # the request is running on one engine now
        busy = next(backend for backend in first.state.pool if backend.own_in_flight == 1)
        seen = second.state.pool.get(busy.url)
        assert seen is not None
        _wait_for(lambda: seen.peer_in_flight == 1)
        assert (seen.in_flight, seen.own_in_flight) == (1, 0) and seen.peer_in_flight_work_tokens > 0
        # The report also says which blocks that request computes: a request for the same
        # prompt through the second router counts none of its match as confirmed.
        time.sleep(computing.PEER_PLACEMENT_S)  # past what the placement alone would tell

        async def route() -> RoutePlan:  # on the router's loop, as its proxy would
            return second.state.routing.route(CHAT_PATH, {"model": "sim", "messages": STORY}, {}, [seen])

        plan = second.loop.run(route())
        assert plan.predicted_cached_tokens > 0 and plan.confirmed_cached_tokens == 0
        metrics = httpx.get(second.url + "/metrics").text
        assert 'kvroute_peer_load_reports_total{event="received"}' in metrics
        admin_state = second.state.pool.get(busy.url)
        assert admin_state is not None and admin_state.state().peer_in_flight == 1
    finally:
        stream.close()
    _wait_for(lambda: seen.in_flight == 0 and seen.peer_in_flight_work_tokens == 0)


def test_reports_within_the_interval_leave_together_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peer_exchange, "REPORT_INTERVAL_S", 0.3)

    async def scenario() -> None:
        own = {"http://a": BackendLoad(1, 100)}
        async with _reporting(_bind("unix", tmp_path), own) as (publisher, _subscriber, heard):
            publisher.load_changed()  # the first change leaves at once
            await until(lambda: heard.get("http://a") == BackendLoad(1, 100))
            for count in (2, 3):
                own["http://a"] = BackendLoad(count, 100 * count)
                publisher.load_changed()
                await asyncio.sleep(0.05)
            assert publisher.load_stats.published == 1 and heard["http://a"] == BackendLoad(1, 100)
            await until(lambda: heard["http://a"] == BackendLoad(3, 300))  # the interval passed: the latest
            assert publisher.load_stats.published == 2

    asyncio.run(scenario())


def test_a_finished_request_is_reported_at_once_even_within_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's next turn often follows its answer within milliseconds: a peer must not
    still count the finished request on its home backend."""
    monkeypatch.setattr(peer_exchange, "REPORT_INTERVAL_S", 10.0)

    async def scenario() -> None:
        own = {"http://a": BackendLoad(1, 100)}
        async with _reporting(_bind("unix", tmp_path), own) as (publisher, _, heard):
            publisher.load_changed()
            await until(lambda: heard.get("http://a") == BackendLoad(1, 100))
            own["http://a"] = BackendLoad(2, 200)
            publisher.load_changed()  # a new request: due in 10 s
            own["http://a"] = BackendLoad(1, 100)
            publisher.load_changed(finished=True)
            await until(lambda: publisher.load_stats.published == 2)
            await until(lambda: heard["http://a"] == BackendLoad(1, 100))

    asyncio.run(scenario())


def test_stopping_reports_the_last_counts_even_within_the_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_exchange, "REPORT_INTERVAL_S", 10.0)

    async def scenario() -> None:
        own = {"http://a": BackendLoad(1, 100)}
        async with _reporting(_bind("unix", tmp_path), own) as (publisher, _subscriber, heard):
            publisher.load_changed()
            await until(lambda: heard.get("http://a") == BackendLoad(1, 100))
            own["http://a"] = NO_LOAD
            publisher.load_changed()  # due in 10 s
            await publisher.stop()
            await until(lambda: heard["http://a"] == NO_LOAD)

    asyncio.run(scenario())


def test_the_heartbeat_hands_every_sum_on_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that joins the pool after a peer reported on it learns the peer's load within a beat."""
    monkeypatch.setattr(peer_exchange, "HEARTBEAT_S", 0.05)

    async def scenario() -> None:
        own = {"http://a": BackendLoad(2, 20)}
        async with _reporting(_bind("unix", tmp_path), own) as (publisher, _subscriber, heard):
            publisher.load_changed()
            await until(lambda: heard.get("http://a") == BackendLoad(2, 20))
            heard.clear()  # as a backend added since would start: knowing nothing
            await until(lambda: heard.get("http://a") == BackendLoad(2, 20))

    asyncio.run(scenario())


def _loopback_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _loopback_ipv6(), reason="no IPv6 loopback on this host")
def test_a_wildcard_bind_is_heard_over_ipv6_and_ipv4() -> None:
    """``tcp://*:PORT`` (the Helm chart's) serves IPv6-only and IPv4 clusters alike."""

    async def scenario() -> None:
        publisher = PeerExchange(bind="tcp://*:*", peers=[], apply=lambda _: None, max_bytes_per_s=1e9)
        await publisher.start()
        endpoint = publisher.endpoint
        assert endpoint is not None
        port = endpoint.rpartition(":")[2]
        peers = [f"tcp://[::1]:{port}", f"tcp://127.0.0.1:{port}"]
        received: list[Placement] = []
        subscriber = PeerExchange(bind=None, peers=peers, apply=received.append, max_bytes_per_s=1e9)
        try:
            assert await subscriber.start(wait_for=peers)
            await asyncio.sleep(0.2)  # the subscriptions reach the publisher after the handshakes
            publisher.publish(Placement("http://b", 16, np.array([1], dtype=np.uint64), 16))
            await until(lambda: len(received) == 2)  # once over each family
        finally:
            await subscriber.stop()
            await publisher.stop()

    asyncio.run(scenario())
