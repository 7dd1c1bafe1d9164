"""A change's CPU per request against a baseline tree's, both loaded at the same time.

    python3 -m kvroute.benchmarks.paired_ab --baseline DIR --policy round_robin \\
        --rate 400 --rounds 12 --seconds 3 [--new-words 20] [--bodies agent] [--out FILE]

``kvroute bench --overhead --baseline DIR`` measures the two trees one after the other;
on a shared machine whose load drifts within seconds, their CPU per request then spreads
by more than a change of a few percent. Here the trivial upstreams of the overhead
benchmark serve a ``kvroute serve --policy POLICY`` of this tree and one of ``DIR``
(both served as ``--baseline`` serves a tree, and started together, so that nothing but
the trees differs), and both get the same fixed offered rate at the
same time, so both see the same machine: each round's ratio of their CPU per request
cancels the drift. A fixed rate rather than closed loops: at saturation the cheaper
router serves more requests per event-loop turn, which lowers its CPU per request further
and amplifies noise into the ratio. The two start in alternate order each round.

Reports the median ratio with its quartiles and range over the rounds, and in how many
rounds this tree was the cheaper one; ``--out`` writes every round as JSON. With
``--new-words N`` every request brings N new words, as ``kvroute bench --overhead
--new-words N`` sends them (the same sequence of bodies to both routers); ``--bodies
agent`` sends its agent conversations instead of plain chats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.overhead import (
    BODY_KINDS,
    BodySource,
    LoadRun,
    NewWords,
    baseline_env,
    bodies_of,
    closed_loop,
    fixed_rate,
    start_upstream,
)

#: This checkout's source tree (the folder holding ``router/`` and ``benchmarks/``).
THIS_TREE = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class PairedRound:
    cpu_us: float
    baseline_cpu_us: float
    requests_per_s: float
    baseline_requests_per_s: float
    errors: int

    @property
    def ratio(self) -> float:
        """This tree's CPU per request over the baseline's; NaN when the baseline read no CPU
        (under one tick of ``/proc``'s 10 ms in a short round on a quiet machine)."""
        return self.cpu_us / self.baseline_cpu_us if self.baseline_cpu_us > 0 else math.nan


@dataclass(slots=True)
class PairedSummary:
    policy: str
    rate_per_s: float
    seconds: float
    rounds: int
    cpu_us_median: float
    baseline_cpu_us_median: float
    ratio_median: float
    ratio_quartiles: tuple[float, float]
    ratio_range: tuple[float, float]
    rounds_cheaper: int
    errors: int
    #: New words in every request's last turn (0: the repeated bodies).
    new_words: int = 0
    #: The bodies sent (``overhead.BODY_KINDS``).
    bodies: str = "chat"


def summarize(
    policy: str, rate: float, seconds: float, rounds: list[PairedRound], new_words: int = 0, bodies: str = "chat"
) -> PairedSummary:
    """Medians over the rounds; the ratio's over the rounds where both sides read CPU."""
    ratios = [ratio for ratio in (item.ratio for item in rounds) if math.isfinite(ratio) and ratio > 0]
    if not ratios:
        ratios = [math.nan]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return PairedSummary(
        policy=policy,
        rate_per_s=rate,
        seconds=seconds,
        rounds=len(rounds),
        cpu_us_median=statistics.median(item.cpu_us for item in rounds),
        baseline_cpu_us_median=statistics.median(item.baseline_cpu_us for item in rounds),
        ratio_median=statistics.median(ratios),
        ratio_quartiles=(quartiles[0], quartiles[2]),
        ratio_range=(min(ratios), max(ratios)),
        rounds_cheaper=sum(ratio < 1.0 for ratio in ratios),
        errors=sum(item.errors for item in rounds),
        new_words=new_words,
        bodies=bodies,
    )


def _cpu_us(run: LoadRun) -> float:
    cpu_us = run.cpu_us_per_request
    assert cpu_us is not None, "a router run with no CPU reading or no requests answered"
    return cpu_us


async def paired_rounds(
    policy: str,
    baseline: Path,
    rate: float,
    seconds: float,
    rounds: int,
    extra_args: list[str],
    new_words: int = 0,
    body_kind: str = "chat",
) -> list[PairedRound]:
    upstreams = [start_upstream() for _ in range(2)]
    routers: list[fleets.ManagedProcess] = []
    try:
        await asyncio.gather(*(upstream.wait_ready() for upstream in upstreams))
        urls = [upstream.url for upstream in upstreams]
        # Both trees are served the same way (a layout on PYTHONPATH) and started together:
        # this checkout served as installed read 0.955 against itself as a layout in 16 of 16
        # rounds, a launch bias as large as the changes being measured.
        started = await asyncio.gather(
            *(
                fleets.start_router(policy, urls, extra_args=extra_args, env=baseline_env(tree))
                for tree in (THIS_TREE, baseline)
            ),
            return_exceptions=True,
        )
        routers += [router for router in started if isinstance(router, fleets.ManagedProcess)]
        for failure in started:
            if isinstance(failure, BaseException):
                raise failure
        bodies = bodies_of(body_kind)
        for router in routers:  # every body once: both measured in their steady state
            await closed_loop(router.url, bodies, 32, 0.0, None, requests=len(bodies))
        # With new words, each router its own source of the same bodies: both see the same text.
        sent: dict[int, BodySource] = {
            router.pid: NewWords(bodies, new_words) if new_words else bodies for router in routers
        }
        results = []
        for number in range(rounds):
            order = routers if number % 2 == 0 else routers[::-1]
            runs = await asyncio.gather(*(fixed_rate(r.url, sent[r.pid], rate, seconds, r.pid, 64) for r in order))
            ours, theirs = runs if number % 2 == 0 else runs[::-1]
            result = PairedRound(
                cpu_us=_cpu_us(ours),
                baseline_cpu_us=_cpu_us(theirs),
                requests_per_s=ours.requests / ours.seconds,
                baseline_requests_per_s=theirs.requests / theirs.seconds,
                errors=ours.errors + theirs.errors,
            )
            print(
                f"round {number + 1}/{rounds}: {result.cpu_us:.0f} us/request against {result.baseline_cpu_us:.0f}"
                f" (ratio {result.ratio:.3f}), errors {result.errors}",
                file=sys.stderr,
            )
            results.append(result)
        return results
    finally:
        for router in routers:
            router.stop()
        for upstream in upstreams:
            upstream.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m kvroute.benchmarks.paired_ab", description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the kvroute source tree to compare with")
    parser.add_argument("--policy", default="round_robin")
    parser.add_argument("--rate", type=float, default=400.0, help="requests/s offered to each router")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=3.0, help="per round")
    parser.add_argument(
        "--new-words", type=int, default=0, help="new words in every request's last turn (as bench --overhead)"
    )
    parser.add_argument("--bodies", choices=BODY_KINDS, default="chat", help="as kvroute bench --overhead sends")
    parser.add_argument("--out", type=Path)
    parser.add_argument("router_args", nargs="*", help="extra kvroute serve flags for both (after --)")
    args = parser.parse_args(argv)

    async def run() -> int:
        rounds = await paired_rounds(
            args.policy,
            args.baseline,
            args.rate,
            args.seconds,
            args.rounds,
            args.router_args,
            args.new_words,
            args.bodies,
        )
        summary = summarize(args.policy, args.rate, args.seconds, rounds, args.new_words, args.bodies)
        low, high = summary.ratio_quartiles
        print(
            f"{summary.policy} at {summary.rate_per_s:.0f}/s each: {summary.cpu_us_median:.0f} us/request against"
            f" {summary.baseline_cpu_us_median:.0f} at baseline; ratio {summary.ratio_median:.3f}"
            f" (quartiles {low:.3f}-{high:.3f}, range {summary.ratio_range[0]:.3f}-{summary.ratio_range[1]:.3f}),"
            f" cheaper in {summary.rounds_cheaper} of {summary.rounds} rounds, errors {summary.errors}"
        )
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            document = {"summary": asdict(summary), "rounds": [asdict(item) for item in rounds]}
            args.out.write_text(json.dumps(document, indent=2) + "\n")
        return 0

    return fleets.run_stoppable(run())


if __name__ == "__main__":
    sys.exit(main())
