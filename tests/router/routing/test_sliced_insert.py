"""Inserting a prompt's blocks a slice at a time ends as one insert leaves the index."""

from __future__ import annotations

import numpy as np
import pytest

from kvroute.router.routing import sliced_insert
from kvroute.router.routing.sliced_insert import insert_blocks
from kvroute.tokenizer_index import PrefixIndex

BACKEND = "http://b0"


def hashes(first: int, count: int) -> np.ndarray:
    return np.arange(first, first + count, dtype=np.uint64)


def test_short_prompts_and_unsliced_inserts_go_in_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    index = PrefixIndex(block_size=16)
    assert insert_blocks(index, BACKEND, hashes(1, 4), sliced=True) is None
    assert insert_blocks(index, BACKEND, hashes(100, 10), sliced=False) is None
    assert index.blocks(BACKEND) == 14


def test_slices_go_towards_the_head_and_leave_the_lru_order_of_one_insert(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 10-block prompt fills both indexes; 4 new blocks then evict the same 4 of it in
    each: its tail, least recently used as after one insert (head first, the slices would
    leave the head the oldest and lose it)."""
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    whole, sliced = PrefixIndex(block_size=16), PrefixIndex(block_size=16)
    prompt = hashes(1, 10)
    for index in (whole, sliced):
        index.set_capacity(BACKEND, 10)
    whole.insert_hashes(BACKEND, prompt)
    pending = insert_blocks(sliced, BACKEND, prompt, sliced=True)
    assert pending is not None and sliced.blocks(BACKEND) == 4
    steps = [pending.end]
    while pending.insert_next():
        steps.append(pending.end)
    assert steps == [6, 2] and pending.end == 0 and not pending.insert_next()
    for index in (whole, sliced):
        index.insert_hashes(BACKEND, hashes(500, 4))
    assert whole.match_hashes(prompt) == sliced.match_hashes(prompt) == {BACKEND: 6 * 16}


def test_no_slice_goes_to_a_backend_that_left_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    index = PrefixIndex(block_size=16)
    pending = insert_blocks(index, BACKEND, hashes(1, 10), sliced=True)
    assert pending is not None
    index.remove_backend(BACKEND)
    assert not pending.insert_next() and pending.end == 0
    assert BACKEND not in index.backends()
