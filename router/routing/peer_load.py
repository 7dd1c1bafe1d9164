"""Requests in flight that peer routers report, so each router weighs the whole fleet's load.

A router counts the requests it sent to each backend and has not seen finish; its
policies weigh that queue against cache hits. With two or more router replicas each sees
only its share: in a burst, both send to the backend that looks idle to each of them, and
a conversation leaves the replica that holds its history for one that only looks less
busy. Routers exchanging placements (:mod:`kvroute.router.routing.peer_exchange`) also
send a :class:`LoadReport` whenever their own counts change: at once when a request
finished, else at most one per :data:`REPORT_INTERVAL_S` (in the same write as placements
where they meet), and again every :data:`HEARTBEAT_S` while they have requests in flight. A report
holds the sender's own counts only, never what it heard from others, and replaces that
sender's previous one: a lost report is corrected by the next, and a sender that stopped
reporting (crashed, partitioned) is forgotten after :data:`REPORT_TTL_S`. A report also
lists, per backend, the first block each of those requests is computing (``computing``), so
a peer does not take the blocks they have yet to compute for blocks the engine evicted
(:mod:`kvroute.router.routing.computing`); routers from before that field refuse such
reports (counted as malformed), so a fleet's routers are upgraded together.

:class:`PeerLoad` keeps the latest report of each peer and their sums per backend.
No I/O: the exchange feeds it and pushes the sums into the backend pool.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import orjson

#: The topic of load reports on the ZMQ exchange (placements travel under another one).
LOAD_TOPIC = b"kvroute-load"
#: The head of a load report on a ``unix://`` link (never a valid placement head).
LOAD_HEAD = b"kvroute-load/1"
#: Reports of new requests leave at most this often: a burst's first at once, the rest
#: together after it (a finished request is reported at once). A report per change cost two workers 12 % more CPU per request at 250/s
#: (benchmarks/README.md, "Routers report their load to each other").
REPORT_INTERVAL_S = 0.01
#: A router with requests in flight repeats its report this often.
HEARTBEAT_S = 1.0
#: A peer's report counts for this long after it arrived (three missed heartbeats).
REPORT_TTL_S = 3.0
#: Largest accepted report: a few hundred backends' counts.
MAX_REPORT_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """Requests in flight on one backend, the work they bring, in tokens, and the first
    block each is computing, as ``(position, hash)``."""

    in_flight: int = 0
    work_tokens: int = 0
    computing: tuple[tuple[int, int], ...] = ()


NO_LOAD = BackendLoad()


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One router's own requests in flight, per backend; backends left out have none."""

    sender: str
    load: Mapping[str, BackendLoad]


def new_sender_id() -> str:
    """An identity for this router process's reports (a restarted router is a new sender)."""
    return os.urandom(8).hex()


def encode_report(report: LoadReport) -> bytes:
    counts = {url: [load.in_flight, load.work_tokens] for url, load in report.load.items()}
    message: dict[str, Any] = {"sender": report.sender, "load": counts}
    computing = {url: load.computing for url, load in report.load.items() if load.computing}
    if computing:
        message["computing"] = computing
    return orjson.dumps(message)


def decode_report(data: bytes) -> LoadReport:
    """The inverse of :func:`encode_report`; ``ValueError`` on anything else."""
    message = decode_object(data, MAX_REPORT_BYTES, "load report")
    if not {"sender", "load"} <= set(message) <= {"sender", "load", "computing"}:
        raise ValueError("not a load report")
    sender, counts, computing = message["sender"], message["load"], message.get("computing", {})
    if not isinstance(sender, str) or not sender or not isinstance(counts, dict) or not isinstance(computing, dict):
        raise ValueError("malformed load report")
    pairs = count_pairs(counts, "load report")
    if not computing.keys() <= pairs.keys():
        raise ValueError("malformed load report")
    load = {url: BackendLoad(*pair, _first_blocks(computing.get(url, ()))) for url, pair in pairs.items()}
    return LoadReport(sender, load)


def _first_blocks(entries: object) -> tuple[tuple[int, int], ...]:
    """A report's ``[[position, hash], ...]`` for one backend, checked."""
    if not isinstance(entries, (list, tuple)):
        raise ValueError("malformed load report")
    blocks = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 2:
            raise ValueError("malformed load report")
        position, block = entry
        if not _count(position) or type(block) is not int or not 0 <= block < 2**64:
            raise ValueError("malformed load report")
        blocks.append((position, block))
    return tuple(blocks)


def decode_object(data: bytes, max_bytes: int, name: str) -> dict[str, Any]:
    """A peer's message, a JSON object of at most ``max_bytes``; ``ValueError`` (naming the
    message, ``name``) for anything else."""
    if len(data) > max_bytes:
        raise ValueError(f"{name} too large")
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise ValueError(f"{name} is not JSON") from error
    if not isinstance(message, dict):
        raise ValueError(f"not a {name}")
    return message


def count_pairs(counts: Mapping[str, Any], name: str) -> dict[str, tuple[int, int]]:
    """``{url: [count, count]}`` as checked pairs of counts; ``ValueError`` for anything else."""
    pairs: dict[str, tuple[int, int]] = {}
    for url, pair in counts.items():
        if not url or not isinstance(pair, list) or len(pair) != 2 or not all(_count(value) for value in pair):
            raise ValueError(f"malformed {name}")
        pairs[url] = (pair[0], pair[1])
    return pairs


def _count(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**53


class PeerLoad:
    """The latest report of every peer, and their sums per backend."""

    def __init__(self, sender: str, clock: Callable[[], float] = time.monotonic) -> None:
        #: This router's own identity: its reports, should they come back, are not a peer's.
        self.sender = sender
        self._clock = clock
        self._reports: dict[str, tuple[float, Mapping[str, BackendLoad]]] = {}
        self._totals: dict[str, BackendLoad] = {}

    @property
    def peers(self) -> int:
        """Peers whose report counts now."""
        return len(self._reports)

    def backends(self) -> set[str]:
        """The backends some peer reports requests in flight on."""
        return set(self._totals)

    def total(self, url: str) -> BackendLoad:
        """What the peers last reported in flight on ``url``, summed."""
        return self._totals.get(url, NO_LOAD)

    def apply(self, report: LoadReport) -> set[str]:
        """Take ``report`` in place of its sender's previous one; the backends whose sums changed."""
        if report.sender == self.sender:
            return set()
        previous = self._reports.get(report.sender)
        self._reports[report.sender] = (self._clock(), report.load)
        return self._shift(previous[1] if previous else {}, report.load)

    def expire(self) -> tuple[set[str], int]:
        """Forget the peers not heard from within :data:`REPORT_TTL_S`: the backends whose
        sums changed, and how many of those peers had requests in flight (an idle peer
        reports nothing more until it has some; one with requests went silent)."""
        deadline = self._clock() - REPORT_TTL_S
        silent = [sender for sender, (received_at, _) in self._reports.items() if received_at < deadline]
        changed: set[str] = set()
        busy = 0
        for sender in silent:
            _, load = self._reports.pop(sender)
            busy += bool(load)
            changed |= self._shift(load, {})
        return changed, busy

    def _shift(self, old: Mapping[str, BackendLoad], new: Mapping[str, BackendLoad]) -> set[str]:
        changed = set()
        for url in old.keys() | new.keys():
            before, after = old.get(url, NO_LOAD), new.get(url, NO_LOAD)
            if before == after:
                continue
            total = self._totals.get(url, NO_LOAD)
            computing = total.computing
            if before.computing or after.computing:  # every report's, again: a few entries each
                computing = tuple(
                    chain.from_iterable(load[url].computing for _, load in self._reports.values() if url in load)
                )
            total = BackendLoad(
                total.in_flight + after.in_flight - before.in_flight,
                total.work_tokens + after.work_tokens - before.work_tokens,
                computing,
            )
            if total == NO_LOAD:
                self._totals.pop(url, None)
            else:
                self._totals[url] = total
            changed.add(url)
        return changed
