"""The replica's prefix cache: real full blocks over real token ids, LRU, tail first.

A single-backend :class:`tokenizer_index.PrefixIndex` does the bookkeeping (chained block
hashes, LRU that drops a sequence's last blocks before its first, capacity in blocks);
this module adds what an engine does around it: counting stored blocks, and turning
stores, evictions and resets into vLLM KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.sim_engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
)
from tokenizer_index import PrefixIndex
from tokenizer_index.hashing import block_hashes

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
        self, block_size: int, num_blocks: int, publisher: KVEventPublisher | None = None
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._publisher = publisher
        self._index = PrefixIndex(
            block_size=block_size, capacity_blocks=num_blocks, on_evict=self._on_evict
        )
        # Evictions that happen inside one insert, so they can be ordered around its store.
        self._evicted: list[np.ndarray] = []

    @property
    def blocks(self) -> int:
        """Blocks held now."""
        return self._index.blocks(SELF)

    def hashes(self, tokens: Sequence[int] | np.ndarray, key: CacheKey) -> np.ndarray:
        """Chained hashes of the full blocks of ``tokens`` (uint64)."""
        return block_hashes(tokens, self.block_size, key.salt)

    def cached_blocks(self, hashes: np.ndarray) -> int:
        """How many leading blocks of this sequence the cache holds."""
        if len(hashes) == 0:
            return 0
        return self._index.match_hashes(hashes).get(SELF, 0) // self.block_size

    def store(
        self,
        hashes: np.ndarray,
        tokens: Sequence[int] | np.ndarray,
        num_blocks: int,
        key: CacheKey,
    ) -> None:
        """The first ``num_blocks`` blocks of this sequence are computed: hold (and touch) them.

        Blocks new to the cache are announced with one ``BlockStored``; blocks pushed out to
        make room with ``BlockRemoved`` (before the store, as an engine frees before it
        allocates). A sequence longer than the whole cache keeps only its head.
        """
        count = min(num_blocks, len(hashes), self.num_blocks)
        if count <= 0:
            return
        held = self.cached_blocks(hashes[:count])
        self._index.insert_hashes(SELF, hashes[:count])
        evicted, self._evicted = self._evicted, []
        if self._publisher is None:
            return
        new = hashes[held:count]
        new_set = set(new.tolist()) if evicted else set()
        late_removed: list[int] = []
        early_removed: list[int] = []
        for batch in evicted:
            for block in batch.tolist():
                (late_removed if block in new_set else early_removed).append(block)
        if early_removed:
            self._publisher.add(BlockRemoved(block_hashes=early_removed))
        if len(new):
            self._publisher.add(self._stored_event(hashes, tokens, held, count, key))
        if late_removed:
            self._publisher.add(BlockRemoved(block_hashes=late_removed))

    def clear(self) -> None:
        """Drop every block (``/reset_prefix_cache``) and announce ``AllBlocksCleared``."""
        self._index.clear(SELF)
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
        token_ids = np.asarray(tokens[first * size : end * size]).tolist()
        return BlockStored(
            block_hashes=hashes[first:end].tolist(),
            parent_block_hash=int(hashes[first - 1]) if first > 0 else None,
            token_ids=token_ids,
            block_size=size,
            lora_id=key.lora_id,
            lora_name=key.lora_name,
            extra_keys=_extra_keys(key, first, end),
        )

    def _on_evict(self, backend: str, evicted: np.ndarray) -> None:
        if self._publisher is None or len(evicted) == 0:
            return
        self._evicted.append(np.asarray(evicted, dtype=np.uint64).copy())


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
