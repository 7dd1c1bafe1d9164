"""Inserting a huge prompt's blocks into a prefix index a slice at a time.

One insert of a 1M-token prompt's 62K blocks holds the event loop 5-13 ms (more where it
grows the block table); a slice of :data:`INSERT_SLICE_BLOCKS` holds it ~1 ms. The slices
go towards the head, so the index ends as one insert leaves it: the head most recent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvroute.tokenizer_index import PrefixIndex

#: A prompt of more full blocks than this may be inserted in slices of this many, between
#: which the caller lets its event loop run.
INSERT_SLICE_BLOCKS = 8192


@dataclass(slots=True)
class PendingInsert:
    """The blocks of a prompt not yet in the index: those before ``end``, inserted one
    slice at a time towards the head."""

    index: PrefixIndex
    backend: str
    hashes: np.ndarray
    end: int

    def insert_next(self) -> bool:
        """Insert the next slice; True while more are left. Nothing once the backend left
        the index (it left the pool in between: no holder to recreate)."""
        if self.end and self.backend not in self.index.backends():
            self.end = 0
        if not self.end:
            return False
        start = max(0, self.end - INSERT_SLICE_BLOCKS)
        self.index.insert_hashes(self.backend, self.hashes[start : self.end])
        self.end = start
        return start > 0


def insert_blocks(index: PrefixIndex, backend: str, hashes: np.ndarray, *, sliced: bool) -> PendingInsert | None:
    """``backend`` holds these blocks now; ``sliced``: of more than INSERT_SLICE_BLOCKS
    insert only the last slice, and return the rest to insert with ``insert_next``."""
    blocks = len(hashes)
    if not sliced or blocks <= INSERT_SLICE_BLOCKS:
        index.insert_hashes(backend, hashes)
        return None
    last_slice = blocks - INSERT_SLICE_BLOCKS
    index.insert_hashes(backend, hashes[last_slice:])
    index.reserve(backend, last_slice)  # the tables grow once, not slice after slice
    return PendingInsert(index, backend, hashes, last_slice)
