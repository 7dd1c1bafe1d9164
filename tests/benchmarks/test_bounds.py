"""The offline bounds: Belady's pooled cache against brute force, hand-worked cases, LRU."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Sequence

import pytest

from kvroute.benchmarks.bounds import (
    NEVER,
    Prompt,
    belady_hits,
    bounds,
    lru_hits,
    next_uses,
    unbounded_hits,
)

BLOCK = 2  # tokens per block in the tiny cases


def _prompts(*sequences: Sequence[int]) -> list[Prompt]:
    return [Prompt.of(list(tokens), BLOCK) for tokens in sequences]


def _prefix_credit(prompt: Prompt, held: frozenset[int]) -> int:
    count = 0
    for block in prompt.hashes:
        if block not in held:
            break
        count += 1
    return min(count, prompt.creditable) * prompt.block_size


def _subsets(blocks: frozenset[int], limit: int):
    for size in range(min(limit, len(blocks)) + 1):
        for chosen in itertools.combinations(sorted(blocks), size):
            yield frozenset(chosen)


def brute_force_pooled(prompts: Sequence[Prompt], capacity: int) -> int:
    """Most cached tokens any pooled cache of ``capacity`` blocks gets: after every request,
    every subset of (held | computed) of at most ``capacity`` blocks, prefix-closed or not."""

    @functools.cache
    def best(position: int, held: frozenset[int]) -> int:
        if position == len(prompts):
            return 0
        prompt = prompts[position]
        gained = _prefix_credit(prompt, held)
        candidates = held | frozenset(prompt.hashes)
        return gained + max(best(position + 1, kept) for kept in _subsets(candidates, capacity))

    return best(0, frozenset())


def brute_force_fleet(prompts: Sequence[Prompt], capacities: tuple[int, ...]) -> int:
    """Most cached tokens any router over separate replicas gets: every routing of every
    request and every keep/evict choice on the replica that served it."""

    @functools.cache
    def best(position: int, caches: tuple[frozenset[int], ...]) -> int:
        if position == len(prompts):
            return 0
        prompt = prompts[position]
        result = 0
        for replica, held in enumerate(caches):
            gained = _prefix_credit(prompt, held)
            candidates = held | frozenset(prompt.hashes)
            for kept in _subsets(candidates, capacities[replica]):
                after = caches[:replica] + (kept,) + caches[replica + 1 :]
                result = max(result, gained + best(position + 1, after))
        return result

    return best(0, tuple(frozenset() for _ in capacities))


_STEMS = ([1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 9], [5, 5, 6, 6, 7, 7], [1, 2, 3, 4, 8, 8])


def _stem_case(rng: random.Random, requests: int) -> list[Prompt]:
    """Prompts of 2-7 tokens sharing prefixes of a few stems (some end on a block edge)."""
    sequences = []
    for _ in range(requests):
        stem = rng.choice(_STEMS)
        length = rng.randint(2, 6)
        tail = [rng.choice([0, 9])] if rng.random() < 0.6 else []
        sequences.append(stem[:length] + tail)
    return _prompts(*sequences)


def _conversation_case(rng: random.Random, requests: int) -> list[Prompt]:
    """2-3 interleaved conversations whose prompts grow by 1-3 tokens a turn; half of the
    cases share a first block between conversations (a system prompt)."""
    conversations = rng.randint(2, 3)
    shared = rng.random() < 0.5
    heads = [[1, 2] if shared else [10 + c, 10 + c] for c in range(conversations)]
    bodies = [[rng.randint(3, 5) for _ in range(8)] for _ in range(conversations)]
    lengths = [0] * conversations
    sequences = []
    for _ in range(requests):
        c = rng.randrange(conversations)
        lengths[c] += rng.randint(1, 3)
        sequences.append(heads[c] + [20 + c] + bodies[c][: lengths[c]])
    return _prompts(*sequences)


def _random_case(rng: random.Random, requests: int) -> list[Prompt]:
    return (_stem_case if rng.random() < 0.4 else _conversation_case)(rng, requests)


@pytest.mark.parametrize("capacity", [2, 3, 4])
def test_belady_equals_brute_force_over_every_keep_and_evict_choice(capacity: int) -> None:
    rng = random.Random(capacity)
    binding = 0
    for _ in range(40):
        prompts = _random_case(rng, rng.randint(3, 6))
        optimal = belady_hits(prompts, capacity)
        assert optimal == brute_force_pooled(prompts, capacity)
        binding += optimal < unbounded_hits(prompts)
    assert binding >= 5  # the capacity mattered in enough cases for this to test something


@pytest.mark.parametrize("capacities", [(1, 1), (2, 1), (2, 2)])
def test_no_routing_of_separate_replicas_beats_the_pooled_bound(capacities: tuple[int, ...]) -> None:
    rng = random.Random(sum(capacities) * 7 + len(capacities))
    tight = loose = 0
    for _ in range(25):
        prompts = _random_case(rng, rng.randint(3, 5))
        fleet = brute_force_fleet(prompts, capacities)
        pooled = belady_hits(prompts, sum(capacities))
        assert fleet <= pooled
        tight += fleet == pooled
        loose += fleet < pooled
    assert tight > 0  # the bound is reached on some cases, not only an upper limit
    assert loose > 0  # and separate caches fall short of it on others


def test_hand_worked_two_conversations_over_two_blocks() -> None:
    # A = a|ab (+1 token), C = c|cd (+1): 2 blocks each, both creditable (5 tokens: cap 2).
    prompts = _prompts([1, 2, 3, 4, 5], [7, 8, 9, 10, 11], [1, 2, 3, 4, 6], [7, 8, 9, 10, 12])
    # LRU over 2 blocks: C evicts A, A evicts C: no hits.
    assert lru_hits(prompts, 2) == 0
    # Belady keeps A through C's first turn (next use 2 < 3), hits A's 2 blocks, misses C.
    assert belady_hits(prompts, 2) == 4
    # Two replicas of one block each keep one block of each conversation: 2 + 2 tokens.
    assert brute_force_fleet(prompts, (1, 1)) == 4
    assert unbounded_hits(prompts) == 8
    result = bounds(prompts, 2)
    assert result.prompt_tokens == 20
    assert (result.bound, result.bound_fleet, result.pooled_lru) == (0.4, 0.2, 0.0)


def test_hand_worked_shared_parent_and_the_uncapped_last_block() -> None:
    # a|ab, then a|a9 (shares a), then a|ab again: keep a and ab, drop a9 (never used again).
    prompts = _prompts([1, 2, 3, 4, 5], [1, 2, 9, 9, 5], [1, 2, 3, 4, 5])
    assert next_uses(prompts)[0] == [1, 2]
    assert next_uses(prompts)[1] == [2, NEVER]
    assert belady_hits(prompts, 2) == 2 + 4
    # 4 tokens = 2 full blocks, but the last token is always computed: only 1 block counts.
    even = _prompts([1, 2, 3, 4], [1, 2, 3, 4])
    assert next_uses(even)[0] == [1, NEVER]  # ab is never creditable in its next use
    assert belady_hits(even, 8) == unbounded_hits(even) == 2


def test_a_parent_is_never_evicted_before_its_child() -> None:
    # Capacity 2, one 3-block prompt then its 2-block prefix: keep the head, not the tail.
    prompts = _prompts([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 0])
    assert belady_hits(prompts, 2) == 4


def test_orderings_of_the_three_caches() -> None:
    rng = random.Random(5)
    for _ in range(200):
        prompts = _random_case(rng, rng.randint(2, 12))
        capacity = rng.randint(1, 6)
        unbounded = unbounded_hits(prompts)
        optimal = belady_hits(prompts, capacity)
        assert lru_hits(prompts, capacity) <= optimal <= unbounded
        assert belady_hits(prompts, 10_000) == lru_hits(prompts, 10_000) == unbounded
