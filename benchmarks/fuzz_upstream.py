"""Differential fuzz run of kvroute's response parser against h11 (10^6 cases by default).

    python3 -m kvroute.benchmarks.fuzz_upstream --cases 1000000 --workers 2

Each case comes from :func:`kvroute.benchmarks.upstream_cases.draw_case` with its own seed (case
``i`` is seed ``start + i``: any reported seed replays alone with ``--start SEED --cases 1``)
and is judged by :func:`kvroute.benchmarks.upstream_cases.check`. Prints, and with ``--json`` writes,
the number of cases, kvroute's verdicts, how often each generated feature occurred, the
cases per second, and every disagreement's seed and reason (exit status 1 if any).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from kvroute.benchmarks.upstream_cases import RandomDraw, draw_case, judge

_BATCH = 5_000


@dataclass
class Tally:
    cases: int = 0
    accepted: int = 0
    reusable: int = 0
    tags: Counter[str] = field(default_factory=Counter)
    disagreements: list[tuple[int, str]] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.cases += other.cases
        self.accepted += other.accepted
        self.reusable += other.reusable
        self.tags.update(other.tags)
        self.disagreements += other.disagreements


def run_batch(first_seed: int, count: int) -> Tally:
    tally = Tally()
    for seed in range(first_seed, first_seed + count):
        case = draw_case(RandomDraw(seed))
        try:
            verdict, problem = judge(case)
        except Exception as error:
            verdict, problem = None, f"crash: {type(error).__name__}: {error}"
        tally.cases += 1
        tally.tags.update(set(case.tags))
        if verdict is not None and verdict.accepted:
            tally.accepted += 1
            tally.reusable += verdict.reusable
        if problem is not None:
            tally.disagreements.append((seed, problem[:500]))
    return tally


def summary(total: Tally, args: argparse.Namespace, elapsed: float) -> dict[str, object]:
    return {
        "cases": total.cases,
        "first_seed": args.start,
        "workers": args.workers,
        "seconds": round(elapsed, 1),
        "cases_per_s": round(total.cases / elapsed),
        "accepted": total.accepted,
        "accepted_reusable": total.reusable,
        "rejected": total.cases - total.accepted - len(total.disagreements),
        "disagreements": len(total.disagreements),
        "disagreement_examples": total.disagreements[:20],
        "features": dict(total.tags.most_common()),
    }


def write(result: dict[str, object], path: str | None) -> None:
    if path:
        with open(path, "w") as out:
            json.dump(result, out, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--start", type=int, default=0, help="the first seed")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) // 2))
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    total = Tally()
    end = args.start + args.cases
    batches = [(seed, min(_BATCH, end - seed)) for seed in range(args.start, end, _BATCH)]
    with ProcessPoolExecutor(args.workers) as pool:
        for done, tally in enumerate(pool.map(run_batch, *zip(*batches)), 1):
            total.add(tally)
            if done % 20 == 0:  # progress, and the result so far (a long run may be cut short)
                print(f"  {total.cases:,} cases, {len(total.disagreements)} disagreements", file=sys.stderr, flush=True)
                write(summary(total, args, time.perf_counter() - started), args.json)
    result = summary(total, args, time.perf_counter() - started)
    print(json.dumps(result, indent=2))
    write(result, args.json)
    return 1 if total.disagreements else 0


if __name__ == "__main__":
    sys.exit(main())
