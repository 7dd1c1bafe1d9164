"""Peers found by DNS: the name's form, the real resolver and local-address check, and a
router's exchange following the addresses as replicas join and leave, over real ZMQ sockets.

On one host every address is local, so the discovery test stands in for the cluster's DNS
(a resolver returning loopback addresses, each a different publishing router) and for the
own-address check; both real functions are tested on their own above it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from typing import Any

import httpx
import numpy as np
import pytest

from kvroute.router.config import ConfigError, load_settings
from kvroute.router.dns_name import DnsName
from kvroute.router.routing.peer_discovery import (
    PeerDiscovery,
    is_local_address,
    peer_endpoint,
    resolve_addresses,
)
from kvroute.router.routing.peer_exchange import PeerExchange, Placement
from tests.servers import until, wait_until


def test_the_name_and_port_are_parsed() -> None:
    assert DnsName.parse("kvroute-peers.ml.svc.cluster.local:5600") == DnsName(
        "kvroute-peers.ml.svc.cluster.local", 5600
    )
    assert DnsName.parse("[fd00::1]:5600") == DnsName("fd00::1", 5600)
    assert str(DnsName("peers", 5600)) == "peers:5600"


@pytest.mark.parametrize("value", ["peers", "peers:", ":5600", "peers:http", "peers:0", "peers:70000"])
def test_a_name_without_a_valid_port_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="NAME:PORT"):
        DnsName.parse(value)


def test_settings_check_the_name_at_start() -> None:
    assert load_settings({"peers_dns": "kvroute-peers:5600"}).peers_dns == "kvroute-peers:5600"
    with pytest.raises(ConfigError, match="peers_dns"):
        load_settings({"peers_dns": "kvroute-peers"})


def test_the_real_resolver_and_the_own_address_check() -> None:
    addresses = asyncio.run(resolve_addresses("localhost", 5600))
    assert "127.0.0.1" in addresses and addresses == sorted(set(addresses))
    assert is_local_address("127.0.0.1")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never a host's own address
    assert peer_endpoint("10.1.2.3", 5600) == "tcp://10.1.2.3:5600"
    assert peer_endpoint("fd00::7", 5600) == "tcp://[fd00::7]:5600"


def test_a_dual_stack_answer_gives_one_endpoint_per_pod() -> None:
    """Each pod of a dual-stack Service resolves to an IPv4 and an IPv6 address: one family
    is taken (IPv4 where there is any), or every placement would arrive twice."""
    subscribed: list[str] = []

    class Subscriptions:
        def connect(self, peers: Iterable[str]) -> None:
            subscribed.extend(peers)

        def disconnect(self, peers: Iterable[str]) -> None:
            raise AssertionError("nothing left")

    async def dual_stack(host: str, port: int) -> list[str]:
        return ["10.0.0.7", "10.0.0.8", "fd00::7", "fd00::8"]

    async def ipv6_only(host: str, port: int) -> list[str]:
        return ["fd00::7", "fd00::8"]

    for resolve, expected in (
        (dual_stack, ["tcp://10.0.0.7:5600", "tcp://10.0.0.8:5600"]),
        (ipv6_only, ["tcp://[fd00::7]:5600", "tcp://[fd00::8]:5600"]),
    ):
        subscribed.clear()
        discovery = PeerDiscovery(DnsName("peers", 5600), Subscriptions(), resolve=resolve, is_local=lambda _: False)
        asyncio.run(discovery.refresh())
        assert subscribed == expected


def _free_port_on(addresses: list[str]) -> int:
    """A port free on every one of ``addresses`` (peers found by DNS share one port)."""
    while True:
        with socket.socket() as probe:
            probe.bind((addresses[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for address in addresses[1:]:
                with socket.socket() as other:
                    other.bind((address, port))
        except OSError:
            continue
        return port


def test_the_exchange_follows_the_name_as_routers_join_and_leave() -> None:
    """Two publishing routers on 127.0.0.2 and 127.0.0.3 (one port, as pods behind a headless
    Service); a third resolves the name to both and to its own address: it hears both and
    not itself; when one leaves the answer it stops hearing it; a failed lookup keeps both."""
    addresses = ["127.0.0.2", "127.0.0.3"]
    own = "127.0.0.4"
    port = _free_port_on([*addresses, own])
    answers: list[list[str]] = [[*addresses, own]]

    async def resolve(host: str, asked_port: int) -> list[str]:
        assert (host, asked_port) == ("kvroute-peers", port)
        if not answers[-1]:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return answers[-1]

    async def scenario() -> None:
        received: list[Placement] = []
        listener = PeerExchange(bind=f"tcp://{own}:{port}", peers=[], apply=received.append, max_bytes_per_s=1e9)
        publishers = [
            PeerExchange(bind=f"tcp://{address}:{port}", peers=[], apply=lambda _: None, max_bytes_per_s=1e9)
            for address in addresses
        ]
        publishers.append(listener)  # it publishes too, as every router does
        for publisher in publishers:
            await publisher.start()
        discovery = PeerDiscovery(DnsName("kvroute-peers", port), listener, resolve=resolve, is_local=own.__eq__)

        async def heard_from(number: int) -> bool:
            before = len(received)
            publishers[number].publish(Placement("http://b", 16, np.array([number], dtype=np.uint64), number))
            try:
                await until(lambda: len(received) > before, timeout=1.0)
            except AssertionError:
                return False
            return received[-1].prompt_tokens == number

        try:
            await discovery.refresh()
            assert discovery.peers == {f"tcp://127.0.0.2:{port}", f"tcp://127.0.0.3:{port}"}
            await asyncio.sleep(0.3)  # the subscriptions reach the publishers
            assert await heard_from(0) and await heard_from(1)
            assert not await heard_from(2)  # its own placements do not come back to it
            answers.append(["127.0.0.2", own])  # 127.0.0.3 left the Service
            await discovery.refresh()
            assert discovery.peers == {f"tcp://127.0.0.2:{port}"}
            await asyncio.sleep(0.3)
            assert await heard_from(0) and not await heard_from(1)
            answers.append([])  # DNS fails: the peers stay
            await discovery.refresh()
            assert discovery.peers == {f"tcp://127.0.0.2:{port}"} and await heard_from(0)
        finally:
            for publisher in publishers:
                await publisher.stop()

    asyncio.run(scenario())


def test_a_router_with_peers_dns_serves_and_stops(sim_engines: Any, router_server: Any) -> None:
    """Through the real application: the discovery runs beside the exchange (``localhost``
    resolves to this host's own addresses only, so it finds no peer), the router serves,
    and it stops with the discovery cancelled before the exchange (the fixture's teardown)."""
    (sim,) = sim_engines(1)
    router = router_server(
        [sim], policy="cache_aware", peer_bind="tcp://127.0.0.1:*", peers_dns="localhost:5600", admin_token="t"
    )
    discovery = router.state.peer_discovery
    assert router.state.exchange is not None and discovery is not None
    wait_until(lambda: discovery.lookups >= 1, timeout=5)
    assert discovery.peers == frozenset() and discovery.failed_lookups == 0
    reply = router.client().chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None
    status = httpx.get(router.url + "/admin/peers", headers={"Authorization": "Bearer t"}).json()
    assert status["discovery"]["name"] == "localhost:5600" and status["discovery"]["peers"] == []
    assert status["discovery"]["lookups"] >= 1 and status["exchange"]["peers"] == {}
