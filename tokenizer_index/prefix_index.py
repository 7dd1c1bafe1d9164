"""Which backend probably holds which prefix: a bounded index of chained block hashes.

Every backend holds a *set* of blocks, each named by its chained hash
(:mod:`tokenizer_index.hashing`), so a block stands for its whole prefix. A request's
longest cached prefix on a backend is the run of its leading blocks that backend holds.

Semantics (``tests/reference_index.py`` is the executable specification):

* **match** walks the request's blocks once, in chunks, keeping the set of backends that
  hold every block so far; it stops at the first block that no backend holds with all the
  blocks before it, and reports each backend the length of its run (only backends with a
  run of at least one block appear).
* **insert** touches the blocks from the tail to the head, so a sequence's head is more
  recent than its tail: block ``i`` of ``n`` gets tick ``base + n - 1 - i``. Least recently
  used eviction then drops a sequence's tail before its head, and a parent (touched with
  every child, after it) is never evicted while a child the same backend holds is kept.
* **capacity**: after an insert, a backend over its capacity loses its least recently used
  blocks until it fits (a sequence longer than the capacity keeps its head).
  ``on_evict(backend, hashes)`` hears of capacity and TTL evictions, oldest first.
* **TTL**: a block not touched for more than ``ttl_s`` seconds is dropped.
* **remove_blocks** drops exactly the given blocks. Their descendants stay but are
  *unreachable*: matching stops at a backend's first missing block, as an engine's lookup
  does. They age out as the oldest entries, or become reachable again if the missing
  block is inserted again (an engine that keeps a child block behaves the same way).

Layout (numpy, no per-block Python objects): one table of every held block, hash -> slot
with a bitmask of its holders (``8 + 8 * words`` bytes per slot, ``words = ceil(backends /
64)``), and per backend a table of block slot -> LRU tick (``4 + 4`` bytes per slot) plus
an append-only log of ticks (4 bytes per touch, compacted when full of stale entries).
Both tables are open addressing over 8-slot buckets (a lookup reads one cache line for
nearly every key; deletion leaves no tombstone) and are kept between 40 % and 60 % full.
Each bucket of 8 slots also has an occupancy byte and a 4-byte spill count (0.6 bytes per
slot). Per cached backend-block that is ``16.6 / 0.4 + 8.6 / 0.4 + 4..8 = 67..71`` bytes
at worst (no two backends share a block and both tables just grew) and 50-60 on average;
a block several backends hold costs its block-table slot once. ``stats().bytes`` is the exact
total; ``python -m benchmarks.bench_index`` measured about 60 bytes per backend-block at
1M blocks over 16 backends. Memory is bounded by the capacities; removing a backend frees
everything of it (its block table slots are reused; the table itself never shrinks).

Cost per call is a few dozen numpy passes over the request's blocks, mostly random reads
of the tables: the router hashes once and calls :meth:`PrefixIndex.match_hashes` and
:meth:`PrefixIndex.insert_hashes` with the same array, and the insert reuses the match's
lookups. A numpy call costs microseconds however short its input, so batches of up to
``_FEW_KEYS`` keys (an ordinary chat prompt) are looked up, added, removed and walked by
Python loops over the tables' memory instead (same tables, same answers); longer ones take
the vector path.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenizer_index.hashing import block_hashes

__all__ = ["IndexStats", "PrefixIndex"]

EvictCallback = Callable[[str, np.ndarray], None]
HashesAt = Callable[[np.ndarray], np.ndarray]  # block slots -> their hashes

_BUCKET = 8  # slots per bucket: 64 bytes of uint64 keys, one cache line
_MAX_LOAD = 0.6  # grow a table past this fill
_TARGET_LOAD = 0.4  # ... to this fill
# Per-process secret placement of keys into buckets (odd multipliers for multiply-shift).
_PLACEMENT_SALT = np.frombuffer(os.urandom(8), dtype=np.uint64)[0]
_PLACEMENT_MULTIPLIER = np.frombuffer(os.urandom(8), dtype=np.uint64)[0] | np.uint64(1)
_SHIFT32 = np.uint64(32)
_SHIFT56 = np.uint64(56)
_BYTE_INDEX = np.uint64(0x0001020304050607)
_BYTES_AS_WORD = np.dtype("<u8")
_NO_TICK = np.uint32(0xFFFFFFFF)
# Per occupancy byte of a bucket: its first free slot; and the bit of each slot.
_FIRST_FREE = np.array([((~bits) & (bits + 1)).bit_length() - 1 if bits != 0xFF else 0 for bits in range(256)], dtype=np.uint8)
_FIRST_FREE_LIST: list[int] = _FIRST_FREE.tolist()
_SLOT_BIT = np.array([1 << column for column in range(_BUCKET)], dtype=np.uint8)
_SLOT_CLEAR = ~_SLOT_BIT
_FIRST_CHUNK = 256  # blocks looked up before the match walk widens its chunks (x4 each)
# Up to this many keys, lookups and the match walk run as Python loops over lists: a numpy
# call costs microseconds whatever its length, and the vector forms take about twenty of them
# where a short prompt (an ordinary chat: 20-60 blocks) needs a few dozen list steps; the two
# cost about the same near 128 keys (measured on bench_index's workload at 1K and 2K tokens).
_FEW_KEYS = 96
_ALL_BITS = 0xFFFFFFFFFFFFFFFF
# Starting sizes; tables and logs grow as needed.
_INITIAL_BLOCK_BUCKETS = 64
_INITIAL_HOLDER_BUCKETS = 16
_INITIAL_LOG = 1024


@dataclass(frozen=True, slots=True)
class IndexStats:
    """Size of a :class:`PrefixIndex`."""

    #: Blocks held per backend (every registered backend, zeros included).
    blocks: dict[str, int]
    #: Distinct blocks held by at least one backend.
    unique_blocks: int
    #: Bytes of every array the index owns.
    bytes: int

    @property
    def backend_blocks(self) -> int:
        """Blocks summed over backends (a block two backends hold counts twice)."""
        return sum(self.blocks.values())

    @property
    def bytes_per_block(self) -> float:
        """Index memory per cached backend-block (0 when empty)."""
        total = self.backend_blocks
        return self.bytes / total if total else 0.0


# --- the hash table ------------------------------------------------------------------------


class _BucketSet:
    """A set of nonzero integer keys with stable slot numbers, for batches of keys.

    Open addressing over 8-slot buckets (64 bytes of uint64 keys: one cache line): a key
    lives in its home bucket, or if that was full when it came, in the next bucket with
    room. ``spills[b]`` counts the keys that passed bucket ``b`` that way, so a lookup reads
    one cache line for nearly every key and goes on only past buckets whose count is not
    zero. Deleting a key zeroes its slot and takes it off the counts it added: no
    tombstones, no periodic cleanup. One byte per bucket marks its occupied slots, so an
    insert finds its slot from that byte. Callers keep per-slot data in arrays of length
    :attr:`slots`. Keys are never duplicated in the table. A batch that adds one key twice
    (only possible with repeated hashes in one insert) counts it twice in ``count``, which
    only sizes the table (:meth:`live` is exact), and may leave a spill count one too high,
    which only costs a lookup one more bucket; the next rebuild makes both exact again.
    """

    __slots__ = (
        "keys", "flat", "occupied", "spills", "count", "_buckets", "_buckets_u64", "_flat_view", "_occupied_view",
        "_spills_view",
    )

    def __init__(self, buckets: int, dtype: type[np.unsignedinteger]) -> None:
        self.keys = np.zeros((buckets, _BUCKET), dtype=dtype)
        self.flat = self.keys.reshape(-1)
        self.occupied = np.zeros(buckets, dtype=np.uint8)  # bit j: slot j of the bucket
        self.spills = np.zeros(buckets, dtype=np.uint32)
        self.count = 0
        self._buckets = buckets
        self._buckets_u64 = np.uint64(buckets)
        # The same memory as Python sequences: one element read or written in tens of
        # nanoseconds, for the loops over a few keys (a numpy scalar access costs several times that).
        self._flat_view = memoryview(self.flat)
        self._occupied_view = memoryview(self.occupied)
        self._spills_view = memoryview(self.spills)

    @property
    def slots(self) -> int:
        return len(self.flat)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.occupied.nbytes + self.spills.nbytes

    def needs_room(self, incoming: int) -> bool:
        """Whether adding ``incoming`` keys would fill the table past its maximum load."""
        return self.count + incoming > _MAX_LOAD * self.slots

    def live(self) -> np.ndarray:
        """Slots holding a key."""
        return np.flatnonzero(self.flat)

    def find(self, keys: np.ndarray, spread: np.ndarray) -> np.ndarray:
        """Slot of each key (int64), -1 where absent."""
        if len(keys) <= _FEW_KEYS:
            return self._find_few(keys, spread)
        buckets = self._home(spread)
        found = self._find_in(buckets, keys)
        go_on = found < 0
        go_on &= self.spills[buckets] != 0
        pending = np.flatnonzero(go_on)
        buckets = buckets[pending]
        while len(pending):  # the few keys whose bucket overflowed: look in the next one
            buckets = self._next(buckets)
            further = self._find_in(buckets, keys[pending])
            found[pending] = further
            go_on = further < 0
            go_on &= self.spills[buckets] != 0
            pending, buckets = pending[go_on], buckets[go_on]
        return found

    def _find_few(self, keys: np.ndarray, spread: np.ndarray) -> np.ndarray:
        """:meth:`find` for a few keys: their home buckets read in one gather, then a list walk."""
        buckets = self._home(spread)
        rows = self.keys[buckets].tolist()
        found: list[int] = []
        append = found.append
        spills, flat, last = self._spills_view, self._flat_view, self._buckets - 1
        for key, bucket, row in zip(keys.tolist(), buckets.tolist(), rows):
            if key in row:
                append(bucket * _BUCKET + row.index(key))
                continue
            slot = -1
            while spills[bucket]:  # the key may have passed a full bucket
                bucket = bucket + 1 if bucket < last else 0
                start = bucket * _BUCKET
                row = flat[start : start + _BUCKET].tolist()
                if key in row:
                    slot = start + row.index(key)
                    break
            append(slot)
        return np.array(found, dtype=np.int64)

    def _find_in(self, buckets: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Slot of each key within its given bucket, -1 where not there."""
        rows = np.take(self.keys, buckets, axis=0)
        # One byte per slot, 1 where equal: read as a little-endian word, a hit in slot j
        # is 1 << 8j, and multiplying by 0x0001020304050607 brings j to the top byte.
        matches = (rows == keys[:, None]).view(_BYTES_AS_WORD)[:, 0]
        column = matches * _BYTE_INDEX
        column >>= _SHIFT56
        found = buckets * _BUCKET
        found += column.view(np.int64)
        found[matches == 0] = -1
        return found

    def add(self, keys: np.ndarray, spread: np.ndarray) -> np.ndarray:
        """Insert keys known to be absent (the table must have room); their slots."""
        if len(keys) <= _FEW_KEYS:
            return self._add_few(keys, spread)
        placed = np.empty(0, dtype=np.int64)
        pending: np.ndarray | None = None  # None: every key (most batches need one round)
        buckets = self._home(spread)
        while True:
            bits = self.occupied[buckets]
            columns = _FIRST_FREE[bits]
            targets = buckets * _BUCKET
            targets += columns
            wanted = keys if pending is None else keys[pending]
            # Every key claiming one bucket in a round takes its first free slot: one write
            # sticks (a bucket gains one key per round) and the others retry. The slot is
            # taken whoever won it, so every claimant may mark it.
            full = bits == 0xFF
            if full.any():  # these keys pass their full bucket and try the next one next round
                np.add.at(self.spills, buckets[full], 1)
                buckets[full] = self._next(buckets[full])
                claiming = ~full
                self.flat[targets[claiming]] = wanted[claiming]
                won = self.flat[targets] == wanted
                won &= claiming
                self.occupied[buckets[claiming]] |= _SLOT_BIT[columns[claiming]]
            else:
                self.flat[targets] = wanted
                won = self.flat[targets] == wanted
                self.occupied[buckets] |= _SLOT_BIT[columns]
            if pending is None:
                placed = targets  # losers' entries are written again when they win
            else:
                placed[pending] = targets
            self.count += int(np.count_nonzero(won))
            if won.all():
                return placed
            stay = ~won
            pending = np.flatnonzero(stay) if pending is None else pending[stay]
            buckets = buckets[stay]

    def _add_few(self, keys: np.ndarray, spread: np.ndarray) -> np.ndarray:
        """:meth:`add` for a few keys, one after another (a key repeated in the batch gets
        the slot of its first occurrence, so here ``count`` stays exact)."""
        flat, occupied, spills = self._flat_view, self._occupied_view, self._spills_view
        last = self._buckets - 1
        placed: list[int] = []
        first_slot: dict[int, int] = {}
        for key, bucket in zip(keys.tolist(), self._home(spread).tolist()):
            slot = first_slot.get(key)
            if slot is None:
                bits = occupied[bucket]
                while bits == 0xFF:  # full: the key passes this bucket and says so in its count
                    spills[bucket] += 1
                    bucket = bucket + 1 if bucket < last else 0
                    bits = occupied[bucket]
                column = _FIRST_FREE_LIST[bits]
                occupied[bucket] = bits | (1 << column)
                slot = first_slot[key] = bucket * _BUCKET + column
                flat[slot] = key
            placed.append(slot)
        self.count += len(first_slot)
        return np.array(placed, dtype=np.int64)

    def remove(self, slots: np.ndarray, spread: np.ndarray) -> None:
        """Empty these (distinct, occupied) slots; ``spread`` of their keys."""
        if len(slots) <= _FEW_KEYS:
            self._remove_few(slots, spread)
            return
        self.flat[slots] = 0
        buckets = slots >> 3
        np.bitwise_and.at(self.occupied, buckets, _SLOT_CLEAR[slots & 7])  # buckets repeat
        self.count -= len(slots)
        passing = self._home(spread)
        away = passing != buckets
        while away.any():  # a displaced key leaves the spill counts of the buckets it passed
            passing, buckets = passing[away], buckets[away]
            np.subtract.at(self.spills, passing, 1)
            passing = self._next(passing)
            away = passing != buckets

    def _remove_few(self, slots: np.ndarray, spread: np.ndarray) -> None:
        """:meth:`remove` for a few slots, one after another."""
        flat, occupied, spills = self._flat_view, self._occupied_view, self._spills_view
        last = self._buckets - 1
        for slot, passing in zip(slots.tolist(), self._home(spread).tolist()):
            flat[slot] = 0
            bucket = slot >> 3
            occupied[bucket] &= ~(1 << (slot & 7)) & 0xFF
            while passing != bucket:
                spills[passing] -= 1
                passing = passing + 1 if passing < last else 0
        self.count -= len(slots)

    def _home(self, spread: np.ndarray) -> np.ndarray:
        """Each key's home bucket: range reduction of its 32-bit spread."""
        home = spread * self._buckets_u64
        home >>= _SHIFT32
        return home.view(np.int64)

    def _next(self, buckets: np.ndarray) -> np.ndarray:
        following = buckets + 1
        following[following == self._buckets] = 0
        return following


def _spread(hashes: np.ndarray) -> np.ndarray:
    """A 32-bit placement value per hash (uint64), shared by every table's home buckets.

    Multiply-shift over the hash xor this process's secret salt: whoever can choose block
    hashes still cannot pile them into one bucket. Computed once per call and used by the
    block table and the backend tables (each reduces it to its own size).
    """
    mixed = np.bitwise_xor(hashes, _PLACEMENT_SALT)
    mixed *= _PLACEMENT_MULTIPLIER
    mixed >>= _SHIFT32
    return mixed


def _buckets_for(entries: int) -> int:
    return max(1, math.ceil(entries / (_BUCKET * _TARGET_LOAD)))


# --- every held block ----------------------------------------------------------------------


class _Blocks:
    """Every block some backend holds: its hash, slot, and a bitmask of its holders."""

    __slots__ = ("table", "owners", "on_relocate", "version")

    def __init__(self, on_relocate: Callable[[np.ndarray], None]) -> None:
        self.table = _BucketSet(_INITIAL_BLOCK_BUCKETS, np.uint64)
        self.owners = np.zeros((self.table.slots, 1), dtype=np.uint64)
        #: Called with old slot -> new slot (-1: dropped) whenever the table is rebuilt.
        self.on_relocate = on_relocate
        #: Changes whenever a block gets or loses its slot (so looked-up slots stay valid).
        self.version = 0

    @property
    def words(self) -> int:
        return self.owners.shape[1]

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.owners.nbytes

    def hashes_at(self, slots: np.ndarray) -> np.ndarray:
        return self.table.flat[slots]

    def find(self, hashes: np.ndarray, spread: np.ndarray) -> np.ndarray:
        return self.table.find(hashes, spread)

    def find_or_add(
        self, hashes: np.ndarray, spread: np.ndarray, known: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slots of these hashes, adding the missing ones with no holder yet; and which
        positions were added. ``known``: slots of a leading part, looked up at this version."""
        if known is None:
            slots = self.table.find(hashes, spread)
        elif len(known) == len(hashes):  # the router's case: the match looked up every block
            slots = known
        else:
            rest = len(known)
            slots = np.concatenate((known, self.table.find(hashes[rest:], spread[rest:])))
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            if self.table.needs_room(len(missing)):
                self._rebuild(_buckets_for(self.table.count + len(missing)))
                slots = self.table.find(hashes, spread)
            slots[missing] = self.table.add(hashes[missing], spread[missing])
            self.version += 1
        return slots, missing

    def release(self, slots: np.ndarray, spread: np.ndarray, word: int, bit: np.uint64) -> None:
        """Clear one holder's bit on these (distinct) slots; free those left with no holder."""
        column = self.owners[:, word]
        left = column[slots] & ~bit
        column[slots] = left
        orphaned = left == 0 if self.words == 1 else ~self.owners[slots].any(axis=1)
        if orphaned.any():
            self.table.remove(slots[orphaned], spread[orphaned])
            self.version += 1

    def add_word(self) -> None:
        """Room for 64 more holders."""
        self.owners = np.hstack((self.owners, np.zeros((len(self.owners), 1), dtype=np.uint64)))

    def _rebuild(self, buckets: int) -> None:
        """Re-place every block that has a holder into a table of ``buckets`` buckets."""
        held = np.flatnonzero(self.owners.any(axis=1))
        hashes = self.table.flat[held]
        table = _BucketSet(buckets, np.uint64)
        new_slots = table.add(hashes, _spread(hashes))
        owners = np.zeros((table.slots, self.words), dtype=np.uint64)
        owners[new_slots] = self.owners[held]
        relocation = np.full(self.table.slots, -1, dtype=np.int64)
        relocation[held] = new_slots
        self.table, self.owners = table, owners
        self.version += 1
        self.on_relocate(relocation)


# --- one backend ---------------------------------------------------------------------------


class _Holder:
    """One backend's blocks: a table of block slot -> LRU tick, and the log of ticks.

    A tick is an index into ``log``, which records the table slot touched at that tick.
    An entry is live while ``ticks[log[t]] == t``; touching a block again, removing it or
    reusing its slot leaves the old log entry stale. The oldest live entries are at the
    log's head, so eviction reads the log forward from ``head``. Compaction renumbers the
    live ticks ``0..count-1`` (so ticks fit in 32 bits forever).
    """

    __slots__ = (
        "name", "bit_index", "word", "bit", "capacity", "table", "ticks", "log", "head", "tail", "count", "stamps"
    )

    def __init__(self, name: str, bit_index: int, capacity: int | None) -> None:
        self.name = name
        self.bit_index = bit_index
        self.word, bit = divmod(bit_index, 64)
        self.bit = np.uint64(1 << bit)
        self.capacity = capacity
        self.table = _BucketSet(_INITIAL_HOLDER_BUCKETS, np.uint32)  # keys: block slot + 1
        self.ticks = np.full(self.table.slots, _NO_TICK, dtype=np.uint32)
        self.log = np.empty(_INITIAL_LOG, dtype=np.uint32)
        self.head = 0
        self.tail = 0
        self.count = 0
        #: TTL only: (first tick, time) of each touch, oldest first.
        self.stamps: deque[tuple[int, float]] = deque()

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.ticks.nbytes + self.log.nbytes

    @property
    def over_capacity(self) -> int:
        return 0 if self.capacity is None else max(0, self.count - self.capacity)

    def block_slots(self, slots: np.ndarray) -> np.ndarray:
        """Block slots of these table slots."""
        return self.table.flat[slots].astype(np.int64) - 1

    def find(self, block_slots: np.ndarray, spread: np.ndarray) -> np.ndarray:
        return self.table.find((block_slots + 1).astype(np.uint32), spread)

    def touch(self, block_slots: np.ndarray, spread: np.ndarray, new_blocks: np.ndarray, hashes_at: HashesAt) -> None:
        """Hold these blocks, head most recent. ``new_blocks``: positions of blocks that
        no backend held (so neither did this one: no lookup needed for them)."""
        keys = (block_slots + 1).astype(np.uint32)
        slots = self._find_known(keys, spread, new_blocks)
        missing = np.flatnonzero(slots < 0)
        if len(missing):
            if self.table.needs_room(len(missing)):
                self._rebuild(_buckets_for(self.count + len(missing)), hashes_at)
                slots = self._find_known(keys, spread, new_blocks)
            slots[missing] = self.table.add(keys[missing], spread[missing])
            was_missing = np.zeros(len(slots), dtype=bool)
            was_missing[missing] = True
            self._stamp_ticks(slots[::-1], was_missing[::-1])
        else:  # every block re-touched (a cached prompt): the count stays
            self._stamp_ticks(slots[::-1], None)

    def _find_known(self, keys: np.ndarray, spread: np.ndarray, new_blocks: np.ndarray) -> np.ndarray:
        if not len(new_blocks):
            return self.table.find(keys, spread)
        slots = np.full(len(keys), -1, dtype=np.int64)
        if len(new_blocks) < len(keys):
            known = np.ones(len(keys), dtype=bool)
            known[new_blocks] = False
            slots[known] = self.table.find(keys[known], spread[known])
        return slots

    def oldest(self, limit: int, below_tick: int | None = None) -> np.ndarray:
        """Pop up to ``limit`` live entries from the log's head (ticks < ``below_tick``)."""
        end = self.tail if below_tick is None else min(self.tail, below_tick)
        taken: list[np.ndarray] = []
        while limit > 0 and self.head < end:
            stop = min(end, self.head + max(2 * limit, 256))
            window = self.log[self.head : stop]
            live = np.flatnonzero(self.ticks[window] == np.arange(self.head, stop, dtype=np.uint32))
            if len(live) > limit:
                live = live[:limit]
                stop = self.head + int(live[-1]) + 1
            taken.append(window[live])
            limit -= len(live)
            self.head = stop
        return np.concatenate(taken).astype(np.int64) if taken else np.empty(0, dtype=np.int64)

    def drop(self, slots: np.ndarray, spread: np.ndarray) -> None:
        """Forget these (distinct, held) table slots; ``spread`` of their blocks."""
        self.table.remove(slots, spread)
        self.ticks[slots] = _NO_TICK
        self.count -= len(slots)

    def relocate_blocks(self, relocation: np.ndarray) -> None:
        """The block table was rebuilt: rewrite the block slots this table stores."""
        live = self.table.live()
        self.table.flat[live] = (relocation[self.table.flat[live].astype(np.int64) - 1] + 1).astype(np.uint32)

    def _stamp_ticks(self, touched: np.ndarray, was_missing: np.ndarray | None) -> None:
        """Give ``touched`` (tail first) the next ticks and log them; ``was_missing``: which
        of them were just added (None: none)."""
        n = len(touched)
        self._reserve_log(n)
        ticks = np.arange(self.tail, self.tail + n, dtype=np.uint32)
        self.ticks[touched] = ticks
        kept = self.ticks[touched] == ticks
        if not kept.all():
            # The same block twice in one batch: its occurrence nearest the head wins.
            np.maximum.at(self.ticks, touched, ticks)
            kept = self.ticks[touched] == ticks
        self.log[self.tail : self.tail + n] = touched
        self.tail += n
        if was_missing is not None:
            self.count += int(np.count_nonzero(kept & was_missing))

    def _reserve_log(self, n: int) -> None:
        if self.tail + n <= len(self.log):
            return
        self._compact()
        if self.tail + n > len(self.log):
            grown = np.empty(max(2 * len(self.log), self.tail + n), dtype=np.uint32)
            grown[: self.tail] = self.log[: self.tail]
            self.log = grown

    def _compact(self) -> np.ndarray:
        """Renumber live entries ``0..count-1`` in tick order; returns their table slots."""
        window = self.log[self.head : self.tail]
        alive = self.ticks[window] == np.arange(self.head, self.tail, dtype=np.uint32)
        live = window[alive]
        if self.stamps:
            self._renumber_stamps(alive)
        self.log[: len(live)] = live
        self.ticks[live] = np.arange(len(live), dtype=np.uint32)
        self.head, self.tail = 0, len(live)
        return live.astype(np.int64)

    def _renumber_stamps(self, alive: np.ndarray) -> None:
        before = np.concatenate(([0], np.cumsum(alive)))  # live entries before each old tick
        renumbered: deque[tuple[int, float]] = deque()
        for tick, stamp in self.stamps:
            new_tick = int(before[min(max(tick - self.head, 0), len(alive))])
            if renumbered and renumbered[-1][0] == new_tick:
                renumbered.pop()  # the older touch has nothing left of its own
            renumbered.append((new_tick, stamp))
        self.stamps = renumbered

    def _rebuild(self, buckets: int, hashes_at: HashesAt) -> None:
        """Re-place the live entries (in tick order) into a table of ``buckets`` buckets."""
        live = self._compact()
        keys = self.table.flat[live]
        table = _BucketSet(buckets, np.uint32)
        slots = table.add(keys, _spread(hashes_at(keys.astype(np.int64) - 1)))
        self.table = table
        self.ticks = np.full(table.slots, _NO_TICK, dtype=np.uint32)
        self.ticks[slots] = np.arange(len(slots), dtype=np.uint32)
        self.log[: len(slots)] = slots
        self.count = len(slots)


# --- the index -----------------------------------------------------------------------------


class PrefixIndex:
    """Per-backend sets of cached blocks with LRU capacity and TTL; longest-prefix matching.

    ``capacity_blocks`` applies to backends not given their own with :meth:`set_capacity`
    (None: unbounded). ``clock`` (seconds) drives the TTL. Backends are named by any
    string (the router uses their URLs); a backend is known from its first insert or
    :meth:`set_capacity` until :meth:`remove_backend`. Not thread-safe: one owner calls it.
    """

    def __init__(
        self,
        block_size: int = 16,
        capacity_blocks: int | None = None,
        ttl_s: float | None = None,
        on_evict: EvictCallback | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.on_evict = on_evict
        self._clock = clock
        self._blocks = _Blocks(self._relocate)
        self._holders: dict[str, _Holder] = {}
        self._by_bit: list[str | None] = []  # bit index -> backend name
        # The last match's lookups, reused by an insert of the same hashes right after it
        # (the router matches, picks a backend, then inserts the same prompt there).
        self._walked: _Walk | None = None

    # --- queries ---------------------------------------------------------------------------

    def match(self, tokens: Sequence[int] | np.ndarray, *, salt: str | None = None) -> dict[str, int]:
        """Leading tokens (whole blocks) each backend holds of ``tokens``; absent means 0."""
        return self.match_hashes(block_hashes(tokens, self.block_size, salt))

    def match_hashes(self, hashes: Sequence[int] | np.ndarray) -> dict[str, int]:
        """:meth:`match` on precomputed :func:`~tokenizer_index.hashing.block_hashes`."""
        keys = _as_keys(hashes)
        self._expire_all()
        if not len(keys) or not self._holders:
            return {}
        if len(keys) <= _FEW_KEYS and self._blocks.words == 1:
            return self._match_few(keys)
        owners = self._blocks.owners
        running = np.full(self._blocks.words, np.uint64(_ALL_BITS))
        matched: dict[str, int] = {}
        looked_up: list[np.ndarray] = []
        start, chunk = 0, _FIRST_CHUNK
        while start < len(keys) and running.any():
            end = min(len(keys), start + chunk)
            part = keys[start:end]
            slots = self._blocks.find(part, _spread(part))
            looked_up.append(slots)
            rows = owners[slots]
            rows[slots < 0] = 0
            rows[0] &= running
            # prefix[i]: the backends that hold every block up to start + i.
            prefix = np.bitwise_and.accumulate(rows, axis=0)
            for row in _shrinking_rows(prefix, running).tolist():
                previous = prefix[row - 1] if row else running
                self._record_lengths(previous & ~prefix[row], start + row, matched)
            running = prefix[-1]
            start, chunk = end, chunk * 4
        self._record_lengths(running, len(keys), matched)
        self._walked = _Walk(keys[:start].tobytes(), np.concatenate(looked_up), self._blocks.version)
        return matched

    def _match_few(self, keys: np.ndarray) -> dict[str, int]:
        """:meth:`match_hashes` of a few keys when every holder bit fits one word: the same
        walk over Python ints (one lookup, one gather of holder bits, then a list loop)."""
        slots = self._blocks.find(keys, _spread(keys))
        holder_bits = self._blocks.owners[slots, 0].tolist()  # slot -1 reads the last row: masked below
        matched: dict[str, int] = {}
        running = _ALL_BITS
        for position, (slot, bits) in enumerate(zip(slots.tolist(), holder_bits)):
            held = running & bits if slot >= 0 else 0
            if held != running:
                self._record_bits(0, running & ~held, position, matched)
                running = held
                if not running:
                    break
        self._record_bits(0, running, len(keys), matched)
        self._walked = _Walk(keys.tobytes(), slots, self._blocks.version)
        return matched

    def backends(self) -> list[str]:
        """Backends known to the index (holding blocks or given a capacity)."""
        self._expire_all()
        return list(self._holders)

    def blocks(self, backend: str) -> int:
        """Blocks ``backend`` holds."""
        self._expire_all()
        holder = self._holders.get(backend)
        return holder.count if holder is not None else 0

    def stats(self) -> IndexStats:
        """Blocks per backend, distinct blocks and total bytes."""
        self._expire_all()
        holders = self._holders.values()
        return IndexStats(
            blocks={holder.name: holder.count for holder in holders},
            unique_blocks=len(self._blocks.table.live()),
            bytes=self._blocks.nbytes + sum(holder.nbytes for holder in holders),
        )

    # --- updates ---------------------------------------------------------------------------

    def insert(self, backend: str, tokens: Sequence[int] | np.ndarray, *, salt: str | None = None) -> None:
        """``backend`` now holds the full blocks of ``tokens`` (all touched, head most recent)."""
        self.insert_hashes(backend, block_hashes(tokens, self.block_size, salt))

    def insert_hashes(self, backend: str, hashes: Sequence[int] | np.ndarray) -> None:
        """:meth:`insert` of precomputed block hashes (in sequence order)."""
        keys = _as_keys(hashes)
        now = self._expire_all()
        holder = self._holder(backend)
        if not len(keys):
            return
        placement = _spread(keys)
        block_slots, new_blocks = self._blocks.find_or_add(keys, placement, self._recall_walk(keys))
        self._blocks.owners[block_slots, holder.word] |= holder.bit
        if now is not None:
            holder.stamps.append((holder.tail, now))
        holder.touch(block_slots, placement, new_blocks, self._blocks.hashes_at)
        if holder.over_capacity:
            self._evict(holder, holder.oldest(holder.over_capacity))

    def remove_blocks(self, backend: str, hashes: Sequence[int] | np.ndarray) -> None:
        """``backend`` no longer holds these blocks (engine feedback, KV events)."""
        self._expire_all()
        holder = self._holders.get(backend)
        keys = _as_keys(hashes)
        if holder is None or not len(keys):
            return
        placement = _spread(keys)
        block_slots = self._blocks.find(keys, placement)
        known = block_slots >= 0
        slots = holder.find(block_slots[known], placement[known])
        self._release(holder, np.unique(slots[slots >= 0]))

    def trim(self, backend: str, hashes: Sequence[int] | np.ndarray, keep_blocks: int) -> None:
        """Keep only the first ``keep_blocks`` blocks of this sequence for ``backend``."""
        self.remove_blocks(backend, _as_keys(hashes)[max(0, keep_blocks) :])

    def set_capacity(self, backend: str, blocks: int | None) -> None:
        """Bound ``backend`` to ``blocks`` blocks (None: unbounded), evicting if it holds more."""
        if blocks is not None and blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        self._expire_all()
        holder = self._holder(backend)
        holder.capacity = blocks
        if holder.over_capacity:
            self._evict(holder, holder.oldest(holder.over_capacity))

    def clear(self, backend: str) -> None:
        """Drop every block of ``backend`` (it stays known, with its capacity)."""
        self._expire_all()
        holder = self._holders.get(backend)
        if holder is not None:
            self._forget_all(holder)
            self._holders[backend] = _Holder(backend, holder.bit_index, holder.capacity)

    def remove_backend(self, backend: str) -> None:
        """Forget ``backend`` and free everything of it."""
        self._expire_all()
        holder = self._holders.pop(backend, None)
        if holder is not None:
            self._forget_all(holder)
            self._by_bit[holder.bit_index] = None

    # --- internals -------------------------------------------------------------------------

    def _holder(self, backend: str) -> _Holder:
        holder = self._holders.get(backend)
        if holder is None:
            bit_index = self._free_bit()
            self._by_bit[bit_index] = backend
            holder = self._holders[backend] = _Holder(backend, bit_index, self.capacity_blocks)
        return holder

    def _free_bit(self) -> int:
        for bit_index, name in enumerate(self._by_bit):
            if name is None:
                return bit_index
        self._by_bit.append(None)
        if len(self._by_bit) > 64 * self._blocks.words:
            self._blocks.add_word()
        return len(self._by_bit) - 1

    def _recall_walk(self, keys: np.ndarray) -> np.ndarray | None:
        """Block slots the last match looked up, if ``keys`` starts with its hashes and no
        block got or lost a slot since."""
        walked, self._walked = self._walked, None
        if walked is None or walked.version != self._blocks.version:
            return None
        count = len(walked.slots)
        if count > len(keys):
            return None
        return walked.slots if keys[:count].tobytes() == walked.keys else None

    def _record_lengths(self, lost: np.ndarray, length_blocks: int, matched: dict[str, int]) -> None:
        """Backends whose bits are in ``lost`` (one uint64 per word) matched ``length_blocks``."""
        for word, bits in enumerate(lost.tolist()):
            self._record_bits(word, bits, length_blocks, matched)

    def _record_bits(self, word: int, bits: int, length_blocks: int, matched: dict[str, int]) -> None:
        """Backends whose bits (of holder word ``word``) are set in ``bits`` matched ``length_blocks``."""
        if length_blocks == 0:
            return
        tokens = length_blocks * self.block_size
        by_bit = self._by_bit
        base = word * 64 - 1
        while bits:
            low = bits & -bits
            name = by_bit[base + low.bit_length()]
            if name is not None:
                matched[name] = tokens
            bits ^= low

    def _evict(self, holder: _Holder, slots: np.ndarray) -> None:
        hashes = self._release(holder, slots)
        if self.on_evict is not None and len(hashes):
            self.on_evict(holder.name, hashes)

    def _release(self, holder: _Holder, slots: np.ndarray) -> np.ndarray:
        """Drop these table slots of ``holder``; returns their block hashes."""
        block_slots = holder.block_slots(slots)
        hashes = self._blocks.hashes_at(block_slots)
        placement = _spread(hashes)
        holder.drop(slots, placement)
        self._blocks.release(block_slots, placement, holder.word, holder.bit)
        return hashes

    def _forget_all(self, holder: _Holder) -> None:
        block_slots = holder.block_slots(holder.table.live())
        placement = _spread(self._blocks.hashes_at(block_slots))
        self._blocks.release(block_slots, placement, holder.word, holder.bit)

    def _expire_all(self) -> float | None:
        """With a TTL: drop every backend's expired blocks and return the time (else None).

        Every public method calls it first, so no answer ever counts an expired block."""
        if self.ttl_s is None:
            return None
        now = self._clock()
        deadline = now - self.ttl_s
        for holder in self._holders.values():
            if holder.stamps and holder.stamps[0][1] < deadline:
                self._expire(holder, deadline)
        return now

    def _expire(self, holder: _Holder, deadline: float) -> None:
        """Evict ``holder``'s blocks last touched before ``deadline``."""
        stamps = holder.stamps
        while stamps and stamps[0][1] < deadline:
            stamps.popleft()
        below = stamps[0][0] if stamps else holder.tail
        if below > holder.head:
            self._evict(holder, holder.oldest(holder.count, below_tick=below))

    def _relocate(self, relocation: np.ndarray) -> None:
        for holder in self._holders.values():
            holder.relocate_blocks(relocation)


def _shrinking_rows(prefix: np.ndarray, before: np.ndarray) -> np.ndarray:
    """Rows of ``prefix`` (n, words) that differ from the row before (``before`` for row 0)."""
    if prefix.shape[1] == 1:  # up to 64 backends: one word, compare as a vector
        column = prefix[:, 0]
        changed = np.flatnonzero(column[1:] != column[:-1]) + 1
        first = bool(column[0] != before[0])
    else:
        changed = np.flatnonzero((prefix[1:] != prefix[:-1]).any(axis=1)) + 1
        first = bool((prefix[0] != before).any())
    return np.concatenate(([0], changed)) if first else changed


@dataclass(frozen=True, slots=True)
class _Walk:
    """What a match looked up: its leading hashes (their bytes: one comparison), their block
    slots, the table version."""

    keys: bytes
    slots: np.ndarray
    version: int


def _as_keys(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as uint64 table keys; 0 marks an empty slot, so a hash of 0 is kept as 1."""
    keys = np.asarray(hashes, dtype=np.uint64).reshape(-1)
    if not keys.all():
        keys = np.where(keys == 0, np.uint64(1), keys)
    return keys
