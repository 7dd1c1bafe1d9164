"""1M-token prompts through ``kvroute serve``: what they stall for the small requests around them.

    python -m kvroute.benchmarks.huge_prompts_served [--huge-tokens 1000000] [--huge-prompts 3]
        [--small-rate 200] [--quiet-s 2] [--rounds 3] [--baseline TREE] [--out FILE]

``bench_long_prompts`` times the routing of such prompts in one process, the proxy's steps
called by hand. This runs the real server: ``kvroute serve --policy cache_aware`` in front of
two trivial upstreams (``kvroute bench --overhead``'s: fixed answers, no work), ~2 KB chats
sent at ``--small-rate`` per second in an open loop (each latency counted from its due
time, so a stalled router shows as latency), and, after ``--quiet-s`` of small chats alone,
``--huge-prompts`` chats carrying a fresh ``--huge-tokens`` document (3.5 MB bodies at 1M)
sent one after another, each when the one before was answered. Everything the server does
with such a body counts: reading it, parsing, tokenizing in a worker thread, routing,
inserting its blocks, sending it upstream and relaying the answer.

Reported per round and target: the small chats' p50, p99 and worst latency before the huge
prompts and while they are in flight, and each huge prompt's latency. ``--baseline TREE``
also serves the policy from another checkout (target ``cache_aware@baseline``), the two
measured alternately in each round. The load generator shares the machine with the
router: on a small machine compare the targets within a round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.bench_long_prompts import huge_body
from kvroute.benchmarks.fleet import ManagedProcess
from kvroute.benchmarks.overhead import MODEL, LoadClient, baseline_env, chat_bodies, send_at_rate, start_upstream
from kvroute.benchmarks.results import machine, percentile

POLICY = "cache_aware"


@dataclass(frozen=True, slots=True)
class PhaseLatency:
    """Small chats' latency from their due time over one phase (ms)."""

    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, latencies_s: Sequence[float], errors: int) -> PhaseLatency:
        values = [latency * 1000 for latency in latencies_s]
        return cls(
            requests=len(values) + errors,
            errors=errors,
            p50_ms=round(percentile(values, 50) or 0.0, 2),
            p99_ms=round(percentile(values, 99) or 0.0, 2),
            max_ms=round(max(values, default=0.0), 2),
        )


@dataclass(frozen=True, slots=True)
class ServedRun:
    """One target in one round."""

    target: str
    round: int
    before: PhaseLatency
    during: PhaseLatency
    huge_ms: list[float]
    huge_errors: int


async def _run(
    target: str, number: int, url: str, small: list[bytes], huge: list[bytes], rate: float, quiet_s: float
) -> ServedRun:
    """Round ``number`` of ``target`` at ``url``: small chats at ``rate`` until every huge prompt was answered (and ``quiet_s`` before
    the first); the run's phases split at the first huge prompt's send."""
    client = LoadClient(url, small, connections=512)
    try:
        await asyncio.gather(*(client.one() for _ in range(64)))  # warm connections and caches
        done = False
        sender = asyncio.create_task(send_at_rate(client, rate, lambda _sent: not done))
        await asyncio.sleep(quiet_s)
        huge_from = time.perf_counter()
        huge_ms: list[float] = []
        huge_errors = 0
        for body in huge:
            started = time.perf_counter()
            try:
                ok = await client.post(body)
            except (TimeoutError, aiohttp.ClientError):
                ok = False
            if ok:
                huge_ms.append(round((time.perf_counter() - started) * 1000, 1))
            else:
                huge_errors += 1
        done = True
        await sender
    finally:
        await client.close()
    answered = list(zip(client.due, client.latencies, strict=True))

    def phase(during: bool) -> PhaseLatency:
        """The small chats due before the first huge prompt was sent, or from then on."""
        latencies = [latency for due, latency in answered if (due >= huge_from) == during]
        return PhaseLatency.of(latencies, sum((due >= huge_from) == during for due in client.failed_due))

    return ServedRun(
        target=target,
        round=number,
        before=phase(during=False),
        during=phase(during=True),
        huge_ms=huge_ms,
        huge_errors=huge_errors,
    )


async def measure(
    huge_tokens: int, huge_prompts: int, rate: float, quiet_s: float, rounds: int, baseline: Path | None
) -> list[ServedRun]:
    upstreams = [start_upstream() for _ in range(2)]
    routers: dict[str, ManagedProcess] = {}
    small = chat_bodies(per_prompt=4)
    try:
        await asyncio.gather(*(upstream.wait_ready() for upstream in upstreams))
        urls = [upstream.url for upstream in upstreams]
        routers[POLICY] = await fleets.start_router(POLICY, urls)
        if baseline is not None:
            routers[f"{POLICY}@baseline"] = await fleets.start_router(POLICY, urls, env=baseline_env(baseline))
        runs: list[ServedRun] = []
        seed = 0
        for number in range(rounds):
            for target, router in routers.items():
                huge = [huge_body(huge_tokens, seed + k, MODEL) for k in range(huge_prompts)]
                seed += huge_prompts  # every huge prompt is new to every router
                runs.append(await _run(target, number, router.url, small, huge, rate, quiet_s))
                print(format_run(runs[-1]), flush=True)
        return runs
    finally:
        for router in routers.values():
            router.stop()
        for upstream in upstreams:
            upstream.stop()


def format_run(run: ServedRun) -> str:
    before, during = run.before, run.during
    return (
        f"round {run.round} {run.target:22s} small before p50/p99/max {before.p50_ms}/{before.p99_ms}/"
        f"{before.max_ms} ms ({before.requests}, {before.errors} errors); during {during.p50_ms}/"
        f"{during.p99_ms}/{during.max_ms} ms ({during.requests}, {during.errors} errors); huge "
        f"{'/'.join(f'{ms:.0f}' for ms in run.huge_ms)} ms ({run.huge_errors} errors)"
    )


def summary(runs: Sequence[ServedRun]) -> str:
    lines = ["medians over rounds: small chats' p99 before / during, worst during, huge prompt latency (ms)"]
    for target in dict.fromkeys(run.target for run in runs):
        mine = [run for run in runs if run.target == target]
        lines.append(
            f"  {target:22s} {statistics.median(r.before.p99_ms for r in mine):8.2f} "
            f"{statistics.median(r.during.p99_ms for r in mine):8.2f} "
            f"{statistics.median(r.during.max_ms for r in mine):8.2f} "
            f"{statistics.median(ms for r in mine for ms in r.huge_ms) if any(r.huge_ms for r in mine) else 0:8.0f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.huge_prompts_served", description=__doc__)
    parser.add_argument("--huge-tokens", type=int, default=1_000_000)
    parser.add_argument("--huge-prompts", type=int, default=3)
    parser.add_argument("--small-rate", type=float, default=200.0, help="small chats per second")
    parser.add_argument("--quiet-s", type=float, default=2.0, help="small chats alone before the huge prompts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another kvroute checkout, served alongside")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    runs = asyncio.run(
        measure(args.huge_tokens, args.huge_prompts, args.small_rate, args.quiet_s, args.rounds, args.baseline)
    )
    print(summary(runs))
    print(machine())
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "argv": sys.argv[1:] if argv is None else list(argv),
            "machine": machine(),
            "python": platform.python_version(),
            "huge_tokens": args.huge_tokens,
            "small_rate": args.small_rate,
            "baseline": str(args.baseline) if args.baseline else None,
            "runs": [asdict(run) for run in runs],
        }
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0 if all(run.huge_errors == 0 and run.during.errors == 0 for run in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
