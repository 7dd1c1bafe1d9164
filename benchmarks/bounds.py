"""Offline hit-rate bounds over the exact request sequence a run sent.

Three caches replay the prompts in order, each counted as an engine counts cached tokens
(vLLM, and the sim engine's ``Scheduler``): whole blocks of the prompt's longest cached
prefix, at most ``(prompt_tokens - 1) // block_size`` blocks, because the last prompt token
is always computed.

``bound``
    One unbounded cache: every block ever computed stays. No fleet beats it.
``bound_fleet``
    One pooled cache of the fleet's *total* capacity in blocks, evicted optimally (Belady:
    the block whose next use is farthest ahead goes first; only leaves of the prefix tree).
    It bounds every router on that fleet, over that request order (proof below).
``pooled_lru``
    The same pooled cache evicted LRU, a sequence's tail before its head, exactly as one
    sim engine (``kvroute.tokenizer_index.PrefixIndex``) evicts: what one big replica would keep.

Why ``bound_fleet`` bounds every router (and is exact for the pooled cache):

1. *Pooling only helps.* At any moment a fleet holds sets ``S_1..S_R`` of blocks with
   ``|S_k| <= c_k``; their union has at most ``C = sum c_k`` blocks. A request routed to
   replica ``k`` hits the longest prefix of its blocks in ``S_k``, which is in the union. So
   a pooled cache of ``C`` blocks that keeps "the union" after every request hits at least
   as much as the fleet. That pooled cache only ever keeps blocks it held or the current
   request computed, so it is one of the policies the pooled model below allows.
2. *The pooled model.* After each request the cache may keep any ``<= C`` blocks among
   those it held and those the request computed (keeping is optional: nothing forces a
   block in). A request's hit is the longest prefix of its blocks held, capped as above.
3. *Relax the prefix rule.* Count instead every held block of the request among its first
   ``cap`` blocks ("plain" hits >= prefix hits). Then a kept block is an interval from one
   request that contains it to the next one; it earns 1 if it is creditable there (within
   that request's ``cap``), and 0 otherwise (a block that is only the uncreditable last
   block of its next request is recomputed there anyway, so its next use counts as never).
   Choosing the most intervals with at most ``C`` open at once is interval scheduling on
   ``C`` machines, solved optimally by keeping, after each request, the ``C`` candidate
   blocks with the earliest next use: Belady's rule.
4. *Back to prefixes.* A child's next use is never before its parent's (a request that
   contains a block contains its parent, and creditably so), so breaking ties by depth
   (shallower kept) makes the kept set prefix-closed: every evicted block is a leaf. In a
   prefix-closed cache a request's held blocks are a prefix of it, so plain hits equal
   prefix hits: the rule reaches the plain optimum, which is >= the prefix optimum >= any
   fleet. Hence ``bound_fleet`` is the exact optimum of the pooled cache and an upper bound
   for every router.

What the bound does not model, each of which only makes it *more* generous to the fleet
except the first: requests are taken in the order sent; an engine that runs requests
concurrently may let one hit blocks of a request sent *after* it (only when both share a
prefix and are in flight together), which a sequential replay does not credit. Blocks of
generated output are not counted (the workloads' next turns carry the workload's own reply
text, never the engine's output, so those blocks are never hit); a running request's
blocks need not fit; a prompt longer than one replica's cache is allowed in the pool.
``tests/benchmarks/test_bounds.py`` checks the rule against brute force over every keep/evict choice
and over every routing of tiny two-replica fleets.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvroute.tokenizer_index import PrefixIndex
from kvroute.tokenizer_index.hashing import block_hashes

#: "Never used again" as a next-use position.
NEVER = float("inf")
#: The one name of the pooled LRU cache in its index.
_POOL = "pool"


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt as a cache sees it: its full blocks' chained hashes."""

    hashes: tuple[int, ...]
    tokens: int
    block_size: int

    @property
    def creditable(self) -> int:
        """Blocks an engine may count as cached: never the one holding the last token."""
        return max(0, (self.tokens - 1) // self.block_size)

    @classmethod
    def of(cls, tokens: Sequence[int] | np.ndarray, block_size: int) -> Prompt:
        hashes = block_hashes(tokens, block_size)
        return cls(tuple(hashes.tolist()), len(tokens), block_size)


@dataclass(frozen=True, slots=True)
class Bounds:
    """Hit rates (cached / prompt tokens) of the three offline caches over one sequence."""

    bound: float
    bound_fleet: float | None  # None when the fleet's capacity is unknown
    pooled_lru: float | None
    prompt_tokens: int
    capacity_blocks: int | None


def _held_prefix(prompt: Prompt, held: set[int] | dict[int, object]) -> int:
    """Leading blocks of ``prompt`` that are held."""
    count = 0
    for block in prompt.hashes:
        if block not in held:
            break
        count += 1
    return count


def _credit(prompt: Prompt, blocks: int) -> int:
    """Cached tokens an engine reports for ``blocks`` leading held blocks."""
    return min(blocks, prompt.creditable) * prompt.block_size


def unbounded_hits(prompts: Iterable[Prompt]) -> int:
    """Cached tokens of one unbounded cache over ``prompts`` in order."""
    held: set[int] = set()
    hits = 0
    for prompt in prompts:
        hits += _credit(prompt, _held_prefix(prompt, held))
        held.update(prompt.hashes)
    return hits


def next_uses(prompts: Sequence[Prompt]) -> list[list[float]]:
    """For each request and block: the position of the next request that can hit it.

    ``NEVER`` when no later request contains the block, or the next one that does has it
    as its uncreditable last block (it recomputes it anyway; see the module docstring).
    """
    upcoming: dict[int, tuple[int, bool]] = {}  # block -> (next position, creditable there)
    result: list[list[float]] = [[] for _ in prompts]
    for position in range(len(prompts) - 1, -1, -1):
        prompt = prompts[position]
        uses: list[float] = []
        for depth, block in enumerate(prompt.hashes):
            nxt = upcoming.get(block)
            uses.append(nxt[0] if nxt is not None and nxt[1] else NEVER)
            upcoming[block] = (position, depth < prompt.creditable)
        result[position] = uses
    return result


def belady_hits(prompts: Sequence[Prompt], capacity_blocks: int) -> int:
    """Cached tokens of one cache of ``capacity_blocks`` evicted optimally (Belady, leaves).

    After each request the cache keeps the ``capacity_blocks`` blocks, among those it held
    and those the request computed, whose next use is soonest (shallower first on ties,
    so only leaves are evicted); blocks never used again are dropped at once.
    """
    uses = next_uses(prompts)
    held: dict[int, tuple[float, int]] = {}  # block -> (next use, depth): its eviction key
    farthest: list[tuple[float, int, int]] = []  # max-heap of (-next use, -depth, block)
    hits = 0
    for prompt, prompt_uses in zip(prompts, uses):
        hits += _credit(prompt, _held_prefix(prompt, held))
        for depth, (block, use) in enumerate(zip(prompt.hashes, prompt_uses)):
            if use == NEVER:
                held.pop(block, None)
                continue
            held[block] = (use, depth)
            heapq.heappush(farthest, (-use, -depth, block))
        while len(held) > capacity_blocks:
            use, depth, block = heapq.heappop(farthest)
            if held.get(block) == (-use, -depth):  # else a stale entry: re-keyed or gone
                del held[block]
        if len(farthest) > 4 * capacity_blocks + 4096:
            farthest = [(-use, -depth, block) for block, (use, depth) in held.items()]
            heapq.heapify(farthest)
    return hits


def lru_hits(prompts: Iterable[Prompt], capacity_blocks: int) -> int:
    """Cached tokens of one engine-like LRU cache of ``capacity_blocks`` (tail first)."""
    index = PrefixIndex(capacity_blocks=capacity_blocks)
    hits = 0
    for prompt in prompts:
        hashes = np.fromiter(prompt.hashes, dtype=np.uint64, count=len(prompt.hashes))
        matched = index.match_hashes(hashes).get(_POOL, 0) // index.block_size
        hits += _credit(prompt, matched)
        # As an engine stores: a sequence longer than the whole cache keeps its head.
        index.insert_hashes(_POOL, hashes[:capacity_blocks])
    return hits


def bounds(prompts: Sequence[Prompt], capacity_blocks: int | None) -> Bounds:
    """The three offline hit rates over ``prompts`` in the order given."""
    total = sum(prompt.tokens for prompt in prompts)

    def rate(hits: int) -> float:
        return hits / total if total else 0.0

    if capacity_blocks is None:
        return Bounds(rate(unbounded_hits(prompts)), None, None, total, None)
    return Bounds(
        bound=rate(unbounded_hits(prompts)),
        bound_fleet=rate(belady_hits(prompts, capacity_blocks)),
        pooled_lru=rate(lru_hits(prompts, capacity_blocks)),
        prompt_tokens=total,
        capacity_blocks=capacity_blocks,
    )
