"""CurveZMQ on the peer exchange: routers holding the fleet's secret hear each other; a
router with another secret, with none, or with the fleet's public key but not its secret
hears nothing and is not heard, and both sides count why."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvroute.router.peer_key import PeerKey
from kvroute.router.routing import zmq_handshakes
from kvroute.router.routing.peer_exchange import TOPIC, PeerExchange, Placement
from kvroute.router.routing.peer_load import BackendLoad
from kvroute.router.routing.zmq_handshakes import address
from tests.servers import until, wait_until

FLEET = PeerKey.from_text("fleet-secret-0123456789abcdefghijklmnop")
OTHER = PeerKey.from_text("another-fleet-0123456789abcdefghijklmn")


def _placement(number: int) -> Placement:
    return Placement("http://b", 16, np.array([number], dtype=np.uint64), 16)


async def _publish_until_heard(publisher: PeerExchange, received: list[Placement]) -> None:
    """Publish until the subscriber hears one: its subscription reaches the publisher some
    time after the handshake, and a PUB socket drops what it sends before that."""
    for number in range(200):
        publisher.publish(_placement(number))
        await asyncio.sleep(0.025)
        if received:
            return
    raise AssertionError("the subscriber heard nothing in 5 s")


async def _publisher(key: PeerKey | None, load: dict[str, BackendLoad] | None = None) -> PeerExchange:
    publisher = PeerExchange(
        bind="tcp://127.0.0.1:*",
        peers=[],
        apply=lambda _: None,
        max_bytes_per_s=1e9,
        own_load=load.copy if load is not None else None,
        key=key,
    )
    await publisher.start()
    return publisher


async def _restarted(endpoint: str, key: PeerKey | None) -> PeerExchange:
    """A publisher started again on the ``endpoint`` another one just left."""
    restarted = PeerExchange(bind=endpoint, peers=[], apply=lambda _: None, max_bytes_per_s=1e9, key=key)
    for _ in range(100):  # ZMQ closes the old listener in its I/O thread, a moment later
        try:
            await restarted.start()
            break
        except zmq.ZMQError:
            await asyncio.sleep(0.02)
    assert restarted.endpoint == endpoint
    return restarted


def test_routers_holding_the_secret_exchange_placements_and_load() -> None:
    async def scenario() -> None:
        publisher = await _publisher(FLEET, {"http://b": BackendLoad(2, 64)})
        endpoint = publisher.endpoint
        assert endpoint is not None
        received: list[Placement] = []
        heard: dict[str, BackendLoad] = {}
        subscriber = PeerExchange(
            bind=None,
            peers=[endpoint],
            apply=received.append,
            max_bytes_per_s=1e9,
            apply_load=heard.__setitem__,
            key=FLEET,
        )
        try:
            assert await subscriber.start(wait_for=[endpoint])
            await _publish_until_heard(publisher, received)
            publisher.load_changed()
            await until(lambda: heard.get("http://b") == BackendLoad(2, 64))
            assert received[0].block_size == 16 and received[0].backend == "http://b"
            counts = subscriber.handshake_counts()
            assert counts["succeeded"] >= 1 and counts["failed_no_detail"] == counts["failed_protocol"] == 0
            assert publisher.handshake_counts()["refused"] == 0
        finally:
            await subscriber.stop()
            await publisher.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("publisher_key", "subscriber_key", "failure"),
    [
        (FLEET, OTHER, "failed_no_detail"),  # another secret: the publisher cannot read its hello
        (FLEET, None, "failed_protocol"),  # no secret against one: the mechanisms differ
        (None, FLEET, "failed_protocol"),
    ],
    ids=["another-secret", "plain-subscriber", "plain-publisher"],
)
def test_a_router_without_the_secret_hears_nothing(
    publisher_key: PeerKey | None, subscriber_key: PeerKey | None, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq_handshakes, "RETRY_S", 0.1)  # ZMQ gives up after a protocol error; the exchange does not

    async def scenario() -> None:
        publisher = await _publisher(publisher_key)
        endpoint = publisher.endpoint
        assert endpoint is not None
        received: list[Placement] = []
        subscriber = PeerExchange(
            bind=None, peers=[endpoint], apply=received.append, max_bytes_per_s=1e9, key=subscriber_key
        )
        try:
            assert not await subscriber.start(wait_for=[endpoint], timeout_s=0.5)
            for number in range(20):  # ZMQ retries the handshake meanwhile; none gets through
                publisher.publish(_placement(number))
                await asyncio.sleep(0.02)
            await until(lambda: subscriber.handshake_counts()[failure] >= 2)
            assert received == [] and subscriber.stats.received == 0
            assert subscriber.handshake_counts()["succeeded"] == 0
            assert subscriber.status()["peers"][endpoint].startswith("failed_")  # GET /admin/peers
        finally:
            await subscriber.stop()
            await publisher.stop()

    asyncio.run(scenario())


def test_the_fleets_public_key_alone_is_refused(caplog: Any) -> None:
    """A subscriber that learnt the fleet's public key (it is no secret) but holds another
    pair passes CURVE's check of the server and is refused by the publisher's handler."""

    async def scenario() -> None:
        publisher = await _publisher(FLEET)
        endpoint = publisher.endpoint
        assert endpoint is not None
        stranger_public, stranger_secret = zmq.curve_keypair()
        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        socket.curve_serverkey = FLEET.public
        socket.curve_publickey = stranger_public
        socket.curve_secretkey = stranger_secret
        socket.connect(endpoint)
        try:
            await until(lambda: publisher.handshake_counts()["refused"] >= 1)
            for number in range(10):
                publisher.publish(_placement(number))
                await asyncio.sleep(0.02)
            assert not await socket.poll(200)
        finally:
            socket.close(linger=0)
            await publisher.stop()

    asyncio.run(scenario())
    assert "refused a subscriber holding another key" in caplog.text


def test_a_peer_restarted_with_the_secret_is_heard_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZMQ gives up an endpoint after a protocol error for good; a router whose peer first
    ran without the secret hears it once it restarts with it, on the same endpoint."""
    monkeypatch.setattr(zmq_handshakes, "RETRY_S", 0.2)

    async def scenario() -> None:
        plain = await _publisher(None)
        endpoint = plain.endpoint
        assert endpoint is not None
        received: list[Placement] = []
        subscriber = PeerExchange(bind=None, peers=[endpoint], apply=received.append, max_bytes_per_s=1e9, key=FLEET)
        restarted: PeerExchange | None = None
        try:
            assert not await subscriber.start(wait_for=[endpoint], timeout_s=0.5)
            await until(lambda: subscriber.handshake_counts()["failed_protocol"] >= 1)
            await plain.stop()
            restarted = await _restarted(endpoint, FLEET)
            await until(lambda: subscriber.handshake_counts()["succeeded"] >= 1)
            await _publish_until_heard(restarted, received)
        finally:
            await subscriber.stop()
            for publisher in (plain, restarted):
                if publisher is not None:
                    await publisher.stop()

    asyncio.run(scenario())


#: The three rollouts that change the fleet's secret from FLEET to OTHER: a router of one
#: rollout and one of the next run side by side while it rolls.
ROTATION = [(FLEET, None), (FLEET, OTHER), (OTHER, FLEET), (OTHER, None)]


@pytest.mark.parametrize("step", range(len(ROTATION) - 1), ids=["add", "swap", "drop"])
def test_routers_hear_each_other_at_every_step_of_a_secret_rotation(step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peer-accepted-secret-file``: add the new secret as the accepted one, swap the
    two, drop the old one; a router of each step and one of the next hear each other both
    ways (a subscriber refused with its first key tries the other)."""
    monkeypatch.setattr(zmq_handshakes, "RETRY_S", 0.2)

    async def scenario() -> None:
        routers: list[tuple[PeerExchange, list[Placement]]] = []
        try:
            for key, accepted in ROTATION[step : step + 2]:
                received: list[Placement] = []
                exchange = PeerExchange(
                    bind="tcp://127.0.0.1:*",
                    peers=[],
                    apply=received.append,
                    max_bytes_per_s=1e9,
                    key=key,
                    accepted_key=accepted,
                )
                await exchange.start()
                routers.append((exchange, received))
            (first, heard_by_first), (second, heard_by_second) = routers
            assert first.endpoint is not None and second.endpoint is not None
            first.connect([second.endpoint])
            second.connect([first.endpoint])
            await _publish_until_heard(first, heard_by_second)
            await _publish_until_heard(second, heard_by_first)
            # Only at the swap does each side hear the other with its second key.
            swapped = step == 1
            for (exchange, _), (_, accepted) in zip(routers, ROTATION[step : step + 2], strict=True):
                status = exchange.status()
                assert list(status["peers"].values()) == ["connected"]
                assert list(status["peer_keys"].values()) == (
                    [] if accepted is None else ["accepted" if swapped else "secret"]
                )
                counts = exchange.handshake_counts()
                assert counts["refused"] == 0 and (counts["accepted"] >= 1) == swapped
        finally:
            for exchange, _ in routers:
                await exchange.stop()

    asyncio.run(scenario())


def test_a_router_skipping_a_rotation_step_is_not_heard() -> None:
    """A router still on the old secret alone does not hear one that publishes with the
    new one (the rotation's second rollout starts once the first is done)."""

    async def scenario() -> None:
        swapped = await _publisher(OTHER)  # the "swap" step publishes with the new key...
        assert swapped.endpoint is not None
        received: list[Placement] = []
        old = PeerExchange(bind=None, peers=[swapped.endpoint], apply=received.append, max_bytes_per_s=1e9, key=FLEET)
        try:
            assert not await old.start(wait_for=[swapped.endpoint], timeout_s=0.5)
            assert old.handshake_counts()["succeeded"] == 0
        finally:
            await old.stop()
            await swapped.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize("key", [FLEET, None], ids=["curve", "plain"])
def test_a_peer_named_by_host_name_is_followed_under_its_name(key: PeerKey | None) -> None:
    """ZMQ's monitor names a peer connected as ``tcp://localhost:PORT`` by the address it
    resolved; its state, the workers' wait and /admin/peers follow the name all the same."""

    async def scenario() -> None:
        publisher = await _publisher(key)
        endpoint = publisher.endpoint
        assert endpoint is not None
        named = endpoint.replace("127.0.0.1", "localhost")
        received: list[Placement] = []
        subscriber = PeerExchange(bind=None, peers=[named], apply=received.append, max_bytes_per_s=1e9, key=key)
        try:
            assert await subscriber.start(wait_for=[named], timeout_s=5)
            await until(lambda: subscriber.status()["peers"] == {named: "connected"})
            await _publish_until_heard(publisher, received)
            await publisher.stop()
            await until(lambda: subscriber.status()["peers"] == {named: "disconnected"})
            publisher = await _restarted(endpoint, key)
            # ZMQ names the reconnection by the address it resolved.
            await until(lambda: subscriber.status()["peers"] == {named: "connected"})
            await _publish_until_heard(publisher, received)
        finally:
            await subscriber.stop()
            await publisher.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("reported", "plain"),
    [
        ("tcp://[::ffff:10.0.0.5]:5600", "tcp://10.0.0.5:5600"),
        ("tcp://10.0.0.5:5600", "tcp://10.0.0.5:5600"),
        ("tcp://[fd00::5]:5600", "tcp://[fd00::5]:5600"),
    ],
)
def test_monitor_endpoints_compare_in_one_form(reported: str, plain: str) -> None:
    assert address(reported) == plain


def test_two_routers_with_one_secret_file_share_a_conversation(
    sim_engines: Any, router_server: Any, tmp_path: Path
) -> None:
    """``--peer-secret-file`` end to end: the second router finds the first one's placement,
    and /metrics counts the handshake."""
    secret = tmp_path / "peer-secret"
    secret.write_text("fleet-secret-0123456789abcdefghijklmnop\n")  # FLEET's text
    engines = sim_engines(2)
    options = {"policy": "cache_aware", "peer_bind": "tcp://127.0.0.1:*", "peer_secret_file": secret}
    first = router_server(engines, **options)
    second = router_server(engines, peers=[first.state.exchange.endpoint], admin_token="t", **options)
    wait_until(lambda: second.state.exchange.handshake_counts()["succeeded"] >= 1)
    time.sleep(0.3)  # the subscription reaches the publisher after the handshake
    messages = [{"role": "system", "content": "You route requests with care. " * 40}, {"role": "user", "content": "hi"}]
    first.client().chat.completions.create(model="sim", messages=messages, max_tokens=4)
    wait_until(lambda: second.state.exchange.stats.received >= 1)
    assert second.state.routing.index_stats().blocks  # the placement entered the second router's index
    metrics = httpx.get(second.url + "/metrics").text
    assert 'kvroute_peer_handshakes_total{result="succeeded"} 1.0' in metrics
    assert 'kvroute_peer_handshakes_total{result="failed_protocol"} 0.0' in metrics
    status = httpx.get(second.url + "/admin/peers", headers={"Authorization": "Bearer t"}).json()
    exchange = status["exchange"]
    assert exchange["peers"] == {first.state.exchange.endpoint: "connected"} and status["discovery"] is None
    assert exchange["curve"] is True and exchange["public_key"] == FLEET.public.decode() != FLEET.secret.decode()
    assert exchange["placements"]["received"] >= 1 and exchange["handshakes"]["succeeded"] == 1
