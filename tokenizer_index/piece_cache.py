"""A bounded LRU from text pieces to their token ids, sized in bytes.

The request tokenizer cuts each rendered prompt at added-token boundaries and memoises every
piece here, so a conversation's next turn only tokenizes its new text. The key is the piece
itself: the dict hashes it (SipHash, about 2 GB/s, computed once per piece string) and a hit
is confirmed by comparing the text, so a lookup can never return another piece's ids.

A piece's ids are kept as a read-only int64 array: the router joins a prompt's pieces with
one ``np.concatenate`` and hashes the result without converting a Python list (which costs
more than hashing). Callers that want a Python list get one built on their first lookup of a
piece and kept beside the array (its int objects shared with the tokenizer's vocabulary, so
a list costs one 8-byte pointer per token); callers of arrays alone never pay for lists.
Every byte held, arrays and lists, is charged against the bound.

Thread-safe: the router may tokenize large prompts in a worker thread.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Bytes an entry costs beyond its text and its ids: the ordered dict's hash slot, its link
# node and the key/value references.
ENTRY_OVERHEAD_BYTES = 100
# Bytes a piece's list form costs beyond the list object: its slot in the dict of lists.
LIST_OVERHEAD_BYTES = 50
#: Ids :func:`join_ids` copies per numpy call at most. Each call holds the GIL: one join of
#: a 1M-token document's 6,700 chunk arrays held it ~13 ms, the event loop's stall while a
#: worker thread prepared that prompt; 64K ids hold it well under a millisecond.
JOIN_SLICE_IDS = 1 << 16
# An int64 array object without its data (``sys.getsizeof`` of an owning array is this + nbytes).
_ARRAY_OBJECT_BYTES = sys.getsizeof(np.empty(0, dtype=np.int64))


def entry_bytes(piece: str, ids: np.ndarray) -> int:
    """The bytes one cached piece is charged against the bound (objects as allocated)."""
    return ENTRY_OVERHEAD_BYTES + sys.getsizeof(piece) + _ARRAY_OBJECT_BYTES + ids.nbytes


def list_bytes(ids: list[int]) -> int:
    """The bytes a piece's list form adds (its ints are shared, so only the pointers count)."""
    return LIST_OVERHEAD_BYTES + sys.getsizeof(ids)


def frozen_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as the read-only int64 array the cache holds (shared by every later lookup)."""
    array = np.array(ids, dtype=np.int64)
    array.flags.writeable = False
    return array


def join_ids(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays`` of ids (int64 or int32) joined into one new int64 array, at most :data:`JOIN_SLICE_IDS` ids
    copied per numpy call (so another thread may run between them)."""
    total = sum(map(len, arrays))
    if total <= JOIN_SLICE_IDS:
        return np.concatenate(arrays, dtype=np.int64) if arrays else np.empty(0, dtype=np.int64)
    joined = np.empty(total, dtype=np.int64)
    group: list[np.ndarray] = []
    grouped = 0  # ids in group
    position = 0  # where group goes
    for array in arrays:
        if grouped + len(array) > JOIN_SLICE_IDS and group:
            np.concatenate(group, out=joined[position : position + grouped])
            position += grouped
            group, grouped = [], 0
        if len(array) <= JOIN_SLICE_IDS:
            group.append(array)
            grouped += len(array)
            continue
        for start in range(0, len(array), JOIN_SLICE_IDS):  # a long run: copied slice by slice
            part = array[start : start + JOIN_SLICE_IDS]
            joined[position : position + len(part)] = part
            position += len(part)
    if group:
        np.concatenate(group, out=joined[position:])
    return joined


@dataclass(frozen=True, slots=True)
class PieceCacheStats:
    """A snapshot of the cache's size and counters."""

    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    evictions: int


class PieceCache:
    """LRU of piece text -> token ids, holding at most ``max_bytes`` (0 disables it).

    ``to_list`` turns a cached array into the list :meth:`get_lists` hands out (the
    tokenizer passes one that shares its vocabulary's int objects).
    """

    def __init__(self, max_bytes: int, *, to_list: Callable[[np.ndarray], list[int]] = np.ndarray.tolist) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._to_list = to_list
        self._arrays: OrderedDict[str, np.ndarray] = OrderedDict()  # in LRU order
        self._lists: dict[str, list[int]] = {}  # list forms of some of the cached pieces
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._arrays)

    def get_arrays(self, pieces: Sequence[str]) -> list[np.ndarray | None]:
        """Look up every piece at once (one lock round trip); hits become most recently used.

        The arrays are read-only and shared: copy before changing one.
        """
        found: list[np.ndarray | None] = []
        append = found.append
        with self._lock:
            arrays = self._arrays
            get = arrays.get
            touch = arrays.move_to_end
            hits = 0
            for piece in pieces:
                ids = get(piece)
                if ids is not None:
                    touch(piece)
                    hits += 1
                append(ids)
            self._count(hits, len(pieces))
        return found

    def get_lists(self, pieces: Sequence[str]) -> list[list[int] | None]:
        """Like :meth:`get_arrays`, as lists; a hit's list is built and kept on first use.

        The lists are shared: the caller must not mutate them.
        """
        found: list[list[int] | None] = []
        append = found.append
        with self._lock:
            arrays = self._arrays
            lists = self._lists
            touch = arrays.move_to_end
            hits = 0
            added = 0
            for piece in pieces:
                ids = lists.get(piece)
                if ids is None:
                    array = arrays.get(piece)
                    if array is not None:
                        ids = lists[piece] = self._to_list(array)
                        added += list_bytes(ids)
                if ids is not None:
                    touch(piece)
                    hits += 1
                append(ids)
            self._count(hits, len(pieces))
            if added:
                self._bytes += added
                self._evict()
        return found

    def put_many(self, items: Iterable[tuple[str, np.ndarray, list[int] | None]]) -> None:
        """Insert ``(piece, ids array, ids list or None)``, then evict down to the bound.

        Arrays should come from :func:`frozen_ids` (read-only); the caller must not mutate a
        list after handing it over. A piece larger than the whole bound is not cached.
        """
        if self.max_bytes == 0:
            return
        with self._lock:
            arrays = self._arrays
            lists = self._lists
            for piece, array, as_list in items:
                cost = entry_bytes(piece, array) + (0 if as_list is None else list_bytes(as_list))
                if cost > self.max_bytes:
                    continue
                self._forget(piece)
                arrays[piece] = array
                if as_list is not None:
                    lists[piece] = as_list
                self._bytes += cost
            self._evict()

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        with self._lock:
            self._arrays.clear()
            self._lists.clear()
            self._bytes = 0

    def stats(self) -> PieceCacheStats:
        """Current size and counters."""
        with self._lock:
            return PieceCacheStats(
                entries=len(self._arrays),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )

    def measured_bytes(self) -> int:
        """The memory the entries really hold, measured object by object (slow: for tests)."""
        with self._lock:
            total = sys.getsizeof(self._arrays) + sys.getsizeof(self._lists)
            for piece, array in self._arrays.items():
                total += sys.getsizeof(piece) + sys.getsizeof(array)
            for as_list in self._lists.values():
                total += sys.getsizeof(as_list)
            return total

    # --- under the lock ----------------------------------------------------------------------

    def _count(self, hits: int, lookups: int) -> None:
        self._hits += hits
        self._misses += lookups - hits

    def _forget(self, piece: str) -> None:
        """Remove ``piece`` (both forms) and its charge, if it is cached."""
        array = self._arrays.pop(piece, None)
        if array is None:
            return
        self._bytes -= entry_bytes(piece, array)
        as_list = self._lists.pop(piece, None)
        if as_list is not None:
            self._bytes -= list_bytes(as_list)

    def _evict(self) -> None:
        """Drop least recently used pieces until the cache is within its bound."""
        arrays = self._arrays
        while self._bytes > self.max_bytes and arrays:
            self._forget(next(iter(arrays)))
            self._evictions += 1
