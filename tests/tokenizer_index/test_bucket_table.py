"""BucketTable: keys keep their slots; spill counts let lookups pass full buckets and
leave nothing behind when keys go."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index import bucket_table
from kvroute.tokenizer_index.bucket_table import ABSENT, LOOK_UP, BucketTable, spread


def test_spills_and_unspills(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucket_table, "MAX_LOAD", 1.0)
    table = BucketTable(2, np.uint64)
    keys = np.arange(2, 17, dtype=np.uint64)  # 15 keys, 16 slots, all homed in bucket 0
    placement = np.zeros(len(keys), dtype=np.uint64)
    slots = table.add(keys, placement)
    assert len(set(slots.tolist())) == 15 and table.count == 15
    assert (table.find(keys, placement) == slots).all()
    assert table.spills.tolist() == [7, 0]  # the 7 keys in bucket 1 passed bucket 0
    table.remove(slots[:7], placement[:7])
    assert (table.find(keys[:7], placement[:7]) == -1).all()
    assert (table.find(keys[7:], placement[7:]) == slots[7:]).all()
    table.remove(slots[7:], placement[7:])
    assert table.spills.sum() == 0 and not table.flat.any() and table.count == 0


def test_spills_wrap_around_the_last_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucket_table, "MAX_LOAD", 1.0)
    table = BucketTable(3, np.uint32)
    keys = np.arange(1, 13, dtype=np.uint32)
    last_bucket = np.full(len(keys), (2 << 32) // 3 + 1, dtype=np.uint64)  # home: bucket 2
    slots = table.add(keys, last_bucket)
    assert sorted(slot // 8 for slot in slots.tolist()) == [0] * 4 + [2] * 8
    assert (table.find(keys, last_bucket) == slots).all()
    table.remove(slots, last_bucket)
    assert table.spills.sum() == 0 and table.count == 0


def test_find_or_add_adds_a_repeated_key_once_and_honours_markers() -> None:
    table = BucketTable(4, np.uint64)
    first = table.add(np.array([5], dtype=np.uint64), spread(np.array([5], dtype=np.uint64)))
    keys = np.array([5, 9, 9, 11], dtype=np.uint64)
    slots = np.array([LOOK_UP, LOOK_UP, LOOK_UP, ABSENT], dtype=np.int64)
    added = np.zeros(4, dtype=np.bool_)
    assert table.find_or_add(keys, spread(keys), slots, added) == 2
    assert slots[0] == first[0] and slots[1] == slots[2]
    assert added.tolist() == [False, True, False, True]
    assert table.count == 3


def test_a_full_table_refuses_instead_of_passing_its_load() -> None:
    table = BucketTable(1, np.uint64)  # 8 slots, room for 4 at 60 %
    keys = np.arange(1, 7, dtype=np.uint64)
    with pytest.raises(ValueError, match="no room"):
        table.add(keys, spread(keys))
    assert table.count == 4 and table.room() == 0
    assert (table.find(keys[:4], spread(keys[:4])) >= 0).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=120))
def test_matches_a_python_set(operations: list[tuple[bool, int]]) -> None:
    """Random adds and removes in a tiny table: find answers like a set, slots stay put."""
    table = BucketTable(8, np.uint64)
    model: dict[int, int] = {}
    for add, key in operations:
        keys = np.array([key], dtype=np.uint64)
        placement = spread(keys) & np.uint64(0xFF)  # few distinct homes: long spill runs
        if add and key not in model and table.room():
            model[key] = int(table.add(keys, placement)[0])
        elif not add and key in model:
            table.remove(np.array([model.pop(key)], dtype=np.int64), placement)
        every = np.arange(1, 41, dtype=np.uint64)
        found = table.find(every, spread(every) & np.uint64(0xFF))
        assert {int(k): int(s) for k, s in zip(every, found) if s >= 0} == model
    assert table.count == len(model)
