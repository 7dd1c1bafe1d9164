"""A bounded LRU from text pieces to their token ids, sized in bytes.

The request tokenizer cuts each rendered prompt at added-token boundaries and memoises every
piece here, so a conversation's next turn only tokenizes its new text. The key is the piece
itself: the dict hashes it (SipHash, about 2 GB/s, computed once per piece string) and a hit
is confirmed by comparing the text, so a lookup can never return another piece's ids. Values
are lists of token ids whose int objects are shared with the tokenizer's vocabulary, so a
cached token costs one 8-byte pointer next to its text (about one byte per character).

Thread-safe: the router may tokenize large prompts in a worker thread.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Bytes an entry costs beyond its text and its list of ids: the ordered dict's hash slot,
# its link node and the key/value references.
ENTRY_OVERHEAD_BYTES = 100


def entry_bytes(piece: str, ids: list[int]) -> int:
    """The bytes one cached piece is charged against the bound (objects as allocated)."""
    return ENTRY_OVERHEAD_BYTES + sys.getsizeof(piece) + sys.getsizeof(ids)


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
    """LRU of piece digest -> token ids, holding at most ``max_bytes`` (0 disables it)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, pieces: Sequence[str]) -> list[list[int] | None]:
        """Look up every piece at once (one lock round trip); hits become most recently used."""
        found: list[list[int] | None] = []
        append = found.append
        with self._lock:
            entries = self._entries
            get = entries.get
            touch = entries.move_to_end
            hits = 0
            for piece in pieces:
                ids = get(piece)
                if ids is not None:
                    touch(piece)
                    hits += 1
                append(ids)
            self._hits += hits
            self._misses += len(pieces) - hits
        return found

    def put_many(self, items: Sequence[tuple[str, list[int]]]) -> None:
        """Insert pieces, then evict least recently used ones until within the byte bound.

        A piece larger than the whole bound is not cached. The caller must not mutate a list
        after handing it over: it is shared with later lookups.
        """
        if self.max_bytes == 0:
            return
        with self._lock:
            entries = self._entries
            for piece, ids in items:
                cost = entry_bytes(piece, ids)
                if cost > self.max_bytes:
                    continue
                previous = entries.pop(piece, None)
                if previous is not None:
                    self._bytes -= entry_bytes(piece, previous)
                entries[piece] = ids
                self._bytes += cost
            while self._bytes > self.max_bytes:
                evicted_piece, evicted = entries.popitem(last=False)
                self._bytes -= entry_bytes(evicted_piece, evicted)
                self._evictions += 1

    def clear(self) -> None:
        """Drop every entry (the counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> PieceCacheStats:
        """Current size and counters."""
        with self._lock:
            return PieceCacheStats(
                entries=len(self._entries),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )

    def measured_bytes(self) -> int:
        """The memory the entries really hold, measured object by object (slow: for tests)."""
        with self._lock:
            total = sys.getsizeof(self._entries)
            for piece, ids in self._entries.items():
                total += sys.getsizeof(piece) + sys.getsizeof(ids)
            return total
