"""The compiled loops of ``tokenizer_index`` (numba): block hashing, the prefix index's hash
tables and its walks.

A 128K-token prompt is 8,192 blocks, and a numpy pass costs microseconds per call however
short its input, so neither numpy nor Python loops could serve both a 40-block chat and an
8,192-block agent transcript in microseconds: these loops do a few memory reads per block
and touch no Python object. :mod:`kvroute.tokenizer_index.hashing`,
:mod:`kvroute.tokenizer_index.bucket_table` and :mod:`kvroute.tokenizer_index.prefix_index` own the arrays
and call them.

Why everything compiled lives in this one file: numba's on-disk cache of a kernel is keyed
on the file that defines it, and kernels inline the helpers they call, so a kernel in
another file would keep running an old helper after the helper changed.

* Signatures are given, so the kernels compile (or load from the cache, in ``__pycache__``
  or ``NUMBA_CACHE_DIR``) when this module is imported, never on a request. Where no cache
  directory is writable (a read-only root file system) they compile without one.
* Kernels never read the placement salt as a global (a cached kernel would keep the salt
  of the process that compiled it): it is an argument.
* A table of a million blocks is far larger than the CPU caches, so every lookup would
  wait on memory for its bucket: the loops :func:`prefetch` the buckets ``AHEAD`` keys
  ahead, which keeps several of those reads in flight at once. Measured on the AMD EPYC
  here: the 128K-token insert went from 1.9 to 1.5 ms, the match walk over 8,192 cached
  blocks from 0.8 to 0.4 ms. Prefetching the buckets' spill counts as well (read when a
  key is not in its bucket) made lookups 1.5 to 4 times slower in every case tried, so
  the loops prefetch keys only.
* Helpers that take arrays are inlined only where numba still drops its reference
  counting: one that did not (a branch around a prefetch) cost an atomic increment per
  key, three times the lookup itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

BUCKET = 8  # slots per bucket: 64 bytes of uint64 keys, one cache line
#: ``find_or_add`` slot markers: look the key up; the caller knows the key is absent.
LOOK_UP = -1
ABSENT = -2
_SHIFT32 = np.uint64(32)


def compiled(signatures: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit`` for these signatures, cached on disk where a cache directory is
    writable, compiled in memory where none is."""

    def compile_(function: Callable[..., Any]) -> Any:
        try:
            return njit(signatures, cache=True, nogil=True)(function)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(signatures, nogil=True)(function)

    return compile_


# --- block hashing (the scheme is documented in kvroute.tokenizer_index.hashing) --------------------

#: Chain multiplier (odd, so invertible mod 2^64): the 64-bit golden ratio.
CHAIN_MULTIPLIER = 0x9E3779B97F4A7C15
#: splitmix64's finalizer constants (Steele, Lea, Flood 2014).
FMIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_K = np.uint64(CHAIN_MULTIPLIER)
_M1, _M2 = np.uint64(FMIX_MULTIPLIERS[0]), np.uint64(FMIX_MULTIPLIERS[1])
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


@njit(inline="always")
def fmix(value: np.uint64) -> np.uint64:
    """splitmix64's finalizer: a bijection on 64-bit words."""
    value ^= value >> _S30
    value *= _M1
    value ^= value >> _S27
    value *= _M2
    return value ^ (value >> _S31)


@compiled(types.void(types.uint64[::1], types.int64, types.uint64[::1], types.uint64, types.uint64[::1]))
def chain_hashes(tokens, block_size, multipliers, seed, hashes):  # type: ignore[no-untyped-def]
    """``hashes[i] = fmix(r_i)`` with ``r_i = K * r_{i-1} + fmix(block_i . multipliers)``
    and ``r_{-1} = seed``, for the first ``len(hashes)`` full blocks of ``tokens``."""
    chain = seed
    for block in range(hashes.shape[0]):
        start = block * block_size
        content = np.uint64(0)
        for column in range(block_size):
            content += tokens[start + column] * multipliers[column]
        chain = _K * chain + fmix(content)
        hashes[block] = fmix(chain)


# --- the hash tables -----------------------------------------------------------------------
# One signature per key width: uint64 (block hashes) and uint32 (a backend's block slots).

_KEYS = (types.uint64[::1], types.uint32[::1])
_PLACEMENT = types.uint64[::1]
_SLOTS = types.int64[::1]
_SPILLS = types.uint32[::1]
#: Keys ahead whose buckets a loop prefetches: enough reads in flight to hide memory
#: latency, few enough that the lines are still cached when their turn comes.
AHEAD = 16


@intrinsic
def prefetch(typingctx, array, index):  # type: ignore[no-untyped-def]
    """Ask the CPU to start loading ``array[index]``'s cache line (LLVM's prefetch
    intrinsic: a hint, never a fault, whatever the index)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        byte_pointer = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        prefetch_type = ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32])
        intrinsic_function = cgutils.get_or_insert_function(builder.module, prefetch_type, "llvm.prefetch.p0")
        # read (0), keep in every cache level (3), data (1)
        builder.call(intrinsic_function, [builder.bitcast(pointer, byte_pointer), int32(0), int32(3), int32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@njit(inline="always")
def home_bucket(placement: np.uint64, buckets: int) -> int:
    """Range reduction of a 32-bit placement value to ``0..buckets-1``."""
    return np.int64((placement * np.uint64(buckets)) >> _SHIFT32)  # type: ignore[return-value]  # numba int64


@njit(inline="always")
def placement_of(key: np.uint64, salt: np.uint64, multiplier: np.uint64) -> np.uint64:
    """:func:`spread` of one key, inside a kernel (given the salt and multiplier as arguments)."""
    return ((key ^ salt) * multiplier) >> _SHIFT32


@njit(inline="always")
def find_one(flat: np.ndarray, spills: np.ndarray, key: np.integer, placement: np.uint64) -> int:
    """Slot of ``key``, -1 if absent."""
    buckets = spills.shape[0]
    bucket = home_bucket(placement, buckets)
    while True:
        start = bucket * BUCKET
        for slot in range(start, start + BUCKET):
            if flat[slot] == key:
                return slot
        if spills[bucket] == 0:  # no key passed this bucket: it would be here
            return -1
        bucket += 1
        if bucket == buckets:
            bucket = 0


@njit(inline="always")
def add_one(flat: np.ndarray, spills: np.ndarray, key: np.integer, placement: np.uint64) -> int:
    """Place an absent ``key`` in the first empty slot from its home bucket on; its slot."""
    buckets = spills.shape[0]
    bucket = home_bucket(placement, buckets)
    while True:
        start = bucket * BUCKET
        for slot in range(start, start + BUCKET):
            if flat[slot] == 0:
                flat[slot] = key
                return slot
        spills[bucket] += 1  # full: the key passes this bucket and says so in its count
        bucket += 1
        if bucket == buckets:
            bucket = 0


@njit(inline="always")
def remove_one(flat: np.ndarray, spills: np.ndarray, slot: int, placement: np.uint64) -> None:
    """Empty ``slot``; the key leaves the spill counts of the buckets it passed."""
    flat[slot] = 0
    bucket = slot // BUCKET
    buckets = spills.shape[0]
    passing = home_bucket(placement, buckets)
    while passing != bucket:
        spills[passing] -= 1
        passing += 1
        if passing == buckets:
            passing = 0


@compiled(types.int64(_PLACEMENT, _PLACEMENT, types.uint64, types.uint64))
def spread_keys(keys, placement, salt, multiplier):  # type: ignore[no-untyped-def]
    """Fill ``placement`` with each key's placement value; returns how many keys are 0."""
    zeros = 0
    for i in range(keys.shape[0]):
        placement[i] = placement_of(keys[i], salt, multiplier)
        if keys[i] == 0:
            zeros += 1
    return zeros


@compiled([types.void(keys, _SPILLS, keys, _PLACEMENT, _SLOTS) for keys in _KEYS])
def find(flat, spills, keys, placement, found):  # type: ignore[no-untyped-def]
    """Fill ``found`` with each key's slot, -1 where absent."""
    buckets = spills.shape[0]
    for i in range(keys.shape[0]):
        if i + AHEAD < keys.shape[0]:
            prefetch(flat, home_bucket(placement[i + AHEAD], buckets) * BUCKET)
        found[i] = find_one(flat, spills, keys[i], placement[i])


@compiled(
    [
        types.UniTuple(types.int64, 2)(keys, _SPILLS, keys, _PLACEMENT, _SLOTS, types.bool_[::1], types.int64)
        for keys in _KEYS
    ]
)
def find_or_add(flat, spills, keys, placement, slots, added, room):  # type: ignore[no-untyped-def]
    """Resolve ``slots`` (:data:`LOOK_UP`, :data:`ABSENT` or a known slot), adding at most
    ``room`` keys (marked in ``added``); returns (where it stopped, how many it added)."""
    count = 0
    buckets = spills.shape[0]
    for i in range(keys.shape[0]):
        if i + AHEAD < keys.shape[0]:
            prefetch(flat, home_bucket(placement[i + AHEAD], buckets) * BUCKET)
        slot = slots[i]
        if slot >= 0:
            continue
        if slot == LOOK_UP:
            slot = find_one(flat, spills, keys[i], placement[i])
            if slot >= 0:
                slots[i] = slot
                continue
        if count == room:
            return i, count
        slots[i] = add_one(flat, spills, keys[i], placement[i])
        added[i] = True
        count += 1
    return keys.shape[0], count


@compiled([types.void(keys, _SPILLS, _SLOTS, _PLACEMENT) for keys in _KEYS])
def remove(flat, spills, slots, placement):  # type: ignore[no-untyped-def]
    """Empty these slots."""
    for i in range(slots.shape[0]):
        remove_one(flat, spills, slots[i], placement[i])


# --- the index ------------------------------------------------------------------------------

_U64 = types.uint64[::1]
_U32 = types.uint32[::1]
_I64 = types.int64[::1]
_OWNERS = types.uint64[:, ::1]
_NO_TICK = np.uint32(0xFFFFFFFF)
_ALL_BITS = np.uint64(0xFFFFFFFFFFFFFFFF)
_ONE = np.uint64(1)


@njit(inline="always")
def _record_run(run_blocks: np.ndarray, word: int, bits: np.uint64, length: int) -> None:
    """The holders of ``bits`` (of holder word ``word``) held ``length`` blocks in a row."""
    for bit in range(64):
        if (bits >> np.uint64(bit)) & _ONE:
            run_blocks[word * 64 + bit] = length


@njit(inline="always")
def held_key(block_hash: np.uint64) -> np.uint64:
    """The block table's key for a block hash: 0 marks an empty slot, so a hash of 0 is held as 1."""
    return block_hash if block_hash != 0 else _ONE


@compiled(types.int64(_U64, _U32, _OWNERS, _U64, types.uint64, types.uint64, _I64, _I64))
def walk(flat, spills, owners, hashes, salt, multiplier, slots, run_blocks):  # type: ignore[no-untyped-def]
    """The match walk: looks blocks up in order (their slots into ``slots``) while some
    backend holds every block so far; ``run_blocks[bit]`` gets each holder's run length.
    Returns how many blocks it looked up. Takes the block hashes as they are and places
    them itself (:func:`held_key`, :func:`placement_of`): no numpy pass before it."""
    words = owners.shape[1]
    buckets = spills.shape[0]
    running = np.full(words, _ALL_BITS, dtype=np.uint64)  # holders of every block so far
    owner_words = owners.reshape(-1)
    count = hashes.shape[0]
    for i in range(count):
        if i + AHEAD < count:  # the bucket a block will be in, and its holder bits
            ahead = home_bucket(placement_of(held_key(hashes[i + AHEAD]), salt, multiplier), buckets) * BUCKET
            prefetch(flat, ahead)
            prefetch(owner_words, ahead * words)
        key = held_key(hashes[i])
        slot = find_one(flat, spills, key, placement_of(key, salt, multiplier))
        slots[i] = slot
        anyone = False
        for word in range(words):
            held = running[word] & owners[slot, word] if slot >= 0 else np.uint64(0)
            if held != running[word]:
                _record_run(run_blocks, word, running[word] & ~held, i)
                running[word] = held
            if held:
                anyone = True
        if not anyone:
            return i + 1
    for word in range(words):
        _record_run(run_blocks, word, running[word], count)
    return count


@njit(inline="always")
def _take_oldest(log, ticks, head, end, taken, limit):  # type: ignore[no-untyped-def]
    """:func:`oldest`, taking at most ``limit``."""
    count = 0
    tick = head
    while tick < end and count < limit:
        slot = log[tick]
        if ticks[slot] == tick:
            taken[count] = slot
            count += 1
        tick += 1
    return count, tick


@njit(inline="always")
def _release_slots(  # type: ignore[no-untyped-def]
    holder_flat, holder_spills, ticks, block_flat, block_spills, owners, slots, count, word, bit, salt, multiplier,
    hashes,
):  # fmt: skip
    """:func:`release` of the first ``count`` of ``slots``."""
    words = owners.shape[1]
    owner_words = owners.reshape(-1)
    keep = ~bit
    emptied = 0
    for i in range(count):
        if i + AHEAD < count:  # the holder's entry two steps ahead of its block's
            prefetch(holder_flat, slots[i + AHEAD])
            prefetch(ticks, slots[i + AHEAD])
        if i + AHEAD // 2 < count:
            block_ahead = np.int64(holder_flat[slots[i + AHEAD // 2]]) - 1
            prefetch(block_flat, block_ahead)
            prefetch(owner_words, block_ahead * words)
        slot = slots[i]
        block_slot = np.int64(holder_flat[slot]) - 1
        key = block_flat[block_slot]
        hashes[i] = key
        placement = placement_of(key, salt, multiplier)
        remove_one(holder_flat, holder_spills, slot, placement)
        ticks[slot] = _NO_TICK
        owners[block_slot, word] &= keep
        held = False
        for other in range(words):
            if owners[block_slot, other]:
                held = True
                break
        if not held:
            remove_one(block_flat, block_spills, block_slot, placement)
            emptied += 1
    return emptied


@compiled(
    types.UniTuple(types.int64, 5)(
        _U64, _U32, _OWNERS, _U32, _U32, _U32, _U32, types.int64, types.int64,
        _U64, _I64, types.int64, types.uint64, types.uint64, types.uint64, types.int64, _U64,
    )
)  # fmt: skip
def insert_run(  # type: ignore[no-untyped-def]
    block_flat, block_spills, owners, holder_flat, holder_spills, ticks, log, head, tail,
    hashes, known, word, bit, salt, multiplier, room, evicted,
):  # fmt: skip
    """One backend now holds this sequence of blocks (the prefix index's insert in one
    call, for tables with room for every block and a log with room for every tick; the
    caller checks). Per block in order: its block slot (``known`` for the leading ones a
    match just looked up, else found or added), the holder's bit on it, and the holder's
    table slot of it (found, or added without a lookup where the block itself was new);
    then the ticks from ``tail``, the sequence's tail first (:func:`stamp`). Then, where
    more entries were added than ``room`` (the holder's capacity less its entries), the
    excess is evicted as :meth:`oldest` and :func:`release` would, from ``head``: their
    hashes into ``evicted`` (as long as ``hashes``). Returns (blocks added to the block
    table, entries added to the holder's table, entries evicted, blocks emptied by that,
    the log's new head)."""
    count = hashes.shape[0]
    block_buckets = block_spills.shape[0]
    holder_buckets = holder_spills.shape[0]
    holder_slots = np.empty(count, dtype=np.int64)
    added_blocks = 0
    added_entries = 0
    for i in range(count):
        if i + AHEAD < count:  # what the block ahead will read: its bits (or bucket), its holder's bucket
            ahead_placement = placement_of(held_key(hashes[i + AHEAD]), salt, multiplier)
            ahead_slot = known[i + AHEAD] if i + AHEAD < known.shape[0] else -1
            if ahead_slot >= 0:
                prefetch(owners[ahead_slot], word)
            else:
                prefetch(block_flat, home_bucket(ahead_placement, block_buckets) * BUCKET)
            prefetch(holder_flat, home_bucket(ahead_placement, holder_buckets) * BUCKET)
        key = held_key(hashes[i])
        placement = placement_of(key, salt, multiplier)
        new_block = False
        block_slot = known[i] if i < known.shape[0] else -1  # -1 in known: absent then, look again
        if block_slot < 0:
            block_slot = find_one(block_flat, block_spills, key, placement)
        if block_slot < 0:
            block_slot = add_one(block_flat, block_spills, key, placement)
            new_block = True
            added_blocks += 1
        owners[block_slot, word] |= bit
        entry = np.uint32(block_slot + 1)
        slot = -1 if new_block else find_one(holder_flat, holder_spills, entry, placement)
        if slot < 0:
            slot = add_one(holder_flat, holder_spills, entry, placement)
            added_entries += 1
        holder_slots[i] = slot
    for k in range(count):
        if k + AHEAD < count:
            prefetch(ticks, holder_slots[count - 1 - k - AHEAD])
        slot = holder_slots[count - 1 - k]
        ticks[slot] = tail + k
        log[tail + k] = slot
    over = min(added_entries - room, count)  # (a holder past its capacity before: the caller evicts the rest)
    if over <= 0:
        return added_blocks, added_entries, 0, 0, head
    taken, head = _take_oldest(log, ticks, head, tail + count, holder_slots, over)
    emptied = _release_slots(
        holder_flat, holder_spills, ticks, block_flat, block_spills, owners, holder_slots, taken, word, bit,
        salt, multiplier, evicted,
    )  # fmt: skip
    return added_blocks, added_entries, taken, emptied, head


@compiled(types.void(_U32, _U32, types.int64, _I64))
def stamp(ticks, log, tail, slots):  # type: ignore[no-untyped-def]
    """Give the table slots of a sequence the next ticks from ``tail``, its tail first (so
    its head is the most recent; a block twice in the batch keeps its head-most tick)."""
    count = slots.shape[0]
    for k in range(count):
        if k + AHEAD < count:
            prefetch(ticks, slots[count - 1 - k - AHEAD])
        slot = slots[count - 1 - k]
        ticks[slot] = tail + k
        log[tail + k] = slot


@compiled(types.UniTuple(types.int64, 2)(_U32, _U32, types.int64, types.int64, _I64))
def oldest(log, ticks, head, end, taken):  # type: ignore[no-untyped-def]
    """Read the log from ``head`` towards ``end`` and take its live entries (the least
    recently used first) until ``taken`` is full; returns (how many, the new head)."""
    return _take_oldest(log, ticks, head, end, taken, taken.shape[0])


@compiled(types.void(_OWNERS, _I64, types.int64, types.uint64))
def hold(owners, slots, word, bit):  # type: ignore[no-untyped-def]
    """Set one holder's bit on these block slots."""
    words = owners.shape[1]
    owner_words = owners.reshape(-1)
    for i in range(slots.shape[0]):
        if i + AHEAD < slots.shape[0]:
            prefetch(owner_words, slots[i + AHEAD] * words)
        owners[slots[i], word] |= bit


@compiled(types.int64(_U64, _OWNERS, _U64, _U32, _OWNERS, _I64, types.uint64, types.uint64))
def rebuild_blocks(old_flat, old_owners, flat, spills, owners, relocation, salt, multiplier):  # type: ignore[no-untyped-def]
    """Re-place every block of the old table (``old_flat``, its ``old_owners`` rows) into an
    empty one (``flat``, ``spills``, ``owners``), in one pass; ``relocation[old slot]`` gets
    its new slot (-1 where the old slot was empty). Returns how many blocks moved."""
    buckets = spills.shape[0]
    words = owners.shape[1]
    count = old_flat.shape[0]
    moved = 0
    for i in range(count):
        if i + AHEAD < count and old_flat[i + AHEAD] != 0:
            prefetch(flat, home_bucket(placement_of(old_flat[i + AHEAD], salt, multiplier), buckets) * BUCKET)
        key = old_flat[i]
        if key == 0:
            relocation[i] = -1
            continue
        slot = add_one(flat, spills, key, placement_of(key, salt, multiplier))
        for word in range(words):
            owners[slot, word] = old_owners[i, word]
        relocation[i] = slot
        moved += 1
    return moved


@compiled(types.void(_U32, _I64))
def relocate_keys(flat, relocation):  # type: ignore[no-untyped-def]
    """A backend's table after the block table was rebuilt: each key (block slot + 1)
    becomes its block's new slot + 1. Keys stay where they are: they are placed by their
    block's hash, which did not change."""
    for slot in range(flat.shape[0]):
        key = flat[slot]
        if key != 0:
            flat[slot] = np.uint32(relocation[np.int64(key) - 1] + 1)


@compiled(
    types.int64(
        _U32, _U32, _U32, _U64, _U32, _OWNERS, _I64, types.int64, types.uint64, types.uint64, types.uint64, _U64
    )
)
def release(
    holder_flat, holder_spills, ticks, block_flat, block_spills, owners, slots, word, bit, salt, multiplier, hashes
):  # type: ignore[no-untyped-def]
    """Drop a holder's table ``slots`` (their hashes into ``hashes``): out of its table and
    ticks, its bit off their blocks, and the blocks left with no holder out of the block
    table. Returns how many blocks were emptied."""
    return _release_slots(
        holder_flat, holder_spills, ticks, block_flat, block_spills, owners, slots, slots.shape[0], word, bit,
        salt, multiplier, hashes,
    )  # fmt: skip


# --- words: text cut by a tokenizer's pre-tokenizer regex, each word's ids looked up ---------
# The regex runs as a program (kvroute.tokenizer_index.word_program): per alternative a
# sequence of items, each a greedy repeat of a character class or a one-character
# lookahead, and last an optional group of fixed strings (o200k's contractions); the
# alternatives are tried in order with backtracking, as Python's ``re`` does. Text arrives
# as UTF-8: an ASCII byte is its own character class column, any other character is decoded
# and mapped to the column of the characters every class treats alike (``cmap``). The
# words' ids live in an open-addressing table keyed by a hash of each word's bytes
# (kvroute.tokenizer_index.word_table; its slots are described below).

#: Item kinds of a word program.
ITEM_REPEAT, ITEM_NOT_FOLLOWED_BY, ITEM_FOLLOWED_BY, ITEM_FAIL, ITEM_OPTIONAL_SUFFIX = 0, 1, 2, 3, 4
#: Class columns: 0-127 the ASCII characters, then groups of other characters; the last
#: stands for characters the program does not know (no class holds them).
CLASS_COLUMNS = 256
UNKNOWN_COLUMN = CLASS_COLUMNS - 1
_CLASSES = types.uint8[:, ::1]
_ITEMS = types.int64[:, ::1]
_U8 = types.uint8[::1]
#: A text's bytes, as ``np.frombuffer`` gives them: read-only.
_TEXT = types.Array(types.uint8, 1, "C", readonly=True)
_CMAP = types.Array(types.uint8, 1, "C", readonly=True)


@njit  # (not inlined: in each of _column's dozen sites it made word_ids compile 2.7 s longer,
# and a call per character beyond ASCII measured no slower on Cyrillic text)
def _code_point(text, at):  # type: ignore[no-untyped-def]
    """The character of several bytes (valid UTF-8, as Python encodes) at ``at``, and its width."""
    first = np.int64(text[at])
    if first < 0xE0:
        return ((first & 0x1F) << 6) | (np.int64(text[at + 1]) & 0x3F), 2
    if first < 0xF0:
        return ((first & 0x0F) << 12) | ((np.int64(text[at + 1]) & 0x3F) << 6) | (np.int64(text[at + 2]) & 0x3F), 3
    point = ((first & 0x07) << 18) | ((np.int64(text[at + 1]) & 0x3F) << 12)
    return point | ((np.int64(text[at + 2]) & 0x3F) << 6) | (np.int64(text[at + 3]) & 0x3F), 4


@njit(inline="always")
def _column(text, at, cmap):  # type: ignore[no-untyped-def]
    """The class column of the character at byte ``at``, and its width in bytes."""
    first = text[at]
    if first < 0x80:
        return np.int64(first), 1
    point, width = _code_point(text, at)
    if point >= cmap.shape[0]:
        return np.int64(UNKNOWN_COLUMN), width
    return np.int64(cmap[point]), width


@njit(inline="always")
def _all_known(text, cmap):  # type: ignore[no-untyped-def]
    """Whether every character of ``text`` has a column of its own (none is unknown)."""
    at = 0
    while at < text.shape[0]:
        column, width = _column(text, at, cmap)
        if column == UNKNOWN_COLUMN:
            return False
        at += width
    return True


@compiled(types.boolean(_TEXT, _CMAP))
def known_text(text, cmap):  # type: ignore[no-untyped-def]
    """Whether every character of the UTF-8 ``text`` has a column in ``cmap`` (code points
    past its end have none): ``word_split.agreed_text`` in one pass, without a copy."""
    return _all_known(text, cmap)


@njit(inline="always")
def _match_alternative(text, at, stop, classes, items, suffixes, cmap, first, last, counts, positions, stops):  # type: ignore[no-untyped-def]
    """Where items ``first..last-1`` matched from ``at`` end (-1: no match), greedy repeats
    giving back one character at a time on failure, as a backtracking engine does.
    ``positions`` (where each item began) is written but no longer read since ``stops``
    came: without it word_ids ran 12 % slower (730-748 against 651-677 us on 30 KB of ASCII,
    each version compiled and run from the other's checkout too, 2026-12-06), code layout."""
    item = first
    position = at
    while True:
        if item == last:
            return position
        kind = items[item, 0]
        members = items[item, 1]
        matched = False
        if kind == ITEM_REPEAT:
            run = 0
            most = items[item, 3]
            end = position
            while run < most and end < stop:
                column, width = _column(text, end, cmap)
                if not classes[members, column]:
                    break
                run += 1
                end += width
            if run >= items[item, 2]:
                counts[item] = run
                positions[item] = position
                stops[item] = end
                position = end
                matched = True
        elif kind == ITEM_OPTIONAL_SUFFIX:  # (always last: the first string that follows, or none)
            position = _optional_suffix(text, position, stop, classes, suffixes, cmap, members, items[item, 2])
            matched = True
        elif kind != ITEM_FAIL:
            following = position < stop and classes[members, _column(text, position, cmap)[0]] != 0
            if following == (kind == ITEM_FOLLOWED_BY):
                counts[item] = 0
                positions[item] = position
                stops[item] = position
                matched = True
        if matched:
            item += 1
            continue
        while True:  # back to the latest repeat that can give a character back
            item -= 1
            if item < first:
                return -1
            if items[item, 0] == ITEM_REPEAT and counts[item] > items[item, 2]:
                counts[item] -= 1
                position = stops[item] - 1
                while text[position] & 0xC0 == 0x80:  # (a UTF-8 continuation byte)
                    position -= 1
                stops[item] = position
                item += 1
                break


@njit(inline="always")
def _optional_suffix(text, at, stop, classes, suffixes, cmap, first, count):  # type: ignore[no-untyped-def]
    """Where the first of the ``count`` strings from ``suffixes[first]`` (each: its length,
    then a class per character) that matches at ``at`` ends; ``at`` if none does."""
    for suffix in range(first, first + count):
        length = suffixes[suffix, 0]
        if at + length > stop:  # (a character takes a byte at least)
            continue
        whole = True
        position = at
        for offset in range(length):
            if position >= stop:
                whole = False
                break
            column, width = _column(text, position, cmap)
            if not classes[suffixes[suffix, offset + 1], column]:
                whole = False
                break
            position += width
        if whole:
            return position
    return at


@njit
def _word_end(text, at, stop, classes, items, ends, starts, suffixes, cmap, counts, positions, stops):  # type: ignore[no-untyped-def]
    """Where the first alternative that matches at ``at`` ends; -1 if none does."""
    column = _column(text, at, cmap)[0]
    for candidate in range(starts[column, 0]):
        alternative = starts[column, candidate + 1]
        first = ends[alternative - 1] if alternative > 0 else 0
        end = _match_alternative(
            text, at, stop, classes, items, suffixes, cmap, first, ends[alternative], counts, positions, stops
        )
        if end >= 0:
            return end
    return -1


# The word table's slots, four 64-bit words each (a cache line holds two): the key (a hash
# of the word; 0 marks an empty slot); the word's bytes packed, if at most 8, else their
# offset in the byte arena; its ids, two of 32 bits packed, if at most two, else their
# offset in the id arena; its length in bytes and its number of ids (32 bits each). Most
# words are short and one or two ids long: one memory read finds them.
SLOT_KEY, SLOT_WORD, SLOT_IDS, SLOT_SIZES = 0, 1, 2, 3
_WORD_SLOTS = types.uint64[:, ::1]
#: Words up to this many bytes are kept in their slot; ids up to this many too.
INLINE_BYTES, INLINE_IDS = 8, 2
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(inline="always")
def _packed_head(text, start, end):  # type: ignore[no-untyped-def]
    """The first (up to) 8 bytes of ``text[start:end]``, little-endian in one word."""
    packed = np.uint64(0)
    for position in range(start, min(end, start + INLINE_BYTES)):
        packed |= np.uint64(text[position]) << np.uint64(8 * (position - start))
    return packed


@njit(inline="always")
def _word_key(text, start, end, head):  # type: ignore[no-untyped-def]
    """The word's table key: its bytes mixed 8 at a time, then its length; never 0."""
    value = fmix(head ^ _K)
    for chunk in range(start + INLINE_BYTES, end, INLINE_BYTES):
        value = fmix(value ^ _packed_head(text, chunk, end))
    value = fmix(value ^ np.uint64(end - start))
    return value if value != 0 else _ONE


@njit(inline="always")
def _find_word(text, start, end, slots, word_bytes):  # type: ignore[no-untyped-def]
    """The slot of ``text[start:end]``, or -1."""
    head = _packed_head(text, start, end)
    key = _word_key(text, start, end, head)
    length = np.uint64(end - start)
    mask = slots.shape[0] - 1
    slot = np.int64(key & np.uint64(mask))
    while True:
        stored = slots[slot, SLOT_KEY]
        if stored == 0:
            return -1
        if stored == key and slots[slot, SLOT_SIZES] & _LOW32 == length:
            if length <= INLINE_BYTES:
                if slots[slot, SLOT_WORD] == head:
                    return slot
            else:
                offset = np.int64(slots[slot, SLOT_WORD])
                same = True
                for position in range(end - start):
                    if word_bytes[offset + position] != text[start + position]:
                        same = False
                        break
                if same:
                    return slot
        slot = (slot + 1) & mask


@njit(inline="always")
def _emit_word(text, start, end, slots, word_bytes, ids, out_ids, written, missing, missed):  # type: ignore[no-untyped-def]
    """Write the ids of the word ``text[start:end]`` at ``out_ids[written:]``; a word not
    in the table is noted in ``missing`` and holds its place with ``-1 - its number
    there``. Returns the new ``(written, missed)``."""
    slot = _find_word(text, start, end, slots, word_bytes)
    if slot < 0:
        return _note_missing(start, end, out_ids, written, missing, missed)
    return _emit_slot(slot, slots, ids, out_ids, written), missed


@njit(inline="always")
def _note_missing(start, end, out_ids, written, missing, missed):  # type: ignore[no-untyped-def]
    missing[missed, 0] = start
    missing[missed, 1] = end
    out_ids[written] = -1 - missed
    return written + 1, missed + 1


@njit(inline="always")
def _emit_slot(slot, slots, ids, out_ids, written):  # type: ignore[no-untyped-def]
    """Write the ids of the word in ``slot`` at ``out_ids[written:]``; returns the new ``written``."""
    count = np.int64(slots[slot, SLOT_SIZES] >> _SHIFT32)
    stored = slots[slot, SLOT_IDS]
    if count <= INLINE_IDS:
        out_ids[written] = np.int64(stored & _LOW32)
        if count == 2:
            out_ids[written + 1] = np.int64(stored >> _SHIFT32)
    else:
        offset = np.int64(stored)
        for index in range(count):
            out_ids[written + index] = ids[offset + index]
    return written + count


@njit(inline="always")
def _piece_end(text, at, stop, classes, items, ends, starts, suffixes, cmap, counts, positions, stops):  # type: ignore[no-untyped-def]
    """Where the piece from ``at`` ends: the program's match there, or, where none starts,
    the characters up to where one does (``re.findall`` skips them; the tokenizer keeps
    them as a word, ``word_split._cut``)."""
    end = _word_end(text, at, stop, classes, items, ends, starts, suffixes, cmap, counts, positions, stops)
    if end < 0:
        end = at + _column(text, at, cmap)[1]
        while (
            end < stop
            and _word_end(text, end, stop, classes, items, ends, starts, suffixes, cmap, counts, positions, stops) < 0
        ):
            end += _column(text, end, cmap)[1]
    return end


@njit(inline="always")
def _free_slot(slots, key):  # type: ignore[no-untyped-def]
    mask = slots.shape[0] - 1
    slot = np.int64(key & np.uint64(mask))
    while slots[slot, SLOT_KEY] != 0:
        slot = (slot + 1) & mask
    return slot


@njit(inline="always")
def _append(arena, used, which, source, start, count):  # type: ignore[no-untyped-def]
    """Copy ``source[start:start + count]`` to the end of ``arena`` (its used length is
    ``used[which]``, updated); returns where it went."""
    offset = used[which]
    for index in range(count):
        arena[offset + index] = source[start + index]
    used[which] += count
    return np.uint64(offset)


@njit(inline="always")
def _add_word(text, start, end, new_ids, id_start, count, slots, word_bytes, ids, used):  # type: ignore[no-untyped-def]
    """Add the word ``text[start:end]`` (not in the table) with its ``count`` ids from
    ``new_ids[id_start]``; the caller made room in the slots and both arenas."""
    head = _packed_head(text, start, end)
    key = _word_key(text, start, end, head)
    slot = _free_slot(slots, key)
    slots[slot, SLOT_KEY] = key
    length = end - start
    if length <= INLINE_BYTES:
        slots[slot, SLOT_WORD] = head
    else:
        slots[slot, SLOT_WORD] = _append(word_bytes, used, 0, text, start, length)
    if count <= INLINE_IDS:
        packed = np.uint64(new_ids[id_start]) & _LOW32
        if count == 2:
            packed |= np.uint64(new_ids[id_start + 1]) << _SHIFT32
        slots[slot, SLOT_IDS] = packed
    else:
        slots[slot, SLOT_IDS] = _append(ids, used, 1, new_ids, id_start, count)
    slots[slot, SLOT_SIZES] = np.uint64(length) | (np.uint64(count) << _SHIFT32)


@compiled(types.void(_TEXT, _ITEMS, _I64, _I64, _WORD_SLOTS, _U8, _I64, _I64))
def add_words(text, spans, new_ids, id_ends, slots, word_bytes, ids, used):  # type: ignore[no-untyped-def]
    """Add the words ``text[start:end]`` of ``spans`` (none in the table, each once) with
    their ids (``new_ids``, the ``i``-th word's ending at ``id_ends[i]``; at least one
    each). ``used`` holds the byte and id arenas' used lengths, updated; the caller made
    room in the slots and both arenas."""
    id_start = 0
    for number in range(spans.shape[0]):
        id_end = id_ends[number]
        _add_word(
            text, spans[number, 0], spans[number, 1], new_ids, id_start, id_end - id_start, slots, word_bytes, ids, used
        )
        id_start = id_end


@compiled(types.void(_WORD_SLOTS, _WORD_SLOTS))
def move_slots(old, slots):  # type: ignore[no-untyped-def]
    """Every occupied slot of ``old`` into the (empty, larger) ``slots``."""
    for row in range(old.shape[0]):
        key = old[row, SLOT_KEY]
        if key != 0:
            slot = _free_slot(slots, key)
            for column in range(4):
                slots[slot, column] = old[row, column]


# --- byte-level BPE (kvroute.tokenizer_index.bpe_merges) ------------------------------------

#: Words up to this many bytes are tokenized here (each merge step reads every pair: n^2).
BPE_MAX_BYTES = 64
_I32 = types.int32[::1]
#: A BPE's arrays: byte ids; merge keys, ranks and merged ids; the vocabulary's whole words
#: (a word table's slots and byte arena, empty but where the model has ``ignore_merges``).
_BPE = (_I64, _U64, _I32, _I32, _WORD_SLOTS, _U8)


@njit(inline="always")
def _pair_key(left, right):  # type: ignore[no-untyped-def]
    """A merge's table key: its two ids (each below 2**31) in one word, plus one (0 marks
    an empty slot)."""
    return ((np.uint64(left) << _SHIFT32) | np.uint64(right)) + _ONE


@njit(inline="always")
def _pair_slot(keys, key):  # type: ignore[no-untyped-def]
    """The slot of ``key``, or of the empty slot where it would go (``keys[slot] == 0``)."""
    mask = keys.shape[0] - 1
    slot = np.int64(fmix(key) & np.uint64(mask))
    while keys[slot] != 0 and keys[slot] != key:
        slot = (slot + 1) & mask
    return slot


@compiled(types.void(_I64, _I64, _I64, _U64, _I32, _I32))
def add_merges(lefts, rights, merged, keys, ranks, ids):  # type: ignore[no-untyped-def]
    """The merges, ranked by their order, into the (empty) table ``keys`` with their
    ``ranks`` and merged ``ids``; a pair listed twice keeps its last rank, as the library's
    map does."""
    for rank in range(lefts.shape[0]):
        key = _pair_key(lefts[rank], rights[rank])
        slot = _pair_slot(keys, key)
        keys[slot] = key
        ranks[slot] = rank
        ids[slot] = merged[rank]


@njit(inline="always")
def _bpe(text, start, end, byte_ids, keys, ranks, ids, whole_slots, whole_bytes, symbols):  # type: ignore[no-untyped-def]
    """The BPE ids of the word ``text[start:end]`` (at most ``BPE_MAX_BYTES``) into
    ``symbols``; returns how many. A word the vocabulary holds whole, where ``whole_slots``
    holds the vocabulary (``ignore_merges``), is its one id. Else each step merges the pair
    of lowest rank, the leftmost of equals: the order in which the library's heap of merges
    pops them."""
    whole = _find_word(text, start, end, whole_slots, whole_bytes)
    if whole >= 0:
        symbols[0] = np.int64(whole_slots[whole, SLOT_IDS] & _LOW32)
        return 1
    count = end - start
    for offset in range(count):
        symbols[offset] = byte_ids[text[start + offset]]
    while count > 1:
        best = -1
        best_rank = np.int64(ranks.shape[0])
        best_id = np.int64(0)
        for position in range(count - 1):
            key = _pair_key(symbols[position], symbols[position + 1])
            slot = _pair_slot(keys, key)
            if keys[slot] == key and ranks[slot] < best_rank:
                best, best_rank, best_id = position, np.int64(ranks[slot]), np.int64(ids[slot])
        if best < 0:
            break
        symbols[best] = best_id
        for position in range(best + 1, count - 1):
            symbols[position] = symbols[position + 1]
        count -= 1
    return count


@compiled(types.UniTuple(types.int64, 3)(_TEXT, _ITEMS, *_BPE, _WORD_SLOTS, _U8, _I64, _I64, _I64))
def learn_words(  # type: ignore[no-untyped-def]
    text, spans, byte_ids, keys, ranks, ids_of_merges, whole_slots, whole_bytes, slots, word_bytes, ids, used, left
):
    """Add each word ``text[start:end]`` of ``spans`` (missing from the table; one may
    come more than once) with its BPE ids, but for those longer than ``BPE_MAX_BYTES``,
    whose numbers go to ``left``; returns the words and bytes added and how many were left.
    The caller made room for every span: slots, bytes and an id per byte."""
    symbols = np.empty(BPE_MAX_BYTES, dtype=np.int64)
    added = 0
    added_bytes = 0
    long_words = 0
    for number in range(spans.shape[0]):
        start = spans[number, 0]
        end = spans[number, 1]
        if end - start > BPE_MAX_BYTES:
            left[long_words] = number
            long_words += 1
            continue
        if _find_word(text, start, end, slots, word_bytes) >= 0:  # (met earlier in the call)
            continue
        count = _bpe(text, start, end, byte_ids, keys, ranks, ids_of_merges, whole_slots, whole_bytes, symbols)
        _add_word(text, start, end, symbols, 0, count, slots, word_bytes, ids, used)
        added += 1
        added_bytes += end - start
    return added, added_bytes, long_words


# --- words to ids: the entry points (after the BPE, which word_ids runs on new words) ------

_PROGRAM = (_CLASSES, _ITEMS, _I64, _ITEMS, _ITEMS, _CMAP)


@njit  # (not inlined, and called after word_ids' loop: a call inside it made every lookup slower)
def _learn_and_fill(  # type: ignore[no-untyped-def]
    text, out_ids, out_ends, missing, missed, slots, word_bytes, ids, used, room,
    byte_ids, keys, ranks, ids_of_merges, whole_slots, whole_bytes,
):  # fmt: skip
    """Add the ``missed`` words of ``missing`` (the same one may come twice) with their BPE
    ids and write those ids in place of their placeholders in ``out_ids``, moving what
    follows (each text's end in ``out_ends``): when every one has at most
    ``BPE_MAX_BYTES`` bytes and ``room`` (words, bytes, ids the table may still take;
    counted down) holds them all. Returns whether it did (else nothing changed)."""
    total = 0
    for word in range(missed):
        length = missing[word, 1] - missing[word, 0]
        if length > BPE_MAX_BYTES:
            return False
        total += length
    if room[0] < missed or room[1] < total or room[2] < total:
        return False
    symbols = np.empty(BPE_MAX_BYTES, dtype=np.int64)
    for word in range(missed):
        start, end = missing[word, 0], missing[word, 1]
        if _find_word(text, start, end, slots, word_bytes) >= 0:  # (met earlier in the call)
            continue
        count = _bpe(text, start, end, byte_ids, keys, ranks, ids_of_merges, whole_slots, whole_bytes, symbols)
        _add_word(text, start, end, symbols, 0, count, slots, word_bytes, ids, used)
        room[0] -= 1
        room[1] -= end - start
        room[2] -= count
    # Each placeholder's word's slot (over its span) and the texts' new ends.
    grown = 0
    start = 0
    for number in range(out_ends.shape[0]):
        stop = out_ends[number]
        for position in range(start, stop):
            value = out_ids[position]
            if value < 0:
                word = -1 - value
                slot = _find_word(text, missing[word, 0], missing[word, 1], slots, word_bytes)
                missing[word, 0] = slot
                grown += np.int64(slots[slot, SLOT_SIZES] >> _SHIFT32) - 1
        out_ends[number] = stop + grown
        start = stop
    # Back to front, so nothing is overwritten before it moved (every word keeps >= 1 id).
    written = start + grown
    for position in range(start - 1, -1, -1):
        value = out_ids[position]
        if value >= 0:
            written -= 1
            out_ids[written] = value
        else:
            slot = missing[-1 - value, 0]
            written -= np.int64(slots[slot, SLOT_SIZES] >> _SHIFT32)
            _emit_slot(slot, slots, ids, out_ids, written)
    return True


@compiled(
    types.int64(
        _TEXT, _I64, types.boolean, *_PROGRAM, types.boolean, *_PROGRAM, _WORD_SLOTS, _U8, _I64,
        types.boolean, *_BPE, _I64, _I64, _I64, _I64, _ITEMS,
    )
)  # fmt: skip
def word_ids(
    text,
    text_ends,
    wide,
    split_classes,
    split_items,
    split_ends,
    split_starts,
    split_suffixes,
    split_cmap,
    split,
    classes,
    items,
    ends,
    starts,
    suffixes,
    cmap,
    slots,
    word_bytes,
    ids,
    learn,
    byte_ids,
    keys,
    ranks,
    ids_of_merges,
    whole_slots,
    whole_bytes,
    used,
    room,
    out_ids,
    out_ends,
    missing,
):  # type: ignore[no-untyped-def]
    """Cut each text (``text`` holds them one after the other as UTF-8, the ``i``-th ending
    at byte ``text_ends[i]``; ``wide``: some are not ASCII) into the program's words, as
    ``word_split._cut`` does (with ``split``, each of the pieces the split program cuts it
    into first, as a pre-tokenizer's isolating ``Split`` does), and write their ids one text
    after the other into ``out_ids`` (the ``i``-th text's end at ``out_ends[i]``).

    Words not in the table go to ``missing`` as (start, end) in bytes; returns how many
    (when any, ``out_ids`` holds placeholders in their place: :func:`_emit_word`), or -1,
    having done nothing, when a character is one the programs do not know. With ``learn``,
    the words missing are first tokenized by the BPE (``byte_ids`` to ``whole_bytes``:
    ``learn_words``' arrays), added (``used``: the arenas' used lengths) and written in
    place (:func:`_learn_and_fill`) where ``room`` allows: a request's text and its few new
    words in one call; 0 missing then."""
    if wide and not (_all_known(text, cmap) and (not split or _all_known(text, split_cmap))):
        return -1
    counts = np.empty(items.shape[0], dtype=np.int64)
    positions = np.empty(items.shape[0], dtype=np.int64)
    stops = np.empty(items.shape[0], dtype=np.int64)
    split_counts = np.empty(split_items.shape[0], dtype=np.int64)
    split_positions = np.empty(split_items.shape[0], dtype=np.int64)
    split_stops = np.empty(split_items.shape[0], dtype=np.int64)
    written = 0
    missed = 0
    start = 0
    for number in range(text_ends.shape[0]):
        stop = text_ends[number]
        piece = start
        while piece < stop:
            piece_stop = stop
            if split:
                piece_stop = _piece_end(
                    text, piece, stop, split_classes, split_items, split_ends, split_starts, split_suffixes,
                    split_cmap, split_counts, split_positions, split_stops,
                )  # fmt: skip
            at = piece
            while at < piece_stop:  # _piece_end written out: through it this loop ran 40 % slower
                end = _word_end(
                    text, at, piece_stop, classes, items, ends, starts, suffixes, cmap, counts, positions, stops
                )
                if end < 0:  # characters no alternative matches at: one word, up to where one does
                    end = at + _column(text, at, cmap)[1]
                    while end < piece_stop:
                        found = _word_end(
                            text, end, piece_stop, classes, items, ends, starts, suffixes, cmap, counts, positions,
                            stops,
                        )  # fmt: skip
                        if found >= 0:
                            break
                        end += _column(text, end, cmap)[1]
                written, missed = _emit_word(text, at, end, slots, word_bytes, ids, out_ids, written, missing, missed)
                at = end
            piece = piece_stop
        out_ends[number] = written
        start = stop
    if missed and learn:
        learned = _learn_and_fill(
            text, out_ids, out_ends, missing, missed, slots, word_bytes, ids, used, room,
            byte_ids, keys, ranks, ids_of_merges, whole_slots, whole_bytes,
        )  # fmt: skip
        if learned:
            return 0
    return missed


@compiled(types.void(_TEXT, _I64, _I64, _ITEMS, _WORD_SLOTS, _U8, _I64, _I64, _I64))
def fill_missing(text, out_ids, out_ends, missing, slots, word_bytes, ids, filled, filled_ends):  # type: ignore[no-untyped-def]
    """:func:`word_ids`' output with each placeholder replaced by its word's ids, now in
    the table, into ``filled`` (each text's end at ``filled_ends``)."""
    written = 0
    start = 0
    for number in range(out_ends.shape[0]):
        for position in range(start, out_ends[number]):
            value = out_ids[position]
            if value >= 0:
                filled[written] = value
                written += 1
            else:
                word = -1 - value
                written, _ = _emit_word(
                    text, missing[word, 0], missing[word, 1], slots, word_bytes, ids, filled, written, missing, 0
                )
        filled_ends[number] = written
        start = out_ends[number]
