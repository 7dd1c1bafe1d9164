"""The replica's prefix cache: real full blocks over real token ids, LRU, tail first.

A single-backend :class:`kvroute.tokenizer_index.PrefixIndex` owns the LRU order, the capacity
and every eviction decision (it drops a sequence's last blocks before its first, and
never a parent before its child). Beside it the cache keeps the set of block hashes it
holds, updated from the index's ``on_evict``: membership is then an O(1) set lookup per
block, so a request's prefix lookup and "which of these blocks are new" cost no index
call, and every ``BlockRemoved`` pairs with exactly one earlier ``BlockStored``. Stores
are indexed in batches (one insert per scheduler step, see :meth:`PrefixCache.flush`):
the index's cost is per call far more than per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvroute.benchmarks.sim_engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from kvroute.benchmarks.sim_engine.sglang_events import SGLangEventHashes
from kvroute.tokenizer_index import PrefixIndex
from kvroute.tokenizer_index.hashing import block_hashes

#: The one backend name of the single-replica index.
SELF = "self"


@dataclass(frozen=True, slots=True)
class CacheKey:
    """What besides the tokens decides whether two requests may share blocks."""

    salt: str
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class PrefixCache:
    """Full-block prefix cache of one replica, publishing KV events when configured."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        publisher: KVEventPublisher | None = None,
        sglang_events: SGLangEventHashes | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._publisher = publisher
        # SGLang's event style (a page per event, its own hashes) instead of vLLM's.
        self._sglang = sglang_events
        self._index = PrefixIndex(block_size=block_size, capacity_blocks=num_blocks, on_evict=self._on_evict)
        self._held: set[int] = set()
        # Runs of blocks stored since the last flush, oldest first, not yet touched.
        self._untouched: list[np.ndarray] = []
        # Blocks evicted during the current insert, announced after it.
        self._evicted: list[int] = []

    @property
    def blocks(self) -> int:
        """Blocks held now."""
        return len(self._held)

    @property
    def index_blocks(self) -> int:
        """Blocks the underlying index holds (always equal to :attr:`blocks`)."""
        return self._index.blocks(SELF)

    def hashes(self, tokens: Sequence[int] | np.ndarray, key: CacheKey) -> np.ndarray:
        """Chained hashes of the full blocks of ``tokens`` (uint64)."""
        return block_hashes(tokens, self.block_size, key.salt)

    def cached_blocks(self, hashes: np.ndarray) -> int:
        """How many leading blocks of this sequence the cache holds."""
        held = self._held
        count = 0
        for block in hashes.tolist():
            if block not in held:
                break
            count += 1
        return count

    def store(
        self,
        hashes: np.ndarray,
        tokens: Sequence[int] | np.ndarray,
        num_blocks: int,
        key: CacheKey,
    ) -> None:
        """The first ``num_blocks`` blocks of this sequence are computed: hold them.

        New blocks are cached (and announced with ``BlockStored``) at once; the LRU touch
        of the whole run waits for :meth:`flush`, which indexes every run stored since the
        last flush in one insert. A sequence longer than the whole cache keeps its head.
        """
        count = min(num_blocks, len(hashes), self.num_blocks)
        if count <= 0:
            return
        first_new = self.cached_blocks(hashes[:count])
        if first_new < count:
            self._held.update(hashes[first_new:count].tolist())
            if self._publisher is not None:
                if self._sglang is not None:
                    for event in self._sglang.stored(hashes, tokens, first_new, count, self.block_size, key.lora_id):
                        self._publisher.add(event)
                else:
                    self._publisher.add(self._stored_event(hashes, tokens, first_new, count, key))
        self._untouched.append(hashes[:count])

    def flush(self) -> None:
        """Touch the runs stored since the last flush (later ones more recent), evict down
        to the capacity, and announce what was evicted with one ``BlockRemoved``.

        Runs are concatenated newest first and deduplicated keeping first occurrences, so
        along the array every block comes after its parent: one insert's tail-first ticks
        then keep each parent more recent than its children, as separate inserts would.
        """
        if not self._untouched:
            return
        runs, self._untouched = self._untouched, []
        keys = runs[0] if len(runs) == 1 else np.concatenate(runs[::-1])
        if len(runs) > 1:
            _, first = np.unique(keys, return_index=True)
            keys = keys[np.sort(first)]
        self._index.insert_hashes(SELF, keys)
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            if self._publisher is not None:
                if self._sglang is not None:
                    for event in self._sglang.removed(evicted):
                        self._publisher.add(event)
                else:
                    self._publisher.add(BlockRemoved(block_hashes=evicted))

    def clear(self) -> None:
        """Drop every block (``/reset_prefix_cache``) and announce ``AllBlocksCleared``."""
        self._index.clear(SELF)
        self._held.clear()
        self._untouched.clear()
        if self._sglang is not None:
            self._sglang.clear()
        if self._publisher is not None:
            self._publisher.add(AllBlocksCleared())

    def _stored_event(
        self,
        hashes: np.ndarray,
        tokens: Sequence[int] | np.ndarray,
        first: int,
        end: int,
        key: CacheKey,
    ) -> BlockStored:
        size = self.block_size
        return BlockStored(
            block_hashes=hashes[first:end].tolist(),
            parent_block_hash=int(hashes[first - 1]) if first > 0 else None,
            token_ids=np.asarray(tokens[first * size : end * size]).tolist(),
            block_size=size,
            lora_id=key.lora_id,
            lora_name=key.lora_name,
            extra_keys=_extra_keys(key, first, end),
        )

    def _on_evict(self, backend: str, evicted: np.ndarray) -> None:
        blocks = evicted.tolist()
        self._held.difference_update(blocks)
        self._evicted.extend(blocks)


def _extra_keys(key: CacheKey, first: int, end: int) -> list[tuple[str, ...] | None] | None:
    """vLLM's per-block extra hash keys: the LoRA name on every block, cache_salt on block 0."""
    if key.lora_name is None and key.cache_salt is None:
        return None
    keys: list[tuple[str, ...] | None] = []
    for block in range(first, end):
        parts: list[str] = []
        if key.lora_name is not None:
            parts.append(key.lora_name)
        if block == 0 and key.cache_salt is not None:
            parts.append(key.cache_salt)
        keys.append(tuple(parts) if parts else None)
    return keys
