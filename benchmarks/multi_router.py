"""Several router replicas behind a client-side round robin: how much hit rate survives.

``python -m kvroute.benchmarks.multi_router --routers 1,2,4 [kvroute bench's workload and fleet flags]``

For each router count N it starts N ``kvroute serve --policy cache_aware`` replicas in
front of the same simulated engines and sends the workload request by request to router
``i % N``, as a client-side load balancer would (a conversation's turns alternate between
routers). Two modes per N > 1: ``approximate`` (each router learns only from what it
routed) and ``exchange`` (routers publish their placements to each other,
``--peer-bind``/``--peers``), and ``workers``: one ``kvroute serve --workers N`` (its
workers exchange placements; the kernel spreads the client's connections over them, each
worker sees only its own connections' load). Reports the engine-observed hit rate and its
ratio to the single router's, median and spread over ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import orjson

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.bench import RunSettings, _sim_fleet, _token_range, build_parser, default_block_size, summarize
from kvroute.benchmarks.fleet import SimFleet, free_port
from kvroute.benchmarks.replay import Progress, replay
from kvroute.benchmarks.workloads import Workload, WorkloadOptions, make_workloads

MODES = ("approximate", "exchange", "workers")


@dataclass(frozen=True, slots=True)
class Arrangement:
    """N router replicas, and whether they exchange placements."""

    routers: int
    mode: str

    @property
    def name(self) -> str:
        if self.routers == 1:
            return "one router"
        if self.mode == "workers":
            return f"one router, --workers {self.routers}"
        return f"{self.routers} routers, {self.mode}"


@dataclass(frozen=True, slots=True)
class Row:
    arrangement: str
    workload: str
    hit_rates: list[float]
    ttft_p99_s: list[float]

    @property
    def hit_rate(self) -> float:
        return statistics.median(self.hit_rates)


def arrangements(counts: Sequence[int]) -> list[Arrangement]:
    return [Arrangement(n, mode) for n in counts for mode in (MODES if n > 1 else MODES[:1])]


async def start_routers(
    arrangement: Arrangement, fleet: SimFleet, tokenizer: str | None
) -> list[fleets.ManagedProcess]:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(arrangement.routers)]
    if arrangement.mode == "workers":  # one router process; its workers wait for each other's subscriptions
        endpoints = endpoints[:1]
    routers = []
    try:
        for endpoint in endpoints:
            extra: list[str] = []
            if arrangement.mode == "exchange" and arrangement.routers > 1:
                peers = [other for other in endpoints if other != endpoint]
                extra = ["--peer-bind", endpoint, "--peers", ",".join(peers)]
            elif arrangement.mode == "workers":
                extra = ["--workers", str(arrangement.routers)]
            routers.append(
                await fleets.start_router(
                    "cache_aware",
                    fleet.urls,
                    block_size=fleets.router_block_size(fleet.api, fleet.block_size),
                    capacity_tokens=fleet.capacity_tokens,
                    tokenizer=tokenizer,
                    extra_args=extra,
                )
            )
        await asyncio.sleep(0.5)  # ZMQ subscriptions reach their publishers
    except BaseException:
        fleets.stop_all(routers)
        raise
    return routers


async def run_one(
    arrangement: Arrangement, workload: Workload, fleet: SimFleet, settings: RunSettings, tokenizer: str | None
) -> tuple[float, float]:
    """(engine-observed hit rate, TTFT p99 in seconds) of one run."""
    await fleet.fresh()
    routers = await start_routers(arrangement, fleet, tokenizer)
    try:
        before = await fleets.engine_counters(fleet.urls)
        progress = Progress(len(workload.requests), f"{workload.name} / {arrangement.name}")
        run = await replay(
            [router.url for router in routers],
            workload.requests,
            speedup=settings.speedup,
            max_in_flight=settings.max_in_flight,
            progress=progress,
        )
        after = await fleets.engine_counters(fleet.urls)
    finally:
        fleets.stop_all(routers)
    result = summarize(arrangement.name, workload, run, {url: after[url] - before[url] for url in fleet.urls}, None)
    return result.hit_rate_observed or 0.0, result.ttft_p99_s or 0.0


def format_rows(rows: Sequence[Row]) -> str:
    baseline = {row.workload: row.hit_rate for row in rows if row.arrangement == "one router"}
    lines = [
        "| workload | routers | hit rate (median) | spread | of one router | TTFT p99 (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        base = baseline.get(row.workload)
        share = f"{row.hit_rate / base:.3f}" if base else "—"
        spread = f"{min(row.hit_rates):.3f}-{max(row.hit_rates):.3f}"
        ttft = statistics.median(row.ttft_p99_s)
        lines.append(f"| {row.workload} | {row.arrangement} | {row.hit_rate:.3f} | {spread} | {share} | {ttft:.3f} s |")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    counts = [int(value) for value in args.routers.split(",")]
    first_token, end_token = _token_range(args.tokenizer)
    options = WorkloadOptions(
        vocab_size=end_token,
        first_token_id=first_token,
        model=args.model or "sim",
        seed=args.seed,
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        conversations=args.conversations,
        sessions=tuple(int(count) for count in args.sessions.split(",")),
        agent_turns=args.agent_turns,
        agent_scale=args.agent_scale,
        limit=args.limit,
        max_output_tokens=args.max_output_tokens,
        think_time=args.think_time,
        arrival_rate=args.arrival_rate,
    )
    workloads = [w for spec in args.workload or ["agent-sessions"] for w in make_workloads(spec, options)]
    if args.block_size is None:
        args.block_size = default_block_size(args.api)
    fleet = _sim_fleet(args, args.time_scale, args.prefill_tokens_per_s)
    settings = RunSettings(
        speedup=args.speedup or args.time_scale, max_in_flight=args.max_in_flight, time_scale=args.time_scale
    )
    rows = []
    try:
        for workload in workloads:
            runs: dict[Arrangement, list[tuple[float, float]]] = {a: [] for a in arrangements(counts)}
            for _ in range(args.repeat):  # rounds: every arrangement once, then again
                for arrangement, results in runs.items():
                    results.append(await run_one(arrangement, workload, fleet, settings, args.tokenizer))
            rows += [Row(a.name, workload.name, [h for h, _ in r], [t for _, t in r]) for a, r in runs.items()]
    finally:
        fleet.stop()
    print(format_rows(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "multi_router.json").write_bytes(
            orjson.dumps([asdict(row) | {"hit_rate": row.hit_rate} for row in rows], option=orjson.OPT_INDENT_2)
        )
    return 0


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--routers", default="1,2", help="router replica counts to compare (comma separated)")
    mine, rest = own.parse_known_args(argv)
    parser = build_parser()
    parser.prog = "python -m kvroute.benchmarks.multi_router"
    args = parser.parse_args(rest)
    args.routers = mine.routers
    return fleets.run_stoppable(_main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
