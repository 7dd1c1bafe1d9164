"""Chained block hashes: prefix property, salts, incremental chaining, input forms."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index.hashing import block_hashes, chain_hash, salt_seed

TOKEN_LISTS = st.lists(st.integers(0, 2**31 - 1), max_size=200)
SIZES = st.sampled_from([1, 2, 3, 16, 32])


MASK64 = 2**64 - 1
K = 0x9E3779B97F4A7C15  # the chain multiplier the hashing module documents


def fmix(value: int) -> int:
    """splitmix64's finalizer, written out again here."""
    value ^= value >> 30
    value = value * 0xBF58476D1CE4E5B9 & MASK64
    value ^= value >> 27
    value = value * 0x94D049BB133111EB & MASK64
    return value ^ (value >> 31)


def naive_block_hashes(tokens: list[int], block_size: int, salt: str | None) -> list[int]:
    """The documented construction, one Python step at a time: c_j = fmix(block_j . P),
    r_i = K * r_{i-1} + c_i from r_{-1} = seed(salt), h_i = fmix(r_i)."""
    multipliers = [fmix((column + 1) * K & MASK64) | 1 for column in range(block_size)]
    chain, hashes = salt_seed(salt), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        content = fmix(sum(token * multiplier for token, multiplier in zip(block, multipliers)) & MASK64)
        chain = (K * chain + content) & MASK64
        hashes.append(fmix(chain))
    return hashes


@settings(max_examples=200, deadline=None)
@given(tokens=TOKEN_LISTS, block_size=SIZES, salt=st.sampled_from([None, "m", "lora:x"]))
def test_compiled_chain_equals_the_documented_construction(
    tokens: list[int], block_size: int, salt: str | None
) -> None:
    hashes = block_hashes(tokens, block_size, salt)
    assert hashes.dtype == np.uint64
    assert len(hashes) == len(tokens) // block_size
    assert hashes.tolist() == naive_block_hashes(tokens, block_size, salt)
    parent = None
    for position, expected in enumerate(hashes.tolist()):  # and block by block from each parent
        parent = chain_hash(parent, tokens[position * block_size : (position + 1) * block_size], salt)
        assert parent == expected


@settings(max_examples=100, deadline=None)
@given(tokens=TOKEN_LISTS, extra=TOKEN_LISTS, block_size=SIZES)
def test_a_prefix_hashes_to_a_prefix(tokens: list[int], extra: list[int], block_size: int) -> None:
    whole = block_hashes(tokens + extra, block_size)
    head = block_hashes(tokens, block_size)
    assert whole[: len(head)].tolist() == head.tolist()


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), min_size=8, max_size=64), position=st.integers(0, 63))
def test_a_changed_token_changes_its_block_and_every_later_block(tokens: list[int], position: int) -> None:
    position %= len(tokens)
    changed = list(tokens)
    changed[position] += 1
    before, after = block_hashes(tokens, 4), block_hashes(changed, 4)
    first = position // 4
    assert before[:first].tolist() == after[:first].tolist()
    assert all(a != b for a, b in zip(before[first:].tolist(), after[first:].tolist()))


def test_salt_changes_every_block() -> None:
    tokens = list(range(64))
    plain, salted, other = (block_hashes(tokens, 16, salt) for salt in (None, "model-a", "model-b"))
    assert not set(plain.tolist()) & set(salted.tolist())
    assert not set(salted.tolist()) & set(other.tolist())


def test_salt_seed_is_stable_and_documented() -> None:
    digest = hashlib.blake2b(b"model-a", digest_size=8, person=b"kvroute-salt").digest()
    assert salt_seed("model-a") == int.from_bytes(digest, "little")
    assert salt_seed(None) != salt_seed("")
    assert 0 <= salt_seed("x") < 2**64


def test_input_forms_agree() -> None:
    tokens = [5, 900, 151_000, 0, 7, 7, 7, 1, 2]
    reference = block_hashes(tokens, 4)
    for form in (
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.int32),
        np.array(tokens, dtype=np.uint64),
        np.array(tokens, dtype=np.int64)[::1],
        tuple(tokens),
    ):
        assert block_hashes(form, 4).tolist() == reference.tolist()
    strided = np.array([t for pair in zip(tokens, tokens) for t in pair], dtype=np.int64)[::2]
    assert block_hashes(strided, 4).tolist() == reference.tolist()


def test_the_input_array_is_not_modified() -> None:
    tokens = np.arange(64, dtype=np.uint64)
    block_hashes(tokens, 16)
    assert tokens.tolist() == list(range(64))


def test_long_prompts_hash_consistently() -> None:
    tokens = np.random.default_rng(1).integers(0, 150_000, size=300_000)
    long = block_hashes(tokens, 16)
    assert len(long) == 18_750
    assert block_hashes(tokens[:160], 16).tolist() == long[:10].tolist()
    parent = int(long[-2])
    assert chain_hash(parent, tokens[-16:]) == int(long[-1])
    assert len(set(long.tolist())) == len(long)


def test_short_and_invalid_inputs() -> None:
    assert block_hashes([1, 2, 3], 4).tolist() == []
    assert block_hashes([], 4).tolist() == []
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        chain_hash(None, [])


def test_chain_hash_continues_from_any_parent() -> None:
    tokens = list(range(100, 164))
    hashes = block_hashes(tokens, 16, "m")
    for index in range(1, 4):
        assert chain_hash(int(hashes[index - 1]), tokens[index * 16 : index * 16 + 16]) == int(hashes[index])
    # The salt only seeds a first block.
    assert chain_hash(int(hashes[0]), tokens[16:32], "another") == int(hashes[1])


def test_request_salt_separates_models_and_cache_salts() -> None:
    from kvroute.tokenizer_index.hashing import request_salt

    assert request_salt("m") == request_salt("m", None) == request_salt("m", "") == "m"
    assert request_salt("m", "s") != request_salt("m") and request_salt("m", "s") != request_salt("n", "s")
    assert request_salt(None) == ""
