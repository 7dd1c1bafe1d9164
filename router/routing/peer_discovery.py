"""Peer routers found by DNS: every address a name resolves to is a router to subscribe to.

A fixed ``--peers`` list fits a fixed set of routers. In Kubernetes the router replicas come
and go (rollouts, an autoscaler), so ``--peers-dns NAME:PORT`` names a headless Service over
the router pods instead: it resolves to every pod's IP. Each router resolves it every few
seconds, subscribes to the addresses that appeared (``tcp://ADDRESS:PORT``, the port of
their ``--peer-bind``) and drops the ones that left, skipping its own addresses (any address
this host can bind) and, for a dual-stack name, the IPv6 ones. A failed lookup keeps the
current peers: a DNS hiccup must not cut the exchange. A peer that is gone but still
resolves costs nothing but a reconnecting socket; its load reports expire on their own
(:mod:`kvroute.router.routing.peer_load`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from kvroute.router.dns_name import DnsName

log = logging.getLogger(__name__)

#: How often the name is resolved again: a new replica is heard from within this.
REFRESH_S = 5.0

Resolve = Callable[[str, int], Awaitable[list[str]]]


class Subscriptions(Protocol):
    """What discovery drives: the exchange's subscriptions to its peers' endpoints."""

    def connect(self, peers: Iterable[str]) -> None: ...

    def disconnect(self, peers: Iterable[str]) -> None: ...


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (IPv4 and IPv6), sorted, without repeats."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def is_local_address(address: str) -> bool:
    """Whether this host owns ``address``: only then can a socket bind it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def one_family(addresses: list[str]) -> list[str]:
    """The IPv4 addresses if there are any, else the IPv6 ones: a dual-stack Service gives
    each pod one of each, and subscribing to both would hear every placement twice."""
    ipv4 = [address for address in addresses if ":" not in address]
    return ipv4 or addresses


def peer_endpoint(address: str, port: int) -> str:
    """The ZMQ endpoint of a peer at ``address`` (IPv6 in brackets)."""
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


class PeerDiscovery:
    """Keeps ``subscriptions`` on every router ``name`` resolves to, but this one."""

    def __init__(
        self,
        name: DnsName,
        subscriptions: Subscriptions,
        *,
        refresh_s: float = REFRESH_S,
        resolve: Resolve = resolve_addresses,
        is_local: Callable[[str], bool] = is_local_address,
    ) -> None:
        self._name = name
        self._subscriptions = subscriptions
        self._refresh_s = refresh_s
        self._resolve = resolve
        self._is_local = is_local
        #: The endpoints subscribed to now.
        self.peers: frozenset[str] = frozenset()
        #: Lookups that answered, and that failed.
        self.lookups = 0
        self.failed_lookups = 0
        self._failing = False

    @property
    def name(self) -> DnsName:
        return self._name

    async def refresh(self) -> None:
        """Resolve once; subscribe to new peers, drop gone ones. A failed lookup changes nothing."""
        try:
            addresses = await self._resolve(self._name.host, self._name.port)
        except OSError as exc:
            self.failed_lookups += 1
            if not self._failing:
                log.warning("peers: cannot resolve %s (%s); keeping %d peer(s)", self._name, exc, len(self.peers))
            self._failing = True
            return
        self._failing = False
        self.lookups += 1
        remote = one_family([address for address in addresses if not self._is_local(address)])
        wanted = frozenset(peer_endpoint(address, self._name.port) for address in remote)
        joined, left = sorted(wanted - self.peers), sorted(self.peers - wanted)
        if left:
            self._subscriptions.disconnect(left)
        if joined:
            self._subscriptions.connect(joined)
        if joined or left:
            log.info("peers from %s: %d (joined %s, left %s)", self._name, len(wanted), joined, left)
        self.peers = wanted

    async def run(self) -> None:
        """Refresh every ``refresh_s`` until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self._refresh_s)
