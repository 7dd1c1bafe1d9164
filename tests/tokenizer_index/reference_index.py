"""A naive, obviously correct model of :class:`kvroute.tokenizer_index.PrefixIndex`.

Plain dicts and loops, no performance tricks: the property tests drive it and the real
index with the same operations and require the same answers. Its docstrings are the
semantics the real index must implement.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvroute.tokenizer_index.hashing import block_hashes


class ReferenceIndex:
    """Per backend: an LRU-ordered dict of held block hashes -> time last touched."""

    def __init__(
        self,
        block_size: int = 16,
        capacity_blocks: int | None = None,
        ttl_s: float | None = None,
        on_evict: Callable[[str, list[int]], None] | None = None,
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.block_size = block_size
        self.default_capacity = capacity_blocks
        self.ttl_s = ttl_s
        self.on_evict = on_evict
        self.clock = clock
        self.held: dict[str, OrderedDict[int, float]] = {}  # oldest first
        self.capacity: dict[str, int | None] = {}

    # --- queries -------------------------------------------------------------------

    def match(self, tokens: Sequence[int], salt: str | None = None) -> dict[str, int]:
        return self.match_hashes(block_hashes(tokens, self.block_size, salt).tolist())

    def match_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """Each backend's run of leading blocks it holds, in tokens; backends with none left out."""
        self._expire()
        result: dict[str, int] = {}
        for backend, held in self.held.items():
            run = 0
            for block in hashes:
                if block not in held:
                    break
                run += 1
            if run:
                result[backend] = run * self.block_size
        return result

    def backends(self) -> list[str]:
        self._expire()
        return list(self.held)

    def blocks(self, backend: str) -> int:
        self._expire()
        return len(self.held.get(backend, ()))

    def unique_blocks(self) -> int:
        self._expire()
        return len(set().union(*self.held.values())) if self.held else 0

    # --- updates -------------------------------------------------------------------

    def insert(self, backend: str, tokens: Sequence[int], salt: str | None = None) -> None:
        self.insert_hashes(backend, block_hashes(tokens, self.block_size, salt).tolist())

    def insert_hashes(self, backend: str, hashes: Sequence[int]) -> None:
        """Touch the blocks from the tail to the head (the head ends most recent), then
        evict the least recently used blocks while over capacity."""
        self._expire()
        held = self._backend(backend)
        now = self.clock()
        for block in reversed(hashes):
            held.pop(block, None)
            held[block] = now
        self._fit(backend)

    def remove_blocks(self, backend: str, hashes: Sequence[int]) -> None:
        """Drop exactly these blocks (no callback)."""
        self._expire()
        held = self.held.get(backend)
        if held is None:
            return
        for block in hashes:
            held.pop(block, None)

    def trim(self, backend: str, hashes: Sequence[int], keep_blocks: int) -> None:
        self.remove_blocks(backend, list(hashes)[max(0, keep_blocks) :])

    def set_capacity(self, backend: str, blocks: int | None) -> None:
        self._expire()
        self._backend(backend)
        self.capacity[backend] = blocks
        self._fit(backend)

    def clear(self, backend: str) -> None:
        """Drop every block; the backend stays, with its capacity."""
        self._expire()
        if backend in self.held:
            self.held[backend] = OrderedDict()

    def remove_backend(self, backend: str) -> None:
        """Forget the backend, capacity included."""
        self._expire()
        self.held.pop(backend, None)
        self.capacity.pop(backend, None)

    # --- internals -----------------------------------------------------------------

    def _backend(self, backend: str) -> OrderedDict[int, float]:
        if backend not in self.held:
            self.held[backend] = OrderedDict()
            self.capacity[backend] = self.default_capacity
        return self.held[backend]

    def _fit(self, backend: str) -> None:
        held = self.held[backend]
        capacity = self.capacity[backend]
        evicted: list[int] = []
        while capacity is not None and len(held) > capacity:
            block, _ = held.popitem(last=False)
            evicted.append(block)
        self._report(backend, evicted)

    def _expire(self) -> None:
        """Drop, for every backend, the blocks last touched before now - ttl (oldest first)."""
        if self.ttl_s is None:
            return
        deadline = self.clock() - self.ttl_s
        for backend, held in self.held.items():
            expired: list[int] = []
            while held:
                block, touched = next(iter(held.items()))
                if touched >= deadline:
                    break
                del held[block]
                expired.append(block)
            self._report(backend, expired)

    def _report(self, backend: str, evicted: list[int]) -> None:
        if evicted and self.on_evict is not None:
            self.on_evict(backend, evicted)
