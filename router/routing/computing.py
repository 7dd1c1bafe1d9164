"""Blocks that requests in flight are still computing, this router's and its peers'.

The index holds a request's blocks on its backend from the moment it is routed, but the
engine holds them only once it has computed them: a request arriving meanwhile with the same
prefix finds less cached than the index says. Such a shortfall is not an eviction, and the
queue already counts the work that will compute those blocks, so the routing engine asks
here which part of a match is still being computed (:meth:`ComputingBlocks.tokens`).

Each request in flight is known by the first block it added: ``(position, hash)``. A match
that contains that block at its position is being computed from there on. Three sources:

* this router's own attempts, from routing until the proxy reports them back (or
  :data:`UNOBSERVED_TTL_S`, for an attempt never reported);
* peers' requests, as their load reports list them (``peer_load``): a report replaces its
  senders' previous entries, so they end when the peer's request does;
* a peer's placement just received, until the peer's report has had time to list it
  (:data:`PEER_PLACEMENT_S`): reports of new requests leave at most every
  ``peer_load.REPORT_INTERVAL_S``, placements at the next event-loop turn.

No I/O; the routing engine owns one.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

#: The first block a request added: its position in the prompt and its hash.
FirstNew = tuple[int, int]

#: An attempt the proxy never reported back on stops counting as computing after this.
UNOBSERVED_TTL_S = 900.0
#: A peer's placement counts as computing for this long after it arrived, until the peer's
#: load report lists it (it leaves within ``peer_load.REPORT_INTERVAL_S``, 10 ms).
PEER_PLACEMENT_S = 0.25


@dataclass(frozen=True, slots=True)
class _Started:
    """When an entry started counting, on which backend, from which block."""

    at: float
    backend: str
    first_new: FirstNew


class _Entries:
    """Entries per backend that expire in the order they were added, after ``ttl_s``."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._order: OrderedDict[int, _Started] = OrderedDict()
        #: Per backend (only those with entries) key -> first block.
        self.by_backend: dict[str, dict[int, FirstNew]] = {}

    def add(self, key: int, started: _Started) -> None:
        self._order[key] = started
        self.by_backend.setdefault(started.backend, {})[key] = started.first_new

    def remove(self, key: int) -> None:
        started = self._order.pop(key, None)
        if started is None:
            return
        entries = self.by_backend[started.backend]
        del entries[key]
        if not entries:
            del self.by_backend[started.backend]

    def expire(self, now: float) -> None:
        deadline = now - self._ttl_s
        order = self._order
        while order:
            key, started = next(iter(order.items()))
            if started.at >= deadline:
                return
            self.remove(key)

    def forget(self, backend: str) -> None:
        for key in [key for key, started in self._order.items() if started.backend == backend]:
            self.remove(key)


class ComputingBlocks:
    """Which blocks each backend is still computing for requests in flight (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._own = _Entries(UNOBSERVED_TTL_S)
        self._placed = _Entries(PEER_PLACEMENT_S)
        self._placed_keys = itertools.count()
        # Per backend what the peers' latest load reports list.
        self._reported: dict[str, Sequence[FirstNew]] = {}

    def start(self, serial: int, backend: str, first_new: FirstNew) -> None:
        """This router's attempt ``serial`` computes ``backend``'s blocks from ``first_new`` on."""
        now = self._clock()
        self._own.add(serial, _Started(now, backend, first_new))
        self._own.expire(now)

    def settle(self, serial: int) -> None:
        """Attempt ``serial`` finished (or was given up on)."""
        self._own.remove(serial)

    def placed_by_peer(self, backend: str, first_new: FirstNew) -> None:
        """A peer's placement just arrived: count it until the peer's report can list it."""
        now = self._clock()
        self._placed.add(next(self._placed_keys), _Started(now, backend, first_new))
        self._placed.expire(now)

    def reported_by_peers(self, backend: str, entries: Sequence[FirstNew]) -> None:
        """The peers' latest reports list ``entries`` in flight on ``backend`` (all of them)."""
        if entries:
            self._reported[backend] = entries
        else:
            self._reported.pop(backend, None)

    def own(self) -> dict[str, list[FirstNew]]:
        """This router's own entries per backend (what its load reports list)."""
        return {backend: list(entries.values()) for backend, entries in self._own.by_backend.items()}

    def tokens(self, matched: Mapping[str, int], block_size: int, hash_at: Callable[[int], int]) -> dict[str, int]:
        """Per backend, the tokens of its match (``matched``) that requests in flight there
        are computing; ``hash_at(position)`` is the prompt's block hash there."""
        if self._placed.by_backend:
            self._placed.expire(self._clock())
        own, placed, reported = self._own.by_backend, self._placed.by_backend, self._reported
        computing: dict[str, int] = {}
        for url, tokens in matched.items():
            mine, peers_placed, peers_reported = own.get(url), placed.get(url), reported.get(url)
            if not (mine or peers_placed or peers_reported):
                continue
            first = blocks = tokens // block_size
            for entries in (
                mine.values() if mine else (),
                peers_placed.values() if peers_placed else (),
                peers_reported or (),
            ):
                for position, block in entries:
                    if position < first and hash_at(position) == block:
                        first = position
            if first < blocks:
                computing[url] = (blocks - first) * block_size
        return computing

    def forget(self, backend: str) -> None:
        """``backend`` left the pool."""
        self._own.forget(backend)
        self._placed.forget(backend)
        self._reported.pop(backend, None)
