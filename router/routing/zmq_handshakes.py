"""A ZMQ socket's connections to its peers and their handshakes, read from its monitor.

ZMQ says nothing when a peer refuses it: a subscriber whose publisher holds another CURVE
key, or none, just never hears anything. The socket monitor reports every handshake; this
keeps the counts (``kvroute_peer_handshakes_total``), warns once per endpoint while its
handshakes fail, and lets a caller wait for given endpoints' first success (the workers
wait for their siblings before they report ready).

ZMQ retries a connection that failed, except after a protocol error (one side with CURVE,
the other without) or a refusal: it gives that endpoint up for good, so a router would
stay deaf to a peer that restarted with the right secret. Such an endpoint is connected
again every :data:`RETRY_S`.

With two key pairs (``--peer-accepted-secret-file``, while the fleet's secret is rotated),
an endpoint whose handshake fails is connected again with the other pair after
:data:`RETRY_S`: a peer may publish with either while the rollout runs.

The monitor names a peer connected by host name (``tcp://router-b:5600``) by the address
ZMQ resolved it to, so such names are resolved here too, and again whenever an event names
an address not known yet (a peer that moved): its events count for the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.router.peer_key import PeerKey
from kvroute.router.routing.peer_auth import secure_subscriber
from kvroute.router.routing.peer_discovery import peer_endpoint, resolve_addresses

log = logging.getLogger(__name__)

#: Seconds before an endpoint ZMQ gave up on (protocol error, refusal) is connected again.
RETRY_S = 5.0

#: What :meth:`Handshakes.states` says of an endpoint, by its last event.
CONNECTING, CONNECTED, DISCONNECTED = "connecting", "connected", "disconnected"


@dataclass(frozen=True, slots=True)
class _Failure:
    """A failed handshake: its :class:`HandshakeStats` field (and state), why, as a warning
    says it, and whether ZMQ gave the endpoint up (else it retries on its own)."""

    name: str
    why: str
    given_up: bool


_FAILURES: dict[int, _Failure] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: _Failure(
        "failed_no_detail", "the peer dropped it: does it hold the same --peer-secret-file?", given_up=False
    ),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: _Failure(
        "failed_protocol", "protocol error: one side has --peer-secret-file and the other not?", given_up=True
    ),
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: _Failure("failed_auth", "the peer refused this router's key", given_up=True),
}
_EVENTS = functools.reduce(operator.or_, _FAILURES, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)


@dataclass(slots=True)
class HandshakeStats:
    """Handshakes by outcome (``kvroute_peer_handshakes_total{result}``)."""

    succeeded: int = 0
    failed_no_detail: int = 0
    failed_protocol: int = 0
    failed_auth: int = 0
    #: Succeeded with the second (accepted) key pair.
    accepted: int = 0


class Handshakes:
    """Connects ``socket`` (through :meth:`connect`; with ``keys``, a CURVE client of
    publishers holding the first or, failing that, the next) and follows its monitor from
    the running loop until :meth:`close`."""

    def __init__(self, socket: zmq.asyncio.Socket, keys: Sequence[PeerKey] = ()) -> None:
        self._socket = socket
        self._keys = list(keys)
        #: Per endpoint (:func:`address` form), which of ``keys`` it is connected with.
        self._key_index: dict[str, int] = {}
        #: Per endpoint, its handshakes failed since its last success (with any key).
        self._misses: dict[str, int] = {}
        self._monitor = socket.get_monitor_socket(_EVENTS)
        self.stats = HandshakeStats()
        #: Endpoints (:func:`address` form) that completed a handshake at least once.
        self.succeeded: set[str] = set()
        #: What was connected, by :func:`address` form.
        self._endpoints: dict[str, str] = {}
        #: The addresses endpoints connected by host name resolved to -> that endpoint's key.
        self._aliases: dict[str, str] = {}
        self._resolving: asyncio.Task[None] | None = None
        #: The last state of each endpoint the monitor named (:func:`address` form), with the
        #: event's number: CONNECTED, DISCONNECTED (ZMQ reconnects) or a failed handshake's
        #: :class:`HandshakeStats` field name.
        self._states: dict[str, tuple[int, str]] = {}
        self._events = 0
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._follow(), name="kvroute-peer-handshakes")

    def connect(self, endpoint: str) -> None:
        key = address(endpoint)
        self._endpoints[key] = endpoint
        self._connect(key)
        if _by_name(key):
            self._resolve_names()

    def states(self) -> dict[str, str]:
        """Each endpoint connected (as given to :meth:`connect`) and its state: CONNECTING
        until its first handshake, then CONNECTED, DISCONNECTED or the last failure (for a
        host name, the latest of the addresses it resolved to)."""
        states = {}
        for key, endpoint in self._endpoints.items():
            named = [self._states[name] for name in self._names_of(key) if name in self._states]
            states[endpoint] = max(named)[1] if named else CONNECTING
        return states

    def key_names(self) -> dict[str, str]:
        """With two key pairs, which each endpoint is connected with: ``secret`` (the first)
        or ``accepted`` (the second); empty with one or none."""
        if len(self._keys) < 2:
            return {}
        return {
            endpoint: "accepted" if self._key_index.get(key, 0) else "secret"
            for key, endpoint in self._endpoints.items()
        }

    def disconnect(self, endpoint: str) -> None:
        """Stop connecting to ``endpoint`` (nothing if it was never connected)."""
        key = address(endpoint)
        for name in self._names_of(key):
            self._states.pop(name, None)
        self._endpoints.pop(key, None)
        self._key_index.pop(key, None)
        self._misses.pop(key, None)
        for alias in [alias for alias, owner in self._aliases.items() if owner == key]:
            del self._aliases[alias]
        retry = self._retries.pop(key, None)
        if retry is not None:
            retry.cancel()
        with contextlib.suppress(zmq.ZMQError):  # never connected, or ZMQ gave it up
            self._socket.disconnect(endpoint)

    async def wait_for(self, endpoints: Iterable[str], timeout_s: float) -> bool:
        """Whether every one of ``endpoints`` completed a handshake within ``timeout_s``."""
        waiting = {address(endpoint) for endpoint in endpoints}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not all(self._succeeded(key) for key in waiting):
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    def close(self) -> None:
        """Stop following and retrying (before the socket closes)."""
        self._task.cancel()
        if self._resolving is not None:
            self._resolving.cancel()
        for retry in self._retries.values():
            retry.cancel()
        self._retries.clear()
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._monitor.close(linger=0)

    async def _follow(self) -> None:
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except zmq.ZMQError:
                return  # closed
            self._record(event["event"], address(event["endpoint"].decode(errors="replace")))

    def _record(self, event: int, endpoint: str) -> None:
        stats = self.stats
        if endpoint not in self._endpoints and endpoint not in self._aliases:
            self._resolve_names()  # a name that moved, or one not resolved yet
        self._events += 1
        before = self._states.get(endpoint, (0, ""))[1]
        if event == zmq.EVENT_DISCONNECTED:
            if before == CONNECTED:
                self._states[endpoint] = (self._events, DISCONNECTED)
            return
        owner = self._owner(endpoint) or endpoint
        # One warning per peer until it works (ZMQ retries every ~100 ms), once every key failed.
        warn_after = max(1, len(self._keys))
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._states[endpoint] = (self._events, CONNECTED)
            stats.succeeded += 1
            stats.accepted += self._key_index.get(owner, 0) > 0
            self.succeeded.add(endpoint)
            if self._misses.pop(owner, 0) >= warn_after:
                log.info("peer exchange: handshake with %s succeeded", endpoint)
            self._changed.set()
            return
        failure = _FAILURES[event]
        setattr(stats, failure.name, getattr(stats, failure.name) + 1)
        self._states[endpoint] = (self._events, failure.name)
        if failure.given_up or len(self._keys) > 1:
            self._retry_later(endpoint)
        misses = self._misses[owner] = self._misses.get(owner, 0) + 1
        if misses == warn_after:
            log.warning("peer exchange: handshake with %s failed (%s)", endpoint, failure.why)

    def _retry_later(self, endpoint: str) -> None:
        """Connect again (with the next key, if there are two) what ZMQ gave up or refused:
        ``endpoint``, the host name it resolved from, or, when it is neither (a name not
        resolved here yet), every one connected by name."""
        owner = self._owner(endpoint)
        known = [owner] if owner is not None else [key for key in self._endpoints if _by_name(key)]
        for key in known:
            if key not in self._retries:
                self._retries[key] = self._loop.call_later(RETRY_S, self._retry, key)

    def _owner(self, endpoint: str) -> str | None:
        """The connected endpoint (:func:`address` form) the monitor means by ``endpoint``."""
        return endpoint if endpoint in self._endpoints else self._aliases.get(endpoint)

    def _connect(self, key: str) -> None:
        if self._keys:  # ZMQ takes the socket's CURVE options as they are at connect
            secure_subscriber(self._socket, self._keys[self._key_index.get(key, 0)])
        self._socket.connect(self._endpoints[key])

    def _names_of(self, key: str) -> list[str]:
        """``key`` and the addresses it resolved to: the names the monitor may use for it."""
        return [key, *(alias for alias, owner in self._aliases.items() if owner == key)]

    def _succeeded(self, key: str) -> bool:
        return any(name in self.succeeded for name in self._names_of(key))

    def _resolve_names(self) -> None:
        """Resolve every endpoint connected by host name, unless that is under way."""
        if not any(_by_name(key) for key in self._endpoints):
            return
        if self._resolving is None or self._resolving.done():
            self._resolving = self._loop.create_task(self._resolve(), name="kvroute-peer-names")

    async def _resolve(self) -> None:
        for key in [key for key in self._endpoints if _by_name(key)]:
            port = key.rpartition(":")[2]
            try:
                resolved = await resolve_addresses(tcp_host(key), int(port))
            except (OSError, ValueError) as exc:
                log.debug("peer exchange: cannot resolve %s: %r", key, exc)
                continue
            if key not in self._endpoints:
                continue  # disconnected meanwhile
            for alias in [alias for alias, owner in self._aliases.items() if owner == key]:
                del self._aliases[alias]
            for resolved_address in resolved:
                self._aliases[address(peer_endpoint(resolved_address, int(port)))] = key
        self._changed.set()  # a waiter's name may have succeeded under an address

    def _retry(self, key: str) -> None:
        self._retries.pop(key, None)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            return  # disconnected meanwhile
        if len(self._keys) > 1:
            self._key_index[key] = (self._key_index.get(key, 0) + 1) % len(self._keys)
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disconnect(endpoint)
        self._connect(key)


def address(endpoint: str) -> str:
    """``endpoint`` with an IPv4 address as an IPv6 socket names it (``[::ffff:10.0.0.5]``)
    written plainly (``10.0.0.5``): ZMQ's monitor reports reconnections so."""
    if "[::ffff:" not in endpoint:
        return endpoint
    scheme, _, rest = endpoint.partition("[::ffff:")
    host, _, port = rest.partition("]")
    return scheme + host + port


def tcp_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint as written (``*``, ``[fd00::5]``, a name)."""
    return endpoint.removeprefix("tcp://").rpartition(":")[0]


def _by_name(endpoint: str) -> bool:
    """Whether a ``tcp://`` endpoint names its host rather than an IP address."""
    host = tcp_host(endpoint)
    return not host.startswith("[") and not all(part.isdigit() for part in host.split("."))
