"""Which remembered conversation a full memo evicts: the one least likely to be back soon.

The conversation memo keeps one entry per long conversation, and a conversation comes back
after a gap of its own (the engine's answer, the agent's tools, the user's thinking). Least
recently used eviction is the worst order for that: while more conversations are active
than the memo holds, the one evicted is the one idle longest, which is the next to come
back, and every turn misses. So an entry is kept with when it was last used and the gap its
conversation last came back after, and the victim is, in this order:

1. an entry a later turn of its conversation superseded (that turn was built from it), the
   one superseded longest ago first: the latest is what a sibling of the newest turn (a
   regenerated answer, a retried branch) builds on again;
2. an entry overdue, idle more than :data:`OVERDUE_GAPS` times its gap (a conversation
   that ended), looked for from the least recently used;
3. the entry expected back last (last use + gap; a conversation whose gap is unknown, as a
   new one's, counts the typical gap), so the memo keeps serving the conversations it holds
   instead of trading each for the next.

A gap is learnt when a turn builds on its conversation's entry, and also when a turn looks
for an entry already evicted (the keys of evicted entries are kept a while, with their last
use): beyond the bound no entry may survive long enough to be built on. With every gap
unknown (no conversation seen coming back) it is least recently used. Measured in ``benchmarks/README.md`` ("Past the conversation memo's budget").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

#: An entry idle for more than this many of its gaps counts as a conversation that ended.
OVERDUE_GAPS = 3.0
#: Weight of a new gap in the typical gap (a running mean).
_GAP_WEIGHT = 0.05
#: Entries looked at, from the least recently used, for an overdue one.
_OVERDUE_SCAN = 64
#: Evicted keys kept with their last use, to learn gaps from: per entry held, and at least.
_GHOSTS_PER_ENTRY = 4
_MIN_GHOSTS = 1024


@dataclass(slots=True)
class _Use:
    last: float
    #: The time its conversation last came back after (None: not seen yet).
    gap: float | None


class ReturnOrder:
    """Keys of remembered entries with their last use and gap; :meth:`victim` says which to
    evict. Not thread-safe: the memo calls it under its lock."""

    def __init__(self) -> None:
        self._uses: OrderedDict[int, _Use] = OrderedDict()  # least recently used first
        self._superseded: OrderedDict[int, None] = OrderedDict()  # superseded longest ago first
        self._typical_gap: float | None = None
        self._ghosts: OrderedDict[int, float] = OrderedDict()  # evicted key -> its last use

    def __len__(self) -> int:
        return len(self._uses)

    def used(self, key: int, now: float, *, after: int | None = None) -> None:
        """``key`` was used at ``now``; ``after``: the key its conversation's turn before is
        under, which this one supersedes (the time since it was used is the gap)."""
        use = self._uses.pop(key, None)
        gap = use.gap if use is not None else None
        if after is not None and after != key and after in self._uses:
            gap = now - self._uses[after].last
            self._learn(gap)
            self._superseded.pop(after, None)
            self._superseded[after] = None
        self._uses[key] = _Use(now, gap)
        self._superseded.pop(key, None)

    def looked_up(self, keys: list[int], now: float) -> None:
        """A turn looked for these keys: where the first held or evicted one was evicted, its
        conversation came back after the time since that entry's last use."""
        for key in keys:
            if key in self._uses:
                return
            last = self._ghosts.pop(key, None)
            if last is not None:
                self._learn(now - last)
                return

    def evict(self, key: int) -> None:
        """``key``'s entries left the memo (its last use kept a while)."""
        use = self._uses.pop(key, None)
        self._superseded.pop(key, None)
        if use is not None:
            self._ghosts[key] = use.last
            while len(self._ghosts) > max(_MIN_GHOSTS, _GHOSTS_PER_ENTRY * len(self._uses)):
                self._ghosts.popitem(last=False)

    def clear(self) -> None:
        self._uses.clear()
        self._superseded.clear()
        self._ghosts.clear()

    def _learn(self, gap: float) -> None:
        typical = self._typical_gap
        self._typical_gap = gap if typical is None else typical + _GAP_WEIGHT * (gap - typical)

    def victim(self, now: float) -> int:
        """The key to evict (there is one)."""
        if self._superseded:
            return next(iter(self._superseded))
        first = next(iter(self._uses))
        typical = self._typical_gap
        if typical is None:
            return first
        for scanned, (key, use) in enumerate(self._uses.items()):
            if scanned == _OVERDUE_SCAN:
                break
            if now - use.last > OVERDUE_GAPS * (use.gap if use.gap is not None else typical):
                return key
        expected_back = {
            key: use.last + (use.gap if use.gap is not None else typical) for key, use in self._uses.items()
        }
        return max(expected_back, key=expected_back.__getitem__)
