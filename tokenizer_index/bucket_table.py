"""A set of integer keys with stable slot numbers: open addressing over 8-slot buckets.

The prefix index's storage (:mod:`kvroute.tokenizer_index.prefix_index`): one table names every
held block by its hash, and each backend has a table of the block slots it holds. Callers
keep per-slot data in arrays of length :attr:`BucketTable.slots`, so a key must keep its
slot for as long as it is in the table: a key never moves once placed.

A key lives in its *home bucket* (picked by its placement value, see :func:`spread`), or,
if that bucket was full when the key came, in the next bucket with room. ``spills[b]``
counts the keys that passed bucket ``b`` that way, so a lookup reads one bucket (8 keys:
one cache line of uint64 keys) for nearly every key, and goes on only past buckets whose
count is not zero. Deleting a key zeroes its slot and takes it off the counts it added:
no tombstones, no cleanup. Key 0 marks an empty slot (so keys must be nonzero): adding a
key reads the same cache line as looking it up.

The loops over keys are compiled: :mod:`kvroute.tokenizer_index.kernels`.
"""

from __future__ import annotations

import math
import os

import numpy as np

from kvroute.tokenizer_index import kernels
from kvroute.tokenizer_index.kernels import ABSENT, BUCKET, LOOK_UP

__all__ = ["ABSENT", "BUCKET", "LOOK_UP", "BucketTable", "buckets_for", "spread", "spread_and_count_zeros"]

MAX_LOAD = 0.6  # a table is grown when it would fill past this ...
TARGET_LOAD = 0.4  # ... to this fill

# Per-process secret placement of keys into buckets (odd multiplier for multiply-shift).
PLACEMENT_SALT = np.frombuffer(os.urandom(8), dtype=np.uint64)[0]
PLACEMENT_MULTIPLIER = np.frombuffer(os.urandom(8), dtype=np.uint64)[0] | np.uint64(1)


def spread(keys: np.ndarray) -> np.ndarray:
    """A 32-bit placement value per key (uint64 in, uint64 out), shared by every table.

    Multiply-shift over the key xor this process's secret salt: whoever can choose block
    hashes still cannot pile them into one bucket. The prefix index computes it once per
    call from the block hashes and hands it to the block table and the backend tables
    (each reduces it to its own size).
    """
    return spread_and_count_zeros(keys)[0]


def spread_and_count_zeros(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """:func:`spread` of ``keys`` (C-contiguous uint64) and how many of them are 0 (which
    no table may hold), in one pass."""
    placement = np.empty(len(keys), dtype=np.uint64)
    zeros = kernels.spread_keys(keys, placement, PLACEMENT_SALT, PLACEMENT_MULTIPLIER)
    return placement, zeros


def buckets_for(entries: int) -> int:
    """Buckets for a table that should hold ``entries`` keys at the target load."""
    return max(1, math.ceil(entries / (BUCKET * TARGET_LOAD)))


class BucketTable:
    """The table: ``flat`` keys (uint64 or uint32, 0 = empty) and ``spills`` per bucket."""

    __slots__ = ("count", "flat", "spills")

    def __init__(self, buckets: int, dtype: type[np.unsignedinteger]) -> None:
        self.flat = np.zeros(buckets * BUCKET, dtype=dtype)
        self.spills = np.zeros(buckets, dtype=np.uint32)
        #: Keys in the table.
        self.count = 0

    @property
    def slots(self) -> int:
        return len(self.flat)

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + self.spills.nbytes

    def room(self) -> int:
        """Keys that can still be added before the table passes its maximum load."""
        return max(0, int(MAX_LOAD * self.slots) - self.count)

    def live(self) -> np.ndarray:
        """Slots holding a key."""
        return np.flatnonzero(self.flat)

    def find(self, keys: np.ndarray, placement: np.ndarray) -> np.ndarray:
        """Slot of each key (int64), -1 where absent."""
        found = np.empty(len(keys), dtype=np.int64)
        kernels.find(self.flat, self.spills, keys, placement, found)
        return found

    def find_or_add(self, keys: np.ndarray, placement: np.ndarray, slots: np.ndarray, added: np.ndarray) -> int:
        """Fill ``slots`` in place: positions holding :data:`LOOK_UP` are looked up and, if
        absent, added; :data:`ABSENT` ones (absent, and not repeated in the batch: the
        caller knows) are added without a lookup; slots >= 0 are kept. Marks ``added``
        where a key was added (a looked-up key repeated in the batch is added once) and
        returns how many were. The caller makes room first (:meth:`room`): a table
        never fills past its maximum load, so a full one raises instead.
        """
        stopped, count = kernels.find_or_add(self.flat, self.spills, keys, placement, slots, added, self.room())
        self.count += count
        if stopped != len(keys):
            raise ValueError(f"no room for more keys in a table of {self.slots} slots holding {self.count}")
        return int(count)

    def add(self, keys: np.ndarray, placement: np.ndarray) -> np.ndarray:
        """Insert keys known to be absent into a table with room for them; their slots."""
        slots = np.full(len(keys), ABSENT, dtype=np.int64)
        added = np.zeros(len(keys), dtype=np.bool_)
        self.find_or_add(keys, placement, slots, added)
        return slots

    def remove(self, slots: np.ndarray, placement: np.ndarray) -> None:
        """Empty these (distinct, occupied) slots; ``placement``: :func:`spread` of their keys."""
        kernels.remove(self.flat, self.spills, slots, placement)
        self.count -= len(slots)
