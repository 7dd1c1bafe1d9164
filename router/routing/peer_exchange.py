"""Placements shared between router replicas, so that approximate routers agree on the index.

Production runs two or more routers behind a plain load balancer. In approximate mode each
one learns only from the requests it routed itself, so a conversation whose turns alternate
between routers looks cold to each of them half the time. Precise mode (KV events) solves
this with the engines' own events; without them, routers tell each other what they placed:

* every routing decision that put blocks in the index is published on a ZMQ PUB socket
  (``--peer-bind``) as one message: block size, backend URL, prompt length, session key
  (if any) and the prompt's chained block hashes (8 bytes a block);
* every router subscribes to its peers (``--peers``, or every address a DNS name resolves
  to, ``--peers-dns``: :mod:`kvroute.router.routing.peer_discovery`) and inserts what they
  placed into its own index, and into its conversation ledger, as if it had routed the
  request itself.

Routers that place blocks also send each other their requests in flight per backend
(:mod:`kvroute.router.routing.peer_load`), so that every router weighs the fleet's queues,
not only its own share of them, when it trades a cache hit against waiting.

No broker, no consensus: the same ZMQ machinery precise mode uses; with the fleet's
secret (``--peer-secret-file``) every ZMQ socket of it runs CurveZMQ
(:mod:`kvroute.router.routing.peer_auth`), and ZMQ endpoints a protocol error made ZMQ give
up are connected again (:mod:`kvroute.router.routing.zmq_handshakes`). Routers on one host
(the workers of ``kvroute serve --workers N``) may use ``unix://PATH`` endpoints instead:
the same messages over Unix stream sockets written and read in the event loop
(:mod:`kvroute.router.routing.unix_links`), ~18 against ~48 us of CPU per placement
over ZMQ's ``ipc://``. Bandwidth is bounded by a byte budget per second (token bucket); what exceeds
it, and what a slow peer cannot take (the PUB socket's high-water mark, a Unix reader's
byte limit), is dropped, never queued without bound. A dropped placement only costs a peer
one less-informed decision.

ZMQ's cost is per wake-up more than per message (its I/O threads, the event loop's
readiness callback), so the placements of one event-loop turn are sent together at the
start of the next, and a reader takes every message already queued each time it wakes,
through an :class:`~kvroute.router.routing.zmq_inbox.Inbox` (measured in
``benchmarks/README.md``, "Workers"). A placement is one message either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
import zmq
import zmq.asyncio

from kvroute.router.peer_key import PeerKey
from kvroute.router.routing.peer_auth import Gatekeeper
from kvroute.router.routing.peer_evidence import (
    EVIDENCE_HEAD,
    EVIDENCE_TOPIC,
    Answers,
    decode_evidence,
    encode_evidence,
)
from kvroute.router.routing.peer_load import (
    HEARTBEAT_S,
    LOAD_HEAD,
    LOAD_TOPIC,
    REPORT_INTERVAL_S,
    BackendLoad,
    LoadReport,
    PeerLoad,
    decode_report,
    encode_report,
    new_sender_id,
)
from kvroute.router.routing.peer_responses import (
    RESPONSES_HEAD,
    RESPONSES_TOPIC,
    decode_responses,
    encode_responses,
)
from kvroute.router.routing.unix_links import UnixPublisher, UnixSubscriber, frame, unix_path
from kvroute.router.routing.zmq_handshakes import Handshakes, HandshakeStats, tcp_host
from kvroute.router.routing.zmq_inbox import Inbox

log = logging.getLogger(__name__)

TOPIC = b"kvroute-placements"
_HEAD = struct.Struct("<IIHH")  # block size, prompt tokens, bytes of the backend URL, of the session key
#: Messages a slow subscriber may have queued before the PUB socket drops for it.
SEND_HWM = 10_000
#: Messages a reader takes in one wake-up before it lets the event loop run other work.
RECEIVE_BATCH = 256


@dataclass(frozen=True, slots=True)
class Placement:
    """Blocks one router placed on one backend: what a peer inserts into its index."""

    backend: str
    block_size: int
    hashes: np.ndarray  # uint64, the prompt's chained block hashes from its first block
    prompt_tokens: int = 0
    session_key: str | None = None


@dataclass(slots=True)
class MessageStats:
    """What every kind of peer message counts, in messages."""

    published: int = 0
    received: int = 0
    #: Messages not sent because the byte budget was spent.
    dropped_budget: int = 0
    #: Messages from peers that could not be decoded.
    malformed: int = 0


@dataclass(slots=True)
class ExchangeStats(MessageStats):
    """The placements' counters (``kvroute_peer_placements_total{event}``)."""

    #: Placements one ``unix://`` reader did not get: it was too far behind (ZMQ's peers
    #: drop at their high-water mark, uncounted).
    dropped_slow: int = 0


@dataclass(slots=True)
class LoadReportStats(MessageStats):
    """The load reports' counters (``kvroute_peer_load_reports_total{event}``); a report
    dropped for the budget is retried by the next change or heartbeat."""

    #: Peers forgotten because their reports stopped while they had requests in flight.
    expired: int = 0


#: The eviction evidence's counters (``kvroute_peer_evidence_total{event}``).
EvidenceStats = MessageStats
#: The stored responses' counters (``kvroute_peer_stored_responses_total{event}``).
StoredResponseStats = MessageStats


def encode(placement: Placement) -> list[bytes]:
    """The ZMQ frames of one placement: topic, head with the backend URL and session key, hash bytes."""
    url = placement.backend.encode()
    key = (placement.session_key or "").encode()
    head = _HEAD.pack(placement.block_size, placement.prompt_tokens, len(url), len(key)) + url + key
    return [TOPIC, head, np.ascontiguousarray(placement.hashes, dtype="<u8").tobytes()]


def zmq_frames(head: bytes, body: bytes) -> list[bytes]:
    """The ZMQ frames of one message as a Unix link carries it (``head``, ``body``): a load
    report under :data:`LOAD_TOPIC`, eviction evidence under
    :data:`~kvroute.router.routing.peer_evidence.EVIDENCE_TOPIC`, stored responses under
    :data:`~kvroute.router.routing.peer_responses.RESPONSES_TOPIC`, a placement under :data:`TOPIC`."""
    if head == LOAD_HEAD:
        return [LOAD_TOPIC, body]
    if head == EVIDENCE_HEAD:
        return [EVIDENCE_TOPIC, body]
    if head == RESPONSES_HEAD:
        return [RESPONSES_TOPIC, body]
    return [TOPIC, head, body]


class ZmqPublisher:
    """A PUB socket bound on ``endpoint``: plain, or with ``key`` a CURVE server admitting
    only holders of the key (:mod:`kvroute.router.routing.peer_auth`). ``tcp://*:PORT``
    listens on IPv6 and IPv4 where the host has both, ``tcp://[ADDRESS]:PORT`` on that IPv6
    address. Its sends never block and need no future; past :data:`SEND_HWM` messages
    queued for a peer, it drops for it."""

    def __init__(self, endpoint: str, key: PeerKey | None = None, accepted: PeerKey | None = None) -> None:
        self._gatekeeper = Gatekeeper(key, accepted) if key is not None else None
        socket = self._gatekeeper.publisher() if self._gatekeeper else zmq.Context.instance().socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        if _wants_ipv6(endpoint):  # not always: it names IPv4 binds in their mapped form
            socket.setsockopt(zmq.IPV6, 1)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError:
            socket.close(linger=0)
            if self._gatekeeper is not None:
                self._gatekeeper.close()
            raise
        self._socket: zmq.Socket[bytes] | None = socket

    @property
    def endpoint(self) -> str | None:
        """Where it listens (with the port the OS chose for ``tcp://host:*``)."""
        return None if self._socket is None else self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def refused(self) -> int:
        """Subscribers its CURVE handler refused (they proved another key)."""
        return 0 if self._gatekeeper is None else self._gatekeeper.refused

    def send(self, frames: Sequence[bytes]) -> None:
        """One message to every subscriber that can take it now (closed: nothing)."""
        if self._socket is None:
            return
        with contextlib.suppress(zmq.Again):  # a peer at its high-water mark: PUB drops for it
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._gatekeeper is not None:
            self._gatekeeper.close()
            self._gatekeeper = None


def _wants_ipv6(endpoint: str) -> bool:
    """Whether a ``tcp://`` endpoint binds every address (``*``) or an IPv6 one (``[...]``)."""
    host = tcp_host(endpoint)
    return endpoint.startswith("tcp://") and (host == "*" or host.startswith("["))


_Message = TypeVar("_Message")


def _decoded(data: bytes, decode: Callable[[bytes], _Message], stats: MessageStats) -> _Message | None:
    """A peer's message decoded and counted received, or None counted malformed."""
    try:
        message = decode(data)
    except ValueError:
        stats.malformed += 1
        return None
    stats.received += 1
    return message


def decode(frames: Sequence[bytes]) -> Placement:
    """The inverse of :func:`encode`; ``ValueError`` on anything else."""
    if len(frames) != 3 or frames[0] != TOPIC:
        raise ValueError("not a placement message")
    return decode_parts(frames[1], frames[2])


def decode_parts(head: bytes, body: bytes) -> Placement:
    """A placement from its head and hash bytes (the last two frames of :func:`encode`)."""
    if len(head) < _HEAD.size or len(body) % 8:
        raise ValueError("truncated placement message")
    block_size, prompt_tokens, url_length, key_length = _HEAD.unpack_from(head)
    names = head[_HEAD.size :]
    if len(names) != url_length + key_length or block_size <= 0 or not url_length:
        raise ValueError("malformed placement head")
    try:
        url, key = names[:url_length].decode(), names[url_length:].decode()
    except UnicodeDecodeError as error:
        raise ValueError("malformed placement head") from error
    hashes = np.frombuffer(body, dtype="<u8").astype(np.uint64)
    return Placement(url, block_size, hashes, prompt_tokens, key or None)


class ByteBudget:
    """A token bucket in bytes: ``rate`` per second, bursts up to one second of it."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._clock = clock
        self._level = rate
        self._stamp = clock()

    def take(self, size: int) -> bool:
        now = self._clock()
        self._level = min(self._rate, self._level + (now - self._stamp) * self._rate)
        self._stamp = now
        if size > self._level:
            return False
        self._level -= size
        return True


class PeerExchange:
    """One router's side of the exchange: a PUB socket for its placements, SUBs for its peers'."""

    def __init__(
        self,
        *,
        bind: str | None,
        peers: Sequence[str],
        apply: Callable[[Placement], None],
        max_bytes_per_s: float,
        own_load: Callable[[], Mapping[str, BackendLoad]] | None = None,
        apply_load: Callable[[str, BackendLoad], None] | None = None,
        apply_evidence: Callable[[str, Answers], None] | None = None,
        apply_stored: Callable[[str, str], None] | None = None,
        key: PeerKey | None = None,
        accepted_key: PeerKey | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """``own_load()``: this router's own requests in flight per backend, reported to the
        peers when :meth:`load_changed` says they changed; ``apply_load(url, load)``: the
        peers' sum for ``url`` changed to ``load``; ``apply_evidence(url, answers)``: a peer's
        answers about ``url`` (its model's eviction evidence; :meth:`answered` sends this
        router's only where it is given); ``apply_stored(response_id, url)``: a peer learned
        that ``url`` stores that Responses answer (:meth:`stored` sends this router's only
        where it is given); ``key``: the fleet's CURVE key pair
        (``--peer-secret-file``) for every ZMQ socket (None: plain ZMQ); ``accepted_key``:
        a second pair accepted as well while the secret is rotated (``peer_auth``)."""
        self._bind = bind
        self._peers = list(peers)
        self._apply = apply
        self._key = key
        self._accepted_key = accepted_key if key is not None else None
        self._budget = ByteBudget(max_bytes_per_s)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub: ZmqPublisher | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._handshakes: Handshakes | None = None
        self._unix_pub: UnixPublisher | None = None
        self._unix_sub: UnixSubscriber | None = None
        self._inbox: Inbox | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Frames of the placements published this event-loop turn, sent at the next.
        self._outbox: list[list[bytes]] = []
        self._flush_scheduled = False
        self._own_load = own_load
        self._apply_load = apply_load
        self._apply_evidence = apply_evidence
        #: What this router's answers said since its last evidence message, per backend.
        self._answers: dict[str, Answers] = {}
        self._apply_stored = apply_stored
        #: The stored responses this router learned since its last message: id -> backend.
        self._stored: dict[str, str] = {}
        self._peer_load = PeerLoad(new_sender_id())
        #: This router's counts changed since its last report.
        self._load_changed = False
        #: Its last report had requests in flight (so the heartbeat repeats it).
        self._load_reported = False
        #: When the last report left (event-loop time), and the timer of the next, if one waits.
        self._last_report = float("-inf")
        self._report_timer: asyncio.TimerHandle | None = None
        self._heartbeat: asyncio.TimerHandle | None = None
        self.stats = ExchangeStats()
        self.load_stats = LoadReportStats()
        self.evidence_stats = EvidenceStats()
        self.stored_stats = StoredResponseStats()

    @property
    def endpoint(self) -> str | None:
        """Where the PUB socket listens (with the port the OS chose for ``tcp://host:*``)."""
        if self._unix_pub is not None:
            return self._bind
        return None if self._pub is None else self._pub.endpoint

    async def start(self, *, wait_for: Sequence[str] = (), timeout_s: float = 10.0) -> bool:
        """Bind and subscribe. ``wait_for``: peers whose subscription must have completed
        its handshake before this returns (False after ``timeout_s``): a publisher sends
        nothing to a subscriber it has not heard from yet (ZMQ), or not yet taken (Unix),
        so what is published before that is lost to it. The workers of ``kvroute serve
        --workers N`` wait for their siblings so, before they report ready."""
        loop = self._loop = asyncio.get_running_loop()
        path = unix_path(self._bind) if self._bind is not None else None
        if path is not None:
            self._unix_pub = UnixPublisher(path)
            await self._unix_pub.start()
        elif self._bind is not None:
            self._pub = ZmqPublisher(self._bind, self._key, self._accepted_key)
        self._heartbeat = loop.call_later(HEARTBEAT_S, self._beat)
        deadline = loop.time() + timeout_s
        self.connect(self._peers)
        zmq_waits = {peer for peer in wait_for if unix_path(peer) is None}
        if zmq_waits and not await self._zmq_links().wait_for(zmq_waits, timeout_s):
            return False
        unix_waits = [path for path in map(unix_path, wait_for) if path is not None]
        if not unix_waits:
            return True
        assert self._unix_sub is not None  # wait_for names peers, which connect() joined
        return await self._unix_sub.wait_ready(unix_waits, max(0.0, deadline - loop.time()))

    def status(self) -> dict[str, Any]:
        """What ``GET /admin/peers`` shows of the exchange: where it publishes, whether it
        runs CURVE (and its public key, which is no secret), each peer and its state, the
        peers heard reporting load, and the counters."""
        peers = self._handshakes.states() if self._handshakes is not None else {}
        if self._unix_sub is not None:
            peers.update({f"unix://{path}": state for path, state in self._unix_sub.states().items()})
        return {
            "endpoint": self.endpoint,
            "curve": self._key is not None,
            "public_key": self._key.public.decode() if self._key is not None else None,
            "accepted_public_key": self._accepted_key.public.decode() if self._accepted_key is not None else None,
            "peers": peers,
            "peer_keys": self._handshakes.key_names() if self._handshakes is not None else {},
            "reporting_peers": self._peer_load.peers,
            "placements": asdict(self.stats),
            "load_reports": asdict(self.load_stats),
            "handshakes": self.handshake_counts(),
        }

    def handshake_counts(self) -> dict[str, int]:
        """The subscriber's handshakes with its ZMQ peers by outcome (``accepted``: those
        that succeeded with the second key), and the subscribers this router's publisher
        refused for holding another key."""
        counts = asdict(self._handshakes.stats) if self._handshakes is not None else asdict(HandshakeStats())
        counts["refused"] = self._pub.refused if self._pub is not None else 0
        return counts

    def connect(self, peers: Iterable[str]) -> None:
        """Subscribe to more peers (their ``--peer-bind`` endpoints)."""
        for peer in peers:
            path = unix_path(peer)
            if path is None:
                self._zmq_links().connect(peer)
                continue
            if self._unix_sub is None:
                self._unix_sub = UnixSubscriber(self._take_parts, self._count_malformed)
            self._unix_sub.connect([path])

    def disconnect(self, peers: Iterable[str]) -> None:
        """Stop subscribing to peers that left (ZMQ endpoints: peers found by DNS). Their
        load reports expire on their own; what they placed stays in the index."""
        for peer in peers:
            if unix_path(peer) is not None:
                raise ValueError(f"{peer}: Unix links are fixed for the router's life")
            self._zmq_links().disconnect(peer)

    def _zmq_links(self) -> Handshakes:
        """The SUB socket's connections (made with the first ZMQ peer)."""
        if self._handshakes is None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.IPV6, 1)  # peers found by DNS may have IPv6 addresses
            sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
            sub.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
            sub.setsockopt(zmq.SUBSCRIBE, EVIDENCE_TOPIC)
            sub.setsockopt(zmq.SUBSCRIBE, RESPONSES_TOPIC)
            self._sub = sub
            keys = [key for key in (self._key, self._accepted_key) if key is not None]
            self._handshakes = Handshakes(sub, keys)
            self._inbox = Inbox(sub, on_ready=self._receive)
        return self._handshakes

    async def stop(self) -> None:
        for timer in (self._heartbeat, self._report_timer):
            if timer is not None:
                timer.cancel()
        self._heartbeat = self._report_timer = None
        self._flush()  # a draining router's last placements and counts still reach its peers
        if self._inbox is not None:
            self._inbox.close()
        if self._handshakes is not None:
            self._handshakes.close()
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._pub is not None:
            self._pub.close()
        self._pub = self._sub = self._inbox = self._handshakes = None
        for link in (self._unix_pub, self._unix_sub):
            if link is not None:
                link.close()
        self._unix_pub = self._unix_sub = None

    def publish(self, placement: Placement) -> None:
        """Queue one placement for the peers, unless the byte budget is spent (then count it).

        It is sent with the rest of this event-loop turn's at the start of the next turn.
        """
        if self._pub is None and self._unix_pub is None:
            return
        frames = encode(placement)
        if not self._budget.take(sum(len(part) for part in frames)):
            self.stats.dropped_budget += 1
            return
        self._outbox.append(frames)
        self._schedule_flush()

    def answered(self, backend: str, evicted: bool) -> None:
        """An engine's answer checked this router's model of its cache (``evicted``: it had
        evicted part of what the model held): sent to the peers at the next event-loop turn
        with the others of this turn (:mod:`~kvroute.router.routing.peer_evidence`)."""
        if self._apply_evidence is None or (self._pub is None and self._unix_pub is None):
            return
        self._answers.setdefault(backend, Answers()).add(evicted)
        self._schedule_flush()

    def stored(self, response_id: str, backend: str) -> None:
        """This router learned that ``backend`` stores the Responses answer ``response_id``
        (it relayed it, or found it searching): sent to the peers at the next event-loop
        turn with the others of this turn (:mod:`~kvroute.router.routing.peer_responses`)."""
        if self._apply_stored is None or (self._pub is None and self._unix_pub is None):
            return
        self._stored[response_id] = backend
        self._schedule_flush()

    def load_changed(self, finished: bool = False) -> None:
        """This router's requests in flight changed: report them to the peers at the next
        turn, or, within :data:`REPORT_INTERVAL_S` of the last report, when it has passed.
        A request that ``finished`` is reported at the next turn regardless: peers still
        counting it would steer the client's next turn, often on its way already, away from
        a backend that is idle."""
        if self._own_load is None or (self._pub is None and self._unix_pub is None):
            return
        self._load_changed = True
        if finished and self._report_timer is not None:
            self._report_timer.cancel()
            self._report_timer = None
        if self._report_timer is not None:
            return  # a report is due soon anyway
        assert self._loop is not None
        wait = self._last_report + REPORT_INTERVAL_S - self._loop.time()
        if finished or wait <= 0:
            self._schedule_flush()
        else:
            self._report_timer = self._loop.call_later(wait, self._report_due)

    def _report_due(self) -> None:
        self._report_timer = None
        self._flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            assert self._loop is not None  # set by start(), which made the socket
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send this turn's placements and, if the counts changed, a load report."""
        self._flush_scheduled = False
        pub, outbox = self._pub, self._outbox
        self._outbox = []
        if pub is None and self._unix_pub is None:
            return  # stopped
        report = self._report() if self._load_changed and self._report_timer is None else None
        # The turn's other messages, each a (head, body) as a Unix link frames it.
        messages = [
            (head, body)
            for head, body in (
                (LOAD_HEAD, report),
                (EVIDENCE_HEAD, self._evidence()),
                (RESPONSES_HEAD, self._responses()),
            )
            if body is not None
        ]
        if self._unix_pub is not None and (outbox or messages):
            # One write per reader for the whole turn's messages.
            frames = [frame(parts[1], parts[2]) for parts in outbox]
            frames += [frame(head, body) for head, body in messages]
            behind = self._unix_pub.send(b"".join(frames))
            self.stats.dropped_slow += behind * len(outbox)
            self.stats.published += len(outbox)
        if pub is not None:
            for parts in outbox:
                pub.send(parts)
                self.stats.published += 1
            for head, body in messages:
                pub.send(zmq_frames(head, body))
        if report is not None:
            self.load_stats.published += 1

    def _evidence(self) -> bytes | None:
        """This turn's answers as one message, if any and the byte budget allows it (else
        they are dropped: the rates they would move are recent means, not totals)."""
        if not self._answers:
            return None
        body = encode_evidence(self._answers)
        self._answers = {}
        return self._within_budget(body, self.evidence_stats)

    def _responses(self) -> bytes | None:
        """This turn's stored responses as one message, if any and the byte budget allows it
        (else they are dropped: a peer then searches for them, one 404 per replica)."""
        if not self._stored:
            return None
        body = encode_responses(self._stored)
        self._stored = {}
        return self._within_budget(body, self.stored_stats)

    def _within_budget(self, body: bytes, stats: MessageStats) -> bytes | None:
        """``body`` counted published if the byte budget allows it now, else counted dropped."""
        if not self._budget.take(len(body)):
            stats.dropped_budget += 1
            return None
        stats.published += 1
        return body

    def _report(self) -> bytes | None:
        """This router's own counts as a report, if the byte budget allows it now."""
        assert self._own_load is not None  # load_changed() sets _load_changed only with it
        load = {url: counts for url, counts in self._own_load().items() if counts.in_flight or counts.work_tokens}
        payload = encode_report(LoadReport(self._peer_load.sender, load))
        if not self._budget.take(len(payload)):
            self.load_stats.dropped_budget += 1
            return None  # still changed: the next change or heartbeat sends it
        self._load_changed = False
        self._load_reported = bool(load)
        assert self._loop is not None
        self._last_report = self._loop.time()
        return payload

    def _beat(self) -> None:
        """Repeat a report with requests in flight (peers forget a silent router); forget silent peers."""
        assert self._loop is not None
        self._heartbeat = self._loop.call_later(HEARTBEAT_S, self._beat)
        if self._load_reported or self._load_changed:  # the latter: a report the budget refused
            self.load_changed()
        changed, forgotten = self._peer_load.expire()
        self.load_stats.expired += forgotten
        # Every sum again, not only the changed: a backend that joined the pool since starts at 0.
        self._push_load(changed | self._peer_load.backends())

    def _receive(self) -> None:
        """Take the placements queued, up to :data:`RECEIVE_BATCH` per event-loop turn."""
        inbox = self._inbox
        if inbox is None:
            return
        for _ in range(RECEIVE_BATCH):
            frames = inbox.take()
            if frames is None:
                return
            self._take(frames)
        asyncio.get_running_loop().call_soon(self._receive)  # more queued: after other work

    def _take(self, frames: list[bytes]) -> None:
        if frames and frames[0] == LOAD_TOPIC:
            self._take_report(frames[1] if len(frames) == 2 else b"")
            return
        if frames and frames[0] == EVIDENCE_TOPIC:
            self._take_evidence(frames[1] if len(frames) == 2 else b"")
            return
        if frames and frames[0] == RESPONSES_TOPIC:
            self._take_responses(frames[1] if len(frames) == 2 else b"")
            return
        try:
            placement = decode(frames)
        except ValueError:
            self.stats.malformed += 1
            return
        self._apply_placement(placement)

    def _take_parts(self, head: bytes, body: bytes) -> None:
        if head == LOAD_HEAD:
            self._take_report(body)
            return
        if head == EVIDENCE_HEAD:
            self._take_evidence(body)
            return
        if head == RESPONSES_HEAD:
            self._take_responses(body)
            return
        try:
            placement = decode_parts(head, body)
        except ValueError:
            self.stats.malformed += 1
            return
        self._apply_placement(placement)

    def _count_malformed(self) -> None:
        self.stats.malformed += 1

    def _apply_placement(self, placement: Placement) -> None:
        self.stats.received += 1
        try:
            self._apply(placement)
        except Exception:  # one bad placement must not stop the exchange
            log.exception("applying a peer's placement on %s failed", placement.backend)

    def _take_report(self, data: bytes) -> None:
        report = _decoded(data, decode_report, self.load_stats)
        if report is not None:
            self._push_load(self._peer_load.apply(report))

    def _take_evidence(self, data: bytes) -> None:
        evidence = _decoded(data, decode_evidence, self.evidence_stats)
        if evidence is not None and self._apply_evidence is not None:
            for url, answers in evidence.items():
                self._apply_evidence(url, answers)

    def _take_responses(self, data: bytes) -> None:
        stored = _decoded(data, decode_responses, self.stored_stats)
        if stored is not None and self._apply_stored is not None:
            for response_id, url in stored.items():
                self._apply_stored(response_id, url)

    def _push_load(self, changed: set[str]) -> None:
        if self._apply_load is None:
            return
        for url in changed:
            self._apply_load(url, self._peer_load.total(url))
