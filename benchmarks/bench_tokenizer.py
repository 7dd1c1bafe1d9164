"""Tokenizing a conversation's next turn: whole text vs kvroute's incremental tokenizer.

For histories of about 10K, 50K and 100K tokens (100 messages each, plus a system prompt),
every repetition appends a fresh user message and tokenizes the whole request three ways:

* ``full``: render the chat template, tokenize the whole text (what a router without
  memoisation pays each turn: ``RequestTokenizer(incremental=False)``);
* ``incremental``: the same on a ``RequestTokenizer`` that has seen the previous turn, so only
  the pieces cut at added tokens that are new get tokenized;
* ``transformers`` (when installed): ``apply_chat_template(tokenize=True)``, for reference.

``render`` is the chat-template rendering alone, which both pay. A second table measures what
the router hashes, an int64 array: ``array`` is ``encode_chat_array`` on its own incremental
tokenizer (warmed by array calls only, as the router's would be), against the ``list`` form
(the ``incremental`` column) plus ``np.asarray(list, dtype=np.int64)``, which a caller of the
list form pays before hashing. Each repetition measures the variants back to back (same
machine conditions); the tables show medians. Incremental ids and arrays are checked equal to
full ids every time. Target: incremental <= 5 % of full at 100K::

    python -m kvroute.benchmarks.bench_tokenizer [--tokenizer DIR] [--repeats 7] [--out bench-out/tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvroute.benchmarks.workloads import words
from kvroute.tokenizer_index import RequestTokenizer

HISTORY_TOKENS = (10_000, 50_000, 100_000)
HISTORY_MESSAGES = 100
NEW_TURN_TOKENS = 200
TARGET_RATIO_AT_LARGEST = 0.05


@dataclass(frozen=True)
class Row:
    """Medians for one history size (milliseconds; ``*_cpu_ms``: this process's CPU time)."""

    history_tokens: int
    messages: int
    full_ms: float
    incremental_ms: float
    render_ms: float
    transformers_ms: float | None
    incremental_vs_full: float
    cache_bytes: int  # what the piece cache holds for this conversation
    array_ms: float  # encode_chat_array, incremental
    asarray_ms: float  # np.asarray(encode_chat's list, dtype=np.int64)
    incremental_cpu_ms: float
    array_cpu_ms: float
    asarray_cpu_ms: float
    array_vs_list_asarray_cpu: float  # array_cpu_ms / (incremental_cpu_ms + asarray_cpu_ms)
    array_cache_bytes: int  # the array-only tokenizer's piece cache


def _messages(seed: int, per_message_tokens: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant. " + words(rng, 100)}]
    for index in range(HISTORY_MESSAGES):
        role = "user" if index % 2 == 0 else "assistant"
        messages.append({"role": role, "content": words(rng, per_message_tokens)})
    return messages


def conversation(tokenizer: RequestTokenizer, history_tokens: int, seed: int) -> list[dict[str, str]]:
    """A system prompt and ``HISTORY_MESSAGES`` alternating messages totalling ~history_tokens."""
    per_message = history_tokens // HISTORY_MESSAGES
    messages = _messages(seed, per_message)
    # words() sizes text by an average for the default tokenizer: rescale once to hit the target.
    actual = len(tokenizer.encode_chat(messages, add_generation_prompt=False))
    if abs(actual - history_tokens) > history_tokens * 0.05:
        messages = _messages(seed, round(per_message * history_tokens / actual))
    return messages


@dataclass
class _Clock:
    """Wall and CPU milliseconds of each named step, one sample per repetition.

    CPU time (all of this process's threads) is what the comparisons of small steps use: on
    a shared machine a step's wall time also counts the time it waited for a core.
    """

    wall: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    cpu: defaultdict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def time(self, name: str, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, timed under ``name``."""
        wall, cpu = time.perf_counter(), time.process_time()
        result = function(*args)
        self.cpu[name].append((time.process_time() - cpu) * 1000)
        self.wall[name].append((time.perf_counter() - wall) * 1000)
        return result

    def median(self, name: str, *, cpu: bool = False) -> float:
        return round(statistics.median((self.cpu if cpu else self.wall)[name]), 3)


def _hf_ids(hf_tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def measure(tokenizer_path: Path, history_tokens: int, repeats: int, hf_tokenizer: Any | None) -> Row:
    full = RequestTokenizer.from_pretrained(tokenizer_path, incremental=False)
    incremental = RequestTokenizer.from_pretrained(tokenizer_path)
    arrays = RequestTokenizer.from_pretrained(tokenizer_path)  # used through the array forms only
    if not incremental.incremental:
        print(f"note: {tokenizer_path} cannot be tokenized piecewise; both columns tokenize whole texts")
    history = conversation(full, history_tokens, seed=history_tokens)
    incremental.encode_chat(history)  # the previous turn: warms the piece caches
    arrays.encode_chat_array(history)
    rng = np.random.default_rng(1)
    clock = _Clock()
    tokens = 0
    for _ in range(repeats):
        request = [*history, {"role": "user", "content": words(rng, NEW_TURN_TOKENS)}]
        expected = clock.time("full", full.encode_chat, request)
        ids = clock.time("incremental", incremental.encode_chat, request)
        if ids != expected:
            raise SystemExit(f"incremental ids differ from full ids at {history_tokens} tokens")
        array = clock.time("array", arrays.encode_chat_array, request)
        clock.time("asarray", np.asarray, ids, np.int64)
        if not np.array_equal(array, expected):
            raise SystemExit(f"the int64 array differs from full ids at {history_tokens} tokens")
        clock.time("render", incremental.render_chat, request)
        if hf_tokenizer is not None:
            hf_ids = clock.time("transformers", _hf_ids, hf_tokenizer, request)
            if hf_ids != expected:
                raise SystemExit(f"transformers ids differ from kvroute's at {history_tokens} tokens")
        tokens = len(expected)
        history = request + [{"role": "assistant", "content": words(rng, NEW_TURN_TOKENS)}]
        incremental.encode_chat(history, add_generation_prompt=False)  # as the router saw it
        arrays.encode_chat_array(history, add_generation_prompt=False)
    full_ms, incremental_ms = clock.median("full"), clock.median("incremental")
    array_cpu_ms, list_asarray_cpu_ms = (
        clock.median("array", cpu=True),
        clock.median("incremental", cpu=True) + clock.median("asarray", cpu=True),
    )
    return Row(
        history_tokens=tokens,
        messages=len(request),
        full_ms=full_ms,
        incremental_ms=incremental_ms,
        render_ms=clock.median("render"),
        transformers_ms=clock.median("transformers") if hf_tokenizer is not None else None,
        incremental_vs_full=round(incremental_ms / full_ms, 4),
        cache_bytes=incremental.cache_stats().bytes,
        array_ms=clock.median("array"),
        asarray_ms=clock.median("asarray"),
        incremental_cpu_ms=clock.median("incremental", cpu=True),
        array_cpu_ms=array_cpu_ms,
        asarray_cpu_ms=clock.median("asarray", cpu=True),
        array_vs_list_asarray_cpu=round(array_cpu_ms / list_asarray_cpu_ms, 4),
        array_cache_bytes=arrays.cache_stats().bytes,
    )


def _load_transformers(path: Path) -> Any | None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(path))


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'history tokens':>14} {'messages':>8} {'full ms':>9} {'incremental ms':>14} {'incr/full':>9} "
        f"{'render ms':>9} {'transformers ms':>15} {'cache MB':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        hf = f"{row.transformers_ms:>15.2f}" if row.transformers_ms is not None else f"{'-':>15}"
        lines.append(
            f"{row.history_tokens:>14,} {row.messages:>8} {row.full_ms:>9.2f} {row.incremental_ms:>14.2f} "
            f"{row.incremental_vs_full:>9.1%} {row.render_ms:>9.2f} {hf} {row.cache_bytes / 1e6:>8.2f}"
        )
    return "\n".join(lines)


def format_array_table(rows: list[Row]) -> str:
    header = (
        f"{'history tokens':>14} {'list':>7} {'asarray':>7} {'list+asarray':>12} {'array':>7} "
        f"{'array/(list+asarray)':>20} {'wall: list+asarray':>18} {'array':>7} {'array cache MB':>14}"
    )
    lines = ["int64 arrays for the block hasher, next turn (CPU ms, then wall ms; medians):", header, "-" * len(header)]
    for row in rows:
        list_asarray_cpu = row.incremental_cpu_ms + row.asarray_cpu_ms
        lines.append(
            f"{row.history_tokens:>14,} {row.incremental_cpu_ms:>7.2f} {row.asarray_cpu_ms:>7.2f} "
            f"{list_asarray_cpu:>12.2f} {row.array_cpu_ms:>7.2f} {row.array_vs_list_asarray_cpu:>20.1%} "
            f"{row.incremental_ms + row.asarray_ms:>18.2f} {row.array_ms:>7.2f} {row.array_cache_bytes / 1e6:>14.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=RequestTokenizer.default_path(),
        help="tokenizer directory (default: kvroute's shipped one)",
    )
    parser.add_argument(
        "--sizes", default=",".join(map(str, HISTORY_TOKENS)), help="history sizes in tokens, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=7, help="repetitions per size (median reported)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers reference")
    parser.add_argument("--out", type=Path, default=Path("bench-out/tokenizer.json"))
    args = parser.parse_args(argv)
    hf_tokenizer = None if args.no_transformers else _load_transformers(args.tokenizer)
    rows = [measure(args.tokenizer, int(size), args.repeats, hf_tokenizer) for size in args.sizes.split(",")]
    print(format_table(rows))
    print()
    print(format_array_table(rows))
    largest = max(rows, key=lambda row: row.history_tokens)
    met = largest.incremental_vs_full <= TARGET_RATIO_AT_LARGEST
    print(
        f"\ntarget: incremental <= {TARGET_RATIO_AT_LARGEST:.0%} of full at {largest.history_tokens:,} tokens: "
        f"{'met' if met else 'NOT met'} ({largest.incremental_vs_full:.1%}); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus"
    )
    report = {
        "benchmark": "tokenizer",
        "tokenizer": str(args.tokenizer),
        "python": platform.python_version(),
        "repeats": args.repeats,
        "new_turn_tokens": NEW_TURN_TOKENS,
        "rows": [asdict(row) for row in rows],
        "target_ratio": TARGET_RATIO_AT_LARGEST,
        "target_met": met,
        "load_average": list(os.getloadavg()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
