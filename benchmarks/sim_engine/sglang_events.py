"""KV events as SGLang publishes them (``disaggregation/kv_events.py``, ``mem_cache/radix_cache.py``).

The framing and the positional event layout are vLLM's (:mod:`.kv_events`); what differs:

* one ``BlockStored`` per page (``block_size`` = page size: at page size 1, one per token)
  and one ``BlockRemoved`` per evicted page;
* SGLang's own block hashes, newer scheme: SHA-256 over the parent page's digest followed by
  the page's token ids as little-endian uint32, published as the digest's first 8 bytes,
  big-endian, signed int64; ``parent_block_hash`` is the previous page's (None for the first).

A router cannot recompute these without SGLang's code, so it re-hashes ``token_ids`` and
maps SGLang's hashes to its own, as it does for vLLM's (``kvroute.router.routing.precise_index``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvroute.benchmarks.sim_engine.kv_events import BlockRemoved, BlockStored


def page_digest(parent: bytes | None, tokens: Sequence[int] | np.ndarray) -> bytes:
    """SHA-256 of the parent digest followed by the page's tokens as little-endian uint32."""
    return hashlib.sha256((parent or b"") + np.asarray(tokens, dtype="<u4").tobytes()).digest()


def published_hash(digest: bytes) -> int:
    """The int64 SGLang publishes for a page: its digest's first 8 bytes, big-endian, signed."""
    return int.from_bytes(digest[:8], "big", signed=True)


class SGLangEventHashes:
    """The simulator's block hashes -> SGLang's page digests, for the pages the cache holds."""

    def __init__(self) -> None:
        self._digests: dict[int, bytes] = {}

    def stored(
        self,
        hashes: np.ndarray,
        tokens: Sequence[int] | np.ndarray,
        first: int,
        end: int,
        page_size: int,
        lora_id: int | None,
    ) -> list[BlockStored]:
        """One ``BlockStored`` per page ``first..end-1`` of this sequence."""
        keys = hashes.tolist()
        parent = self._digest_of(keys, tokens, first - 1, page_size) if first > 0 else None
        events = []
        for page in range(first, end):
            page_tokens = np.asarray(tokens[page * page_size : (page + 1) * page_size]).tolist()
            digest = page_digest(parent, page_tokens)
            self._digests[keys[page]] = digest
            events.append(
                BlockStored(
                    block_hashes=[published_hash(digest)],
                    parent_block_hash=published_hash(parent) if parent is not None else None,
                    token_ids=page_tokens,
                    block_size=page_size,
                    lora_id=lora_id,
                )
            )
            parent = digest
        return events

    def removed(self, evicted: Sequence[int]) -> list[BlockRemoved]:
        """One ``BlockRemoved`` per evicted page, under the hash it was stored with."""
        events = []
        for block in evicted:
            digest = self._digests.pop(block, None)
            if digest is not None:
                events.append(BlockRemoved(block_hashes=[published_hash(digest)]))
        return events

    def clear(self) -> None:
        self._digests.clear()

    def _digest_of(self, keys: list[int], tokens: Sequence[int] | np.ndarray, page: int, page_size: int) -> bytes:
        """The digest of ``page`` (held, or recomputed along the chain from the first page)."""
        digest = self._digests.get(keys[page])
        if digest is not None:
            return digest
        parent = self._digest_of(keys, tokens, page - 1, page_size) if page > 0 else None
        return page_digest(parent, np.asarray(tokens[page * page_size : (page + 1) * page_size]).tolist())
