"""Which backend probably holds which prefix: a bounded index of chained block hashes.

Every backend holds a *set* of blocks, each named by its chained hash
(:mod:`kvroute.tokenizer_index.hashing`), so a block stands for its whole prefix. A request's
longest cached prefix on a backend is the run of its leading blocks that backend holds.

Semantics (``tests/reference_index.py`` is the executable specification):

* **match** walks the request's blocks once, keeping the set of backends that hold every
  block so far; it stops at the first block that no backend holds with all the blocks
  before it, and reports each backend the length of its run (only backends with a run of
  at least one block appear).
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

Layout (numpy arrays, no per-block Python objects; :mod:`kvroute.tokenizer_index.bucket_table`
holds the hash tables): one table of every held block, hash -> slot, with a bitmask of its
holders (``8 + 8 * words`` bytes per slot, ``words = ceil(backends / 64)``), and per
backend a table of block slot -> LRU tick (``4 + 4`` bytes per slot) plus an append-only
log of ticks (4 bytes per touch, compacted when full of stale entries). Both tables are
kept between 40 % and 60 % full, and each bucket of 8 slots adds a 4-byte spill count
(0.5 bytes per slot). Per cached backend-block that is ``16.5 / 0.4 + 8.5 / 0.4 + 4..8 =
66..70`` bytes at worst (no two backends share a block and both tables just grew) and
50-60 on average; a block several backends hold costs its block-table slot once.
``stats().bytes`` is the exact total; ``python -m kvroute.benchmarks.bench_index`` measured about
60 bytes per backend-block at 1M blocks over 16 backends. Memory is bounded by the
capacities; removing a backend frees everything of it (its block table slots are reused;
the table itself never shrinks).

Per call, the work is compiled loops over the request's blocks
(:mod:`kvroute.tokenizer_index.kernels`), mostly random reads of the tables: a match is one
walk, and an insert one call of ``insert_run``, the eviction down to the backend's capacity
included, whenever the tables and the log have room for it (else the step-by-step path
that grows them). In a loaded router every call starts
with cold caches, so the number of calls counts more than the loops. The router hashes
once and calls :meth:`PrefixIndex.match_hashes` and :meth:`PrefixIndex.insert_hashes` with
the same array, and the insert reuses the match's lookups.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvroute.tokenizer_index import kernels
from kvroute.tokenizer_index.bucket_table import (
    ABSENT,
    LOOK_UP,
    PLACEMENT_MULTIPLIER,
    PLACEMENT_SALT,
    BucketTable,
    buckets_for,
    spread,
    spread_and_count_zeros,
)
from kvroute.tokenizer_index.hashing import block_hashes

__all__ = ["IndexStats", "PrefixIndex"]

EvictCallback = Callable[[str, np.ndarray], None]
HashesAt = Callable[[np.ndarray], np.ndarray]  # block slots -> their hashes

_NO_TICK = np.uint32(0xFFFFFFFF)
# Starting sizes; tables and logs grow as needed.
_INITIAL_BLOCK_BUCKETS = 64
_INITIAL_HOLDER_BUCKETS = 16
_INITIAL_LOG = 1024
#: ``known`` for an insert that no match looked up before.
_NONE_KNOWN = np.empty(0, dtype=np.int64)
#: ``insert_run``'s evicted hashes where it cannot evict (the holder has room for every block).
_NONE_EVICTED = np.empty(0, dtype=np.uint64)


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


def _missing_beyond_room(table: BucketTable, keys: np.ndarray, placement: np.ndarray, slots: np.ndarray) -> int:
    """0 if ``find_or_add`` of this batch fits ``table``'s room; otherwise how many keys it
    would add (the lookups it took to know are written into ``slots``)."""
    if len(keys) <= table.room():  # the usual case, known without looking
        return 0
    unsure = np.flatnonzero(slots < 0)
    if len(unsure) <= table.room():
        return 0
    looking = unsure[slots[unsure] == LOOK_UP]
    slots[looking] = table.find(keys[looking], placement[looking])
    missing = int(np.count_nonzero(slots < 0))
    return missing if missing > table.room() else 0


# --- every held block ----------------------------------------------------------------------


class _Blocks:
    """Every block some backend holds: its hash, slot, and a bitmask of its holders."""

    __slots__ = ("on_relocate", "owners", "table", "version")

    def __init__(self, on_relocate: Callable[[np.ndarray], None]) -> None:
        self.table = BucketTable(_INITIAL_BLOCK_BUCKETS, np.uint64)
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

    def find(self, hashes: np.ndarray, placement: np.ndarray) -> np.ndarray:
        return self.table.find(hashes, placement)

    def find_or_add(
        self, hashes: np.ndarray, placement: np.ndarray, known: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slots of these hashes, adding the missing ones with no holder yet; and which
        positions were added. ``known``: slots of a leading part, looked up at this version."""
        slots = np.full(len(hashes), LOOK_UP, dtype=np.int64)
        if known is not None:
            slots[: len(known)] = known
        missing = _missing_beyond_room(self.table, hashes, placement, slots)
        if missing:
            self._rebuild(buckets_for(self.table.count + missing))
            slots.fill(LOOK_UP)
        added = np.zeros(len(hashes), dtype=np.bool_)
        if self.table.find_or_add(hashes, placement, slots, added):
            self.version += 1
        return slots, added

    def reserve(self, blocks: int) -> None:
        """Room for ``blocks`` more blocks without growing the table again."""
        if blocks > self.table.room():
            self._rebuild(buckets_for(self.table.count + blocks))

    def hold(self, slots: np.ndarray, word: int, bit: np.uint64) -> None:
        """Set one holder's bit on these slots."""
        kernels.hold(self.owners, slots, word, bit)

    def add_word(self) -> None:
        """Room for 64 more holders."""
        self.owners = np.hstack((self.owners, np.zeros((len(self.owners), 1), dtype=np.uint64)))

    def _rebuild(self, buckets: int) -> None:
        """Re-place every block into a table of ``buckets`` buckets (one compiled pass)."""
        table = BucketTable(buckets, np.uint64)
        owners = np.zeros((table.slots, self.words), dtype=np.uint64)
        relocation = np.empty(self.table.slots, dtype=np.int64)
        table.count = kernels.rebuild_blocks(
            self.table.flat, self.owners, table.flat, table.spills, owners, relocation,
            PLACEMENT_SALT, PLACEMENT_MULTIPLIER,
        )  # fmt: skip
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
        "bit",
        "bit_index",
        "capacity",
        "count",
        "head",
        "log",
        "name",
        "stamps",
        "table",
        "tail",
        "ticks",
        "word",
    )

    def __init__(self, name: str, bit_index: int, capacity: int | None) -> None:
        self.name = name
        self.bit_index = bit_index
        self.word, bit = divmod(bit_index, 64)
        self.bit = np.uint64(1 << bit)
        self.capacity = capacity
        self.table = BucketTable(_INITIAL_HOLDER_BUCKETS, np.uint32)  # keys: block slot + 1
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

    def find(self, block_slots: np.ndarray, placement: np.ndarray) -> np.ndarray:
        return self.table.find((block_slots + 1).astype(np.uint32), placement)

    def touch(
        self, block_slots: np.ndarray, placement: np.ndarray, new_blocks: np.ndarray, hashes_at: HashesAt
    ) -> None:
        """Hold these blocks, head most recent. ``new_blocks``: where a block was new to
        every backend (so to this one too: no lookup needed there)."""
        keys = (block_slots + 1).astype(np.uint32)
        slots = np.where(new_blocks, ABSENT, LOOK_UP)
        missing = _missing_beyond_room(self.table, keys, placement, slots)
        if missing:
            self._rebuild(buckets_for(self.count + missing), hashes_at)
            slots = np.where(new_blocks, ABSENT, LOOK_UP)
        added = np.zeros(len(keys), dtype=np.bool_)
        self.count += self.table.find_or_add(keys, placement, slots, added)
        self._reserve_log(len(slots))
        kernels.stamp(self.ticks, self.log, self.tail, slots)
        self.tail += len(slots)

    def reserve(self, entries: int, hashes_at: HashesAt) -> None:
        """Room for ``entries`` more entries without growing the table or the log again."""
        if entries > self.table.room():
            self._rebuild(buckets_for(self.count + entries), hashes_at)
        self._reserve_log(entries)

    def oldest(self, limit: int, below_tick: int | None = None) -> np.ndarray:
        """Pop up to ``limit`` live entries from the log's head (ticks < ``below_tick``)."""
        end = self.tail if below_tick is None else min(self.tail, below_tick)
        taken = np.empty(min(limit, max(0, end - self.head)), dtype=np.int64)
        count, self.head = kernels.oldest(self.log, self.ticks, self.head, end, taken)
        return taken[:count]

    def relocate_blocks(self, relocation: np.ndarray) -> None:
        """The block table was rebuilt: rewrite the block slots this table stores."""
        kernels.relocate_keys(self.table.flat, relocation)

    def _reserve_log(self, n: int) -> None:
        if self.tail + n <= len(self.log):
            return
        self._compact()
        # At least as many free ticks as live entries after a compaction, so compactions
        # (each reads every live entry) stay amortised: a holder at its capacity in a log
        # just above it compacted every few thousand inserted blocks (~2 ms per 250K).
        if self.tail + n > len(self.log) or 2 * self.tail > len(self.log):
            grown = np.empty(max(2 * len(self.log), 2 * self.tail + n), dtype=np.uint32)
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
        table = BucketTable(buckets, np.uint32)
        slots = table.add(keys, spread(hashes_at(keys.astype(np.int64) - 1)))
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
        """:meth:`match` on precomputed :func:`~kvroute.tokenizer_index.hashing.block_hashes`."""
        hashes = _as_hashes(hashes)
        self._expire_all()
        if not len(hashes) or not self._holders:
            return {}
        blocks = self._blocks
        slots = np.empty(len(hashes), dtype=np.int64)
        run_blocks = np.zeros(64 * blocks.words, dtype=np.int64)  # per holder bit
        table = blocks.table
        walked = kernels.walk(
            table.flat, table.spills, blocks.owners, hashes, PLACEMENT_SALT, PLACEMENT_MULTIPLIER, slots, run_blocks
        )
        self._walked = _Walk(hashes[:walked].tobytes(), slots[:walked], blocks.version)
        matched: dict[str, int] = {}
        for name, length in zip(self._by_bit, run_blocks.tolist()):
            if length and name is not None:
                matched[name] = length * self.block_size
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

    def blocks_of(self, backends: Sequence[str]) -> list[int]:
        """:meth:`blocks` of each of ``backends``."""
        self._expire_all()
        holders = self._holders
        return [holder.count if (holder := holders.get(backend)) is not None else 0 for backend in backends]

    def stats(self) -> IndexStats:
        """Blocks per backend, distinct blocks and total bytes."""
        self._expire_all()
        holders = self._holders.values()
        return IndexStats(
            blocks={holder.name: holder.count for holder in holders},
            unique_blocks=self._blocks.table.count,
            bytes=self._blocks.nbytes + sum(holder.nbytes for holder in holders),
        )

    # --- updates ---------------------------------------------------------------------------

    def insert(self, backend: str, tokens: Sequence[int] | np.ndarray, *, salt: str | None = None) -> None:
        """``backend`` now holds the full blocks of ``tokens`` (all touched, head most recent)."""
        self.insert_hashes(backend, block_hashes(tokens, self.block_size, salt))

    def insert_hashes(self, backend: str, hashes: Sequence[int] | np.ndarray) -> None:
        """:meth:`insert` of precomputed block hashes (in sequence order)."""
        hashes = _as_hashes(hashes)
        now = self._expire_all()
        holder = self._holder(backend)
        if not len(hashes):
            return
        known = self._recall_walk(hashes)
        if now is not None:
            holder.stamps.append((holder.tail, now))
        if not self._insert_in_one_call(holder, hashes, known):
            self._insert_growing(holder, hashes, known)
        if holder.over_capacity:
            self._evict(holder, holder.oldest(holder.over_capacity))

    def reserve(self, backend: str, blocks: int) -> None:
        """Make room at once for ``blocks`` more blocks of a known ``backend`` (as many as its
        capacity leaves room for): for an insert in slices, which would otherwise grow the
        tables slice after slice, each growth re-placing every entry. Changes no answer."""
        holder = self._holders.get(backend)
        if holder is None:
            return
        if holder.capacity is not None:
            blocks = min(blocks, max(0, holder.capacity - holder.count))
        if blocks:
            self._blocks.reserve(blocks)
            holder.reserve(blocks, self._blocks.hashes_at)

    def remove_blocks(self, backend: str, hashes: Sequence[int] | np.ndarray) -> None:
        """``backend`` no longer holds these blocks (engine feedback, KV events)."""
        self._expire_all()
        holder = self._holders.get(backend)
        keys, placement = _keyed(hashes)
        if holder is None or not len(keys):
            return
        block_slots = self._blocks.find(keys, placement)
        known = block_slots >= 0
        slots = holder.find(block_slots[known], placement[known])
        self._release(holder, np.unique(slots[slots >= 0]))

    def trim(self, backend: str, hashes: Sequence[int] | np.ndarray, keep_blocks: int) -> None:
        """Keep only the first ``keep_blocks`` blocks of this sequence for ``backend``."""
        self.remove_blocks(backend, np.asarray(hashes, dtype=np.uint64).reshape(-1)[max(0, keep_blocks) :])

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

    def _recall_walk(self, hashes: np.ndarray) -> np.ndarray | None:
        """Block slots the last match looked up, if ``hashes`` starts with its hashes and no
        block got or lost a slot since."""
        walked, self._walked = self._walked, None
        if walked is None or walked.version != self._blocks.version:
            return None
        count = len(walked.slots)
        if count > len(hashes):
            return None
        return walked.slots if hashes[:count].tobytes() == walked.hashes else None

    def _insert_in_one_call(self, holder: _Holder, hashes: np.ndarray, known: np.ndarray | None) -> bool:
        """The usual insert, one compiled call (:func:`kernels.insert_run`), evicting down to
        the holder's capacity in it: when neither table needs to grow for it nor the
        holder's log to be compacted or grown. False (nothing done) otherwise."""
        count = len(hashes)
        blocks, table = self._blocks, holder.table
        if count > blocks.table.room() or count > table.room() or holder.tail + count > len(holder.log):
            return False
        capacity = holder.capacity
        room = max(0, capacity - holder.count) if capacity is not None else count
        # (Evicting takes more entries added than room: none below a holder's capacity.)
        evicted = np.empty(count, dtype=np.uint64) if room < count else _NONE_EVICTED
        added_blocks, added_entries, released, emptied, holder.head = kernels.insert_run(
            blocks.table.flat, blocks.table.spills, blocks.owners, table.flat, table.spills, holder.ticks, holder.log,
            holder.head, holder.tail, hashes, _NONE_KNOWN if known is None else known, holder.word, holder.bit,
            PLACEMENT_SALT, PLACEMENT_MULTIPLIER, room, evicted,
        )  # fmt: skip
        if added_blocks or emptied:
            blocks.table.count += added_blocks - emptied
            blocks.version += (added_blocks > 0) + (emptied > 0)  # (as an insert, then a release)
        table.count += added_entries - released
        holder.count += added_entries - released
        holder.tail += count
        if released and self.on_evict is not None:
            self.on_evict(holder.name, evicted[:released])
        return True

    def _insert_growing(self, holder: _Holder, hashes: np.ndarray, known: np.ndarray | None) -> None:
        """The insert step by step, growing the tables and the log as it needs."""
        keys, placement = _keyed(hashes)
        block_slots, new_blocks = self._blocks.find_or_add(keys, placement, known)
        self._blocks.hold(block_slots, holder.word, holder.bit)
        holder.touch(block_slots, placement, new_blocks, self._blocks.hashes_at)

    def _evict(self, holder: _Holder, slots: np.ndarray) -> None:
        hashes = self._release(holder, slots)
        if self.on_evict is not None and len(hashes):
            self.on_evict(holder.name, hashes)

    def _release(self, holder: _Holder, slots: np.ndarray) -> np.ndarray:
        """Drop these (distinct) table slots of ``holder``, and the blocks no backend holds
        any more; returns the dropped blocks' hashes."""
        blocks, table = self._blocks, holder.table
        hashes = np.empty(len(slots), dtype=np.uint64)
        emptied = kernels.release(
            table.flat, table.spills, holder.ticks, blocks.table.flat, blocks.table.spills, blocks.owners,
            slots, holder.word, holder.bit, PLACEMENT_SALT, PLACEMENT_MULTIPLIER, hashes,
        )  # fmt: skip
        table.count -= len(slots)
        holder.count -= len(slots)
        if emptied:
            blocks.table.count -= emptied
            blocks.version += 1
        return hashes

    def _forget_all(self, holder: _Holder) -> None:
        self._release(holder, holder.table.live())

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


@dataclass(slots=True)
class _Walk:
    """What a match looked up: its leading hashes (their bytes: one comparison), their block
    slots, the table version."""

    hashes: bytes
    slots: np.ndarray
    version: int


def _as_hashes(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a C-contiguous uint64 array (no copy when they already are one)."""
    return np.ascontiguousarray(hashes, dtype=np.uint64).reshape(-1)


def _keyed(hashes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block hashes as uint64 table keys, and their placement (:func:`spread`). 0 marks an
    empty slot, so a hash of 0 is kept as 1."""
    keys = np.ascontiguousarray(hashes, dtype=np.uint64).reshape(-1)
    placement, zeros = spread_and_count_zeros(keys)
    if zeros:
        keys = np.where(keys == 0, np.uint64(1), keys)
        placement = spread(keys)
    return keys, placement
