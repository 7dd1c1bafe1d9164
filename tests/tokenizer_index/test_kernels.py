"""The compiled loops: what the tables and the index rely on beyond their own tests."""

from __future__ import annotations

import numpy as np
from numba import njit, types

from kvroute.tokenizer_index import kernels
from kvroute.tokenizer_index.bucket_table import (
    PLACEMENT_MULTIPLIER,
    PLACEMENT_SALT,
    spread,
    spread_and_count_zeros,
)


def test_spread_is_multiply_shift_of_the_salted_key() -> None:
    keys = np.array([0, 1, 2**63 + 5, 2**64 - 1, 123456789], dtype=np.uint64)
    expected = [((int(key) ^ int(PLACEMENT_SALT)) * int(PLACEMENT_MULTIPLIER) % 2**64) >> 32 for key in keys]
    placement, zeros = spread_and_count_zeros(keys)
    assert placement.tolist() == expected and zeros == 1
    assert (spread(keys) == placement).all() and int(placement.max()) < 2**32


def test_prefetch_is_a_hint_that_never_faults() -> None:
    @njit
    def prefetch_far_outside(array: np.ndarray) -> int:
        kernels.prefetch(array, -(10**9))
        kernels.prefetch(array, 10**12)
        return int(array[0])

    assert prefetch_far_outside(np.arange(4, dtype=np.uint64)) == 0


def test_compiles_in_memory_where_no_cache_can_be_written() -> None:
    namespace: dict[str, object] = {}
    exec("def double(x):\n    return 2 * x\n", namespace)
    double = kernels.compiled(types.int64(types.int64))(namespace["double"])
    assert double(21) == 42


def test_walk_reports_each_holders_run() -> None:
    """Block table of one bucket: holders 0 and 2 hold blocks 0-1, holder 0 also block 2."""
    keys = np.array([11, 12, 13, 14], dtype=np.uint64)
    flat = np.zeros(8, dtype=np.uint64)
    flat[:3] = keys[:3]
    spills = np.zeros(1, dtype=np.uint32)
    owners = np.zeros((8, 1), dtype=np.uint64)
    owners[:2, 0] = 0b101
    owners[2, 0] = 0b001
    slots = np.empty(4, dtype=np.int64)
    runs = np.zeros(64, dtype=np.int64)
    no_spread = np.uint64(0)  # multiplier 0: every key's home is bucket 0
    walked = kernels.walk(flat, spills, owners, keys, no_spread, no_spread, slots, runs)
    assert walked == 4 and slots.tolist() == [0, 1, 2, -1]
    assert runs[:3].tolist() == [3, 0, 2] and not runs[3:].any()
