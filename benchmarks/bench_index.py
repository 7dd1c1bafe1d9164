"""Block hashing and the prefix index: speed at 2K/32K/128K-token prompts, memory at 1M blocks.

    python -m kvroute.benchmarks.bench_index [--backends 16] [--blocks 1000000] [--out bench-out/index.json]

1. **hashing**: :func:`~kvroute.tokenizer_index.hashing.block_hashes` of int64 token arrays (what
   the router hashes once per request), and from a Python list (numpy's conversion cost).
2. **fill**: ``--backends`` backends with ``--blocks / --backends`` blocks of capacity
   each, filled to capacity with conversations (1-8K-token turns) behind four system
   prompts that every backend holds, so further inserts evict.
3. **match + insert** (``match_hashes`` then ``insert_hashes`` on one hash array, as the
   router does), median over repetitions, three kinds of prompt:
   ``new`` (no backend holds any of it: the walk stops at once, the insert adds every block
   and evicts as many), ``cached`` (one backend holds all of it: the walk reads every block,
   the insert re-touches), ``extend`` (a conversation's next turn: its first half cached).
   Target: <= 2 ms at 128K tokens.
   **small prompts**: the same three kinds at 512 tokens (an ordinary ~2 KB chat) on an
   index of ``--small-blocks`` backend-blocks (100K), where a numpy call's fixed cost, not
   the tables, decides the time: median CPU time, the router's per-request cost.
4. **memory**: ``stats().bytes`` per backend-block (target <= 64), what tracemalloc saw the
   fill allocate and keep, and the process's RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvroute.tokenizer_index import PrefixIndex
from kvroute.tokenizer_index.hashing import block_hashes

BLOCK_SIZE = 16
PROMPT_TOKENS = (2_048, 32_768, 131_072)
SMALL_PROMPT_TOKENS = 512
SMALL_INDEX_BLOCKS = 100_000
KINDS = ("new", "cached", "extend")
VOCAB = 150_000
SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_TOKENS = 1_024
TARGET_MS_AT_128K = 2.0
TARGET_BYTES_PER_BLOCK = 64.0


@dataclass
class HashResult:
    tokens: int
    array_us: float
    list_us: float


@dataclass
class MatchInsertResult:
    kind: str
    tokens: int
    match_us: float
    insert_us: float
    total_us: float
    total_cpu_us: float
    best_cpu_us: float
    matched_tokens: int


@dataclass
class MemoryResult:
    backends: int
    backend_blocks: int
    unique_blocks: int
    index_bytes: int
    bytes_per_block: float
    traced_bytes_per_block: float
    rss_mib: float
    fill_s: float


def median_us(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        run()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1000


def bench_hashing(rng: np.random.Generator, repeats: int) -> list[HashResult]:
    results = []
    for tokens in PROMPT_TOKENS:
        ids = rng.integers(0, VOCAB, size=tokens, dtype=np.int64)
        as_list = ids.tolist()
        results.append(
            HashResult(
                tokens=tokens,
                array_us=median_us(lambda ids=ids: block_hashes(ids, BLOCK_SIZE, "model"), repeats),
                list_us=median_us(
                    lambda as_list=as_list: block_hashes(as_list, BLOCK_SIZE, "model"), max(3, repeats // 10)
                ),
            )
        )
    return results


class Workload:
    """Random prompts behind shared system prompts; the index under test."""

    def __init__(
        self, rng: np.random.Generator, backends: int, blocks: int, index_class: type[PrefixIndex] = PrefixIndex
    ) -> None:
        self.rng = rng
        self.names = [f"http://10.0.0.{i + 1}:8000" for i in range(backends)]
        self.capacity = blocks // backends
        self.index = index_class(block_size=BLOCK_SIZE, capacity_blocks=self.capacity)
        self.system_prompts = [self.tokens(SYSTEM_PROMPT_TOKENS) for _ in range(SYSTEM_PROMPTS)]
        self.turn = 0

    def tokens(self, count: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, size=count, dtype=np.int64)

    def prompt(self, tokens: int) -> np.ndarray:
        """A conversation: a system prompt (at most half of it) then ``tokens`` in all."""
        system = self.system_prompts[int(self.rng.integers(SYSTEM_PROMPTS))][: tokens // 2]
        return np.concatenate((system, self.tokens(max(0, tokens - len(system)))))

    def next_backend(self) -> str:
        self.turn += 1
        return self.names[self.turn % len(self.names)]

    def fill(self) -> float:
        """Insert conversations round-robin until every backend is at capacity; seconds."""
        start = time.perf_counter()
        for name in self.names:
            for system in self.system_prompts:
                self.index.insert(name, system)
        while min(self.index.blocks(name) for name in self.names) < self.capacity:
            for name in self.names:
                self.index.insert(name, self.prompt(int(self.rng.integers(1_024, 8_192))))
        return time.perf_counter() - start

    def warm_up(self, tokens: int = PROMPT_TOKENS[-1]) -> None:
        """Two longest prompts per backend: its tables reach their steady-state size."""
        for _ in range(2 * len(self.names)):
            self.index.insert(self.next_backend(), self.prompt(tokens))


def bench_match_insert(work: Workload, kind: str, tokens: int, repeats: int) -> MatchInsertResult:
    index = work.index
    match_times, insert_times, cpu_times, matched = [], [], [], []
    for _ in range(repeats):
        hashes = block_hashes(work.prompt(tokens), BLOCK_SIZE)
        backend = work.next_backend()
        if kind == "cached":
            index.insert_hashes(backend, hashes)
        elif kind == "extend":
            index.insert_hashes(backend, hashes[: len(hashes) // 2])
        cpu = time.process_time_ns()
        start = time.perf_counter_ns()
        result = index.match_hashes(hashes)
        middle = time.perf_counter_ns()
        index.insert_hashes(backend, hashes)
        end = time.perf_counter_ns()
        cpu_times.append(time.process_time_ns() - cpu)
        match_times.append(middle - start)
        insert_times.append(end - middle)
        matched.append(result.get(backend, 0))
    totals = [m + i for m, i in zip(match_times, insert_times)]
    return MatchInsertResult(
        kind=kind,
        tokens=tokens,
        match_us=statistics.median(match_times) / 1000,
        insert_us=statistics.median(insert_times) / 1000,
        total_us=statistics.median(totals) / 1000,
        total_cpu_us=statistics.median(cpu_times) / 1000,
        best_cpu_us=min(cpu_times) / 1000,
        matched_tokens=int(statistics.median(matched)),
    )


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_small_prompts(
    rng: np.random.Generator, backends: int, blocks: int, repeats: int, index_class: type[PrefixIndex] = PrefixIndex
) -> list[MatchInsertResult]:
    """Match + insert of ordinary chat prompts on a filled index of ``blocks`` backend-blocks."""
    work = Workload(rng, backends, blocks, index_class)
    work.fill()
    work.warm_up(8_192)
    return [bench_match_insert(work, kind, SMALL_PROMPT_TOKENS, repeats) for kind in KINDS]


def format_speed(rows: list[MatchInsertResult]) -> list[str]:
    """Table rows of match + insert results."""
    lines = [
        f"{'prompt':>7} {'tokens':>8} {'match':>9} {'insert':>9} {'total':>9} {'cpu':>9} {'cpu best':>9} {'matched':>8}"
    ]
    for row in rows:
        lines.append(
            f"{row.kind:>7} {row.tokens:>8} {row.match_us:>7.0f}us {row.insert_us:>7.0f}us "
            f"{row.total_us:>7.0f}us {row.total_cpu_us:>7.0f}us {row.best_cpu_us:>7.0f}us {row.matched_tokens:>8}"
        )
    return lines


def format_report(
    hashing: list[HashResult],
    memory: MemoryResult,
    speed: list[MatchInsertResult],
    small: list[MatchInsertResult],
    small_blocks: int = SMALL_INDEX_BLOCKS,
) -> str:
    lines = ["block_hashes (block size 16)", f"{'tokens':>8} {'int64 array':>12} {'python list':>12}"]
    for row in hashing:
        lines.append(f"{row.tokens:>8} {row.array_us:>10.0f}us {row.list_us:>10.0f}us")
    lines += [
        "",
        f"index: {memory.backends} backends, {memory.backend_blocks:,} backend-blocks "
        f"({memory.unique_blocks:,} distinct), filled in {memory.fill_s:.1f}s",
        f"  memory: {memory.index_bytes / 2**20:.1f} MiB = {memory.bytes_per_block:.1f} B/backend-block "
        f"(target <= {TARGET_BYTES_PER_BLOCK:.0f}); tracemalloc {memory.traced_bytes_per_block:.1f} B/block; "
        f"RSS {memory.rss_mib:.0f} MiB",
        "",
        "match_hashes + insert_hashes: median wall time; cpu = this process's CPU time, median and best",
        *format_speed(speed),
    ]
    largest = [row for row in speed if row.tokens == PROMPT_TOKENS[-1]]
    worst_wall = max(row.total_us for row in largest) / 1000
    worst_cpu = max(row.total_cpu_us for row in largest) / 1000
    lines.append(
        f"worst median at {PROMPT_TOKENS[-1]} tokens: {worst_wall:.2f} ms wall, {worst_cpu:.2f} ms cpu "
        f"(target <= {TARGET_MS_AT_128K} ms; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)"
    )
    if small:
        lines += [
            "",
            f"small prompts: {small[0].tokens} tokens on a {small_blocks:,}-block index",
            *format_speed(small),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.benchmarks.bench_index", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backends", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="backend-blocks in the filled index")
    parser.add_argument("--repeats", type=int, default=30, help="repetitions at 128K tokens (more when shorter)")
    parser.add_argument(
        "--small-blocks", type=int, default=SMALL_INDEX_BLOCKS, help="backend-blocks, small-prompt rows"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/index.json"))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)

    hashing = bench_hashing(rng, repeats=4 * args.repeats)

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    work = Workload(rng, args.backends, args.blocks)
    fill_s = work.fill()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    stats = work.index.stats()
    memory = MemoryResult(
        backends=args.backends,
        backend_blocks=stats.backend_blocks,
        unique_blocks=stats.unique_blocks,
        index_bytes=stats.bytes,
        bytes_per_block=stats.bytes_per_block,
        traced_bytes_per_block=traced / stats.backend_blocks,
        rss_mib=rss_mib(),
        fill_s=fill_s,
    )

    work.warm_up()
    speed = []
    for tokens in PROMPT_TOKENS:
        repeats = args.repeats * max(1, PROMPT_TOKENS[-1] // tokens // 8)
        for kind in KINDS:
            speed.append(bench_match_insert(work, kind, tokens, repeats))

    small = bench_small_prompts(rng, args.backends, args.small_blocks, repeats=40 * args.repeats)

    print(format_report(hashing, memory, speed, small, args.small_blocks))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "load_average": list(os.getloadavg()),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "numpy": np.__version__,
        "block_size": BLOCK_SIZE,
        "hashing": [asdict(row) for row in hashing],
        "memory": asdict(memory),
        "match_insert": [asdict(row) for row in speed],
        "small_prompts": {"index_blocks": args.small_blocks, "match_insert": [asdict(row) for row in small]},
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
