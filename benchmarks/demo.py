"""``kvroute demo``: two sim engines, a router, round_robin vs cache_aware, side by side.

Offline, no GPU, under a minute: it starts two simulated vLLM replicas and, for each of
``round_robin`` and ``cache_aware``, empty engines and a fresh ``kvroute serve`` in front,
then sends the same short multi-user workload (users sharing one long system prompt, a few
turns each) and prints the engine-observed prefix-cache hit rate and time to first token of
each policy. Everything it starts runs in its own process group and is stopped at the end,
on Ctrl-C and on SIGTERM. ``--keep-running`` leaves a cache_aware router up afterwards so
its ``/metrics`` can be looked at.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.bench import RunSettings, run_target, unbounded_hit_rate
from kvroute.benchmarks.fleet import SimFleet, SimSpec
from kvroute.benchmarks.results import TargetResult
from kvroute.benchmarks.workloads import WorkloadOptions, make_workloads

POLICIES = ("round_robin", "cache_aware")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute demo",
        description="Two simulated engines and a router: round_robin vs cache_aware on the "
        "same multi-user workload, engine-observed hit rate and TTFT side by side.",
    )
    parser.add_argument("--users", type=int, default=5, help="users sharing the system prompt")
    parser.add_argument("--turns", type=int, default=4, help="turns per user")
    parser.add_argument("--system-tokens", type=int, default=1500, help="length of the shared system prompt")
    parser.add_argument(
        "--user-tokens", type=int, default=500, help="length of each user message (each reply is 60 %% of it)"
    )
    parser.add_argument("--kv-capacity-tokens", type=int, default=32768, help="KV cache of each sim engine")
    parser.add_argument(
        "--time-scale", type=float, default=4.0, help="sim engines run this many times faster than a real GPU"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="afterwards keep a cache_aware router and the engines up until Ctrl-C, to look at /metrics",
    )
    return parser


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ms(value: float | None, time_scale: float) -> str:
    return "-" if value is None else f"{value * time_scale * 1000:.0f} ms"


def side_by_side(results: list[TargetResult]) -> str:
    """The demo's table: one column per policy."""
    rows = [
        ("", *(result.target for result in results)),
        ("requests (errors)", *(f"{r.requests} ({r.errors})" for r in results)),
        ("engine-observed hit rate", *(_percent(r.hit_rate_observed) for r in results)),
        ("router-predicted hit rate", *(_percent(r.hit_rate_predicted) for r in results)),
        ("TTFT p50 (GPU time)", *(_ms(r.ttft_p50_s, r.time_scale) for r in results)),
        ("TTFT p99 (GPU time)", *(_ms(r.ttft_p99_s, r.time_scale) for r in results)),
        (
            "prompt tokens per engine",
            *(" / ".join(f"{share.prompt_tokens:.0%}" for share in r.backend_share.values()) for r in results),
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


async def _keep_running(fleet: SimFleet) -> None:
    router = await fleets.start_router(
        "cache_aware", fleet.urls, block_size=fleet.block_size, capacity_tokens=fleet.capacity_tokens
    )
    try:
        print(f"\ncache_aware router: {router.url}  (metrics: {router.url}/metrics)")
        for url in fleet.urls:
            print(f"sim engine:         {url}  (metrics: {url}/metrics)")
        print("Ctrl-C to stop.")
        while True:
            await asyncio.sleep(3600)
    finally:
        router.stop()


async def _main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    spec = SimSpec(replicas=2, kv_capacity_tokens=args.kv_capacity_tokens, time_scale=args.time_scale)
    options = WorkloadOptions(
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=args.user_tokens,
        reply_tokens=args.user_tokens * 3 // 5,
        seed=args.seed,
    )
    (workload,) = make_workloads("system-prompt", options)
    settings = RunSettings(speedup=args.time_scale, max_in_flight=64, time_scale=args.time_scale)
    print(f"kvroute demo: 2 sim engines, {workload.description}, {len(workload.requests)} requests per policy")
    fleet = SimFleet(spec)
    results: list[TargetResult] = []
    try:
        for policy in POLICIES:

            def ready(url: str, policy: str = policy) -> None:
                print(f"{policy}: router at {url}, its metrics at {url}/metrics", flush=True)

            results.append(await run_target(policy, workload, fleet, settings, None, ready))
        bound, _ = unbounded_hit_rate(workload, spec.block_size, None)
        print()
        print(side_by_side(results))
        print(f"(one unbounded cache over the same requests would hit {bound:.0%})")
        print(
            f"\n({time.monotonic() - started:.0f} s. Engines: {' '.join(fleet.urls)}, "
            "each with vLLM's metrics at /metrics. TTFT is the measured wall time times the "
            f"sims' time scale ({args.time_scale:g}). Run 'kvroute demo --keep-running' to "
            "keep a router up and browse its /metrics.)"
        )
        if args.keep_running:
            await _keep_running(fleet)
    finally:
        fleet.stop()
    failed = sum(result.errors for result in results)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    """``kvroute demo``."""
    args = build_parser().parse_args(argv)
    if args.users < 1 or args.turns < 1:
        print("kvroute demo: --users and --turns must be at least 1", file=sys.stderr)
        return 2
    return fleets.run_stoppable(_main(args))
