"""piece_cache: joining id arrays a slice at a time."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvroute.tokenizer_index import piece_cache
from kvroute.tokenizer_index.piece_cache import join_ids

# Lengths around the slice size (shrunk to 64 below), many small ones, and long runs.
LENGTHS = st.lists(st.one_of(st.integers(0, 8), st.integers(60, 70), st.integers(120, 300)), max_size=40)


@given(lengths=LENGTHS)
def test_joined_in_slices_equals_one_concatenate(lengths: list[int]) -> None:
    piece_cache_slice = piece_cache.JOIN_SLICE_IDS
    piece_cache.JOIN_SLICE_IDS = 64
    try:
        start = 0
        arrays = []
        for length in lengths:
            arrays.append(np.arange(start, start + length, dtype=np.int64))
            start += length
        for array in arrays:
            array.flags.writeable = False  # as the cache holds them
        joined = join_ids(arrays)
    finally:
        piece_cache.JOIN_SLICE_IDS = piece_cache_slice
    assert joined.dtype == np.int64 and joined.flags.writeable
    assert np.array_equal(joined, np.arange(start, dtype=np.int64))
    assert all(not np.shares_memory(joined, array) for array in arrays if len(array))
