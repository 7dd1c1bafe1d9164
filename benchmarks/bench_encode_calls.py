"""New words to the tokenizers library: one batch call against one call per word.

A router tokenizing new text word by word sends the words its word cache lacks to the
library: a few per request or agent turn. ``encode_batch_fast`` hands a batch to the
library's thread pool, whose threads a router finds asleep between requests; ``encode``
runs in the calling thread. For ``k`` new words (distinct, never seen by the library's own
cache) after a pause that lets the pool sleep (``--gap``: a busy loop of the calling
thread, a sleep, or none), this reports the median microseconds of each way::

    python -m kvroute.benchmarks.bench_encode_calls [--words 1,2,3,5,8,16,32,64] [--calls 60]
        [--gaps busy,sleep,none] [--tokenizer DIR] [--out bench-out/encode-calls.json]

``tokenizer.SINGLE_ENCODE_TEXTS`` is chosen from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer

from kvroute.benchmarks.results import machine
from kvroute.tokenizer_index import RequestTokenizer

GAPS = ("busy", "sleep", "none")
GAP_S = 0.001


@dataclass(frozen=True)
class Row:
    gap: str
    words: int
    batch_us: float
    each_us: float


def fresh_words() -> Iterator[str]:
    """Words no call has seen: identifiers like a tool result's."""
    number = 0
    while True:
        yield f"w{number}x{number * 7919 % 100_003}"
        number += 1


def pause(gap: str) -> None:
    if gap == "busy":
        end = time.perf_counter() + GAP_S
        while time.perf_counter() < end:
            pass
    elif gap == "sleep":
        time.sleep(GAP_S)


def timed_us(step: Callable[[list[str]], object], words: list[str]) -> float:
    start = time.perf_counter()
    step(words)
    return (time.perf_counter() - start) * 1e6


def measure(library: Tokenizer, gap: str, count: int, calls: int, words: Iterator[str]) -> Row:
    def in_one_batch(chosen: list[str]) -> object:
        return library.encode_batch_fast(chosen, add_special_tokens=False)

    def one_by_one(chosen: list[str]) -> object:
        return [library.encode(word, add_special_tokens=False) for word in chosen]

    batch, each = [], []
    for _ in range(calls):
        pause(gap)
        batch.append(timed_us(in_one_batch, [next(words) for _ in range(count)]))
        pause(gap)
        each.append(timed_us(one_by_one, [next(words) for _ in range(count)]))
    return Row(gap, count, statistics.median(batch), statistics.median(each))


def format_rows(rows: list[Row]) -> str:
    lines = ["gap    new words   batch call us   one call per word us"]
    lines += [f"{row.gap:6s} {row.words:9d} {row.batch_us:15.1f} {row.each_us:22.1f}" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.bench_encode_calls", description=__doc__)
    parser.add_argument("--words", default="1,2,3,5,8,16,32,64", help="new words per call, comma-separated")
    parser.add_argument("--calls", type=int, default=60, help="calls timed per row")
    parser.add_argument("--gaps", default=",".join(GAPS), help=f"pauses before each call, of {GAPS}")
    parser.add_argument("--tokenizer", type=Path, default=RequestTokenizer.default_path())
    parser.add_argument("--out", type=Path, default=Path("bench-out/encode-calls.json"))
    args = parser.parse_args(argv)
    library = RequestTokenizer.from_pretrained(args.tokenizer).backend
    words = fresh_words()
    rows = [
        measure(library, gap, int(count), args.calls, words)
        for gap in args.gaps.split(",")
        for count in args.words.split(",")
    ]
    print(format_rows(rows))
    print(machine())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "encode_calls",
        "argv": sys.argv[1:] if argv is None else argv,
        "machine": machine(),
        "rows": [asdict(row) for row in rows],
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
