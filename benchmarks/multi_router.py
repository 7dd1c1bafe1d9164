"""Several router replicas behind a client-side round robin: how much hit rate survives.

``python -m kvroute.benchmarks.multi_router --routers 1,2,4 [--index approximate,precise]
[kvroute bench's workload and fleet flags]``

For each router count N it starts N ``kvroute serve --policy cache_aware`` replicas in
front of the same engines (sims, or ``--engine URL,...``) and sends the workload request by
request to router ``i % N``, as a client-side load balancer would (a conversation's turns
alternate between routers). The arrangements per N > 1 (``--modes``): ``approximate``
(each router learns only from what it routed), ``exchange`` (routers publish their
placements and load to each other, ``--peer-bind``/``--peers``), ``workers`` (one
``kvroute serve --workers N``: its workers exchange; the kernel spreads the client's
connections over them) and, when asked for, ``relay`` (N exchanging routers of 2 workers
each: their supervisors relay the workers' messages on ``--peer-bind``). ``--index
precise`` runs every arrangement again in precise mode: the engines publish KV events and
every router keeps its index from them (sims: their own endpoints; ``--engine URL,...``:
``--kv-events-endpoints``). Reports the engine-observed hit rate and its ratio to the single
router's of the same index mode, median and spread over ``--repeat`` rounds. A precise run
whose routers no longer read every engine's events at its end is refused and counted (the
router's log on stderr); the exit status is 1 when an arrangement has no run left.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import orjson

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.bench import (
    RunSettings,
    _csv,
    _served_model,
    _sim_spec,
    _token_range,
    build_parser,
    default_block_size,
    summarize,
)
from kvroute.benchmarks.fleet import ExternalFleet, KVEventEndpoints, SimFleet, free_port
from kvroute.benchmarks.replay import Progress, replay
from kvroute.benchmarks.workloads import Workload, WorkloadOptions, make_workloads
from kvroute.router.backend_url import rank_names
from kvroute.router.routing.kv_events import KVEventsState

PRECISE = int(KVEventsState.PRECISE)

MODES = ("approximate", "exchange", "workers", "relay")
#: What runs unless ``--modes`` says otherwise (``relay``: N routers of 2 workers each,
#: exchanging through their supervisors' ``--peer-bind``).
DEFAULT_MODES = MODES[:3]
#: Workers of each router in the ``relay`` mode.
RELAY_WORKERS = 2
INDEXES = ("approximate", "precise")


@dataclass(frozen=True, slots=True)
class Arrangement:
    """N router replicas, whether they exchange placements, and whether their indexes
    follow the engines' KV events (precise) or their own placements (approximate)."""

    routers: int
    mode: str
    precise: bool = False

    @property
    def name(self) -> str:
        if self.routers == 1:
            name = "one router"
        elif self.mode == "workers":
            name = f"one router, --workers {self.routers}"
        elif self.mode == "relay":
            name = f"{self.routers} routers of {RELAY_WORKERS} workers, exchange"
        elif self.precise and self.mode == "approximate":
            name = f"{self.routers} routers, alone"  # each on its own, every index from the events
        else:
            name = f"{self.routers} routers, {self.mode}"
        return name + (", precise" if self.precise else "")

    @property
    def single(self) -> Arrangement:
        """The one router this arrangement is compared with: same index mode."""
        return Arrangement(1, MODES[0], self.precise)


class NotPrecise(fleets.FleetError):
    """A precise run whose routers no longer read every engine's events at its end: it
    measured approximate routing, so it is refused (the series goes on without it)."""


@dataclass(frozen=True, slots=True)
class Row:
    arrangement: str
    workload: str
    hit_rates: list[float]
    ttft_p99_s: list[float]
    #: The arrangement its hit rate is compared with: one router of the same index mode.
    compared_with: str
    #: Runs refused (:class:`NotPrecise`), not among the figures.
    refused: int = 0

    @property
    def hit_rate(self) -> float | None:
        return statistics.median(self.hit_rates) if self.hit_rates else None


def arrangements(
    counts: Sequence[int], indexes: Sequence[str] = INDEXES[:1], modes: Sequence[str] = DEFAULT_MODES
) -> list[Arrangement]:
    return [
        Arrangement(n, mode, index == "precise")
        for index in indexes
        for n in counts
        for mode in (modes if n > 1 else MODES[:1])
    ]


async def start_routers(
    arrangement: Arrangement, fleet: SimFleet | ExternalFleet, tokenizer: str | None
) -> list[fleets.ManagedProcess]:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(arrangement.routers)]
    if arrangement.mode == "workers":  # one router process; its workers wait for each other's subscriptions
        endpoints = endpoints[:1]
    routers = []
    try:
        for endpoint in endpoints:
            extra: list[str] = []
            if arrangement.mode in ("exchange", "relay") and arrangement.routers > 1:
                peers = [other for other in endpoints if other != endpoint]
                extra = ["--peer-bind", endpoint, "--peers", ",".join(peers)]
                if arrangement.mode == "relay":
                    extra += ["--workers", str(RELAY_WORKERS)]
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
                    kv_events=fleet.kv_events if arrangement.precise else None,
                    data_parallel_size=fleet.data_parallel_size,
                )
            )
        await asyncio.sleep(0.5)  # ZMQ subscriptions reach their publishers
    except BaseException:
        fleets.stop_all(routers)
        raise
    return routers


async def run_one(
    arrangement: Arrangement,
    workload: Workload,
    fleet: SimFleet | ExternalFleet,
    settings: RunSettings,
    tokenizer: str | None,
) -> tuple[float, float]:
    """(engine-observed hit rate, TTFT p99 in seconds) of one run."""
    if arrangement.precise and isinstance(fleet, SimFleet):
        # Fresh sims: their event streams start at the routers' first request, so every
        # router is precise from the engine's first batch, not replaying earlier runs.
        fleet.stop()
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
        served = {url: after[url] - before[url] for url in fleet.urls}
        if arrangement.precise:  # an engine that served nothing published nothing to follow
            urls = [url for url, counters in served.items() if counters.requests > 0]
            await _check_precise(routers, urls, fleet.data_parallel_size)
    finally:
        fleets.stop_all(routers)
    result = summarize(arrangement.name, workload, run, served, None)
    return result.hit_rate_observed or 0.0, result.ttft_p99_s or 0.0


async def _check_precise(routers: Sequence[fleets.ManagedProcess], urls: Sequence[str], ranks: int = 1) -> None:
    """Every router still reads the events of every engine that served the run at its end
    (state 1; ``--workers``: the highest of its workers'), or the run measured approximate
    routing. Of a data-parallel engine (``ranks``), every rank whose stream carried a message:
    the engine's counters do not say which ranks served."""
    for router in routers:
        streams = await fleets.kv_event_streams(router.url)
        states = streams.states
        backends = [name for url in urls for name in rank_names(url, ranks) if ranks == 1 or streams.counts.get(name)]
        lost = [url for url in backends if states.get(url) != PRECISE]
        if lost:
            counts = {url: streams.counts.get(url, {}) for url in lost}
            raise NotPrecise(
                f"{router.name}: not precise for {lost} at the end of the run ({states}; their streams' "
                f"counters {counts}); its log:\n{router.log_tail()}"
            )


def format_rows(rows: Sequence[Row]) -> str:
    hit_rates = {(row.workload, row.arrangement): row.hit_rate for row in rows}
    lines = [
        "| workload | routers | hit rate (median) | spread | of one router | TTFT p99 (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        name = row.arrangement + (
            f" ({row.refused} of {row.refused + len(row.hit_rates)} refused)" if row.refused else ""
        )
        if row.hit_rate is None:
            lines.append(f"| {row.workload} | {name} | — | — | — | — |")
            continue
        base = hit_rates.get((row.workload, row.compared_with))
        share = f"{row.hit_rate / base:.3f}" if base else "—"
        spread = f"{min(row.hit_rates):.3f}-{max(row.hit_rates):.3f}"
        ttft = statistics.median(row.ttft_p99_s)
        lines.append(f"| {row.workload} | {name} | {row.hit_rate:.3f} | {spread} | {share} | {ttft:.3f} s |")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    counts = [int(value) for value in args.routers.split(",")]
    first_token, end_token = _token_range(args.tokenizer)
    external = args.engine != "sim"
    options = WorkloadOptions(
        vocab_size=end_token,
        first_token_id=first_token,
        model=args.model or (await _served_model(_csv(args.engine)[0]) if external else "sim"),
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
    precise = "precise" in args.index
    fleet: SimFleet | ExternalFleet
    if not external:
        fleet = SimFleet(replace(_sim_spec(args, args.time_scale, args.prefill_tokens_per_s), kv_events=precise))
        settings = RunSettings(
            speedup=args.speedup or args.time_scale, max_in_flight=args.max_in_flight, time_scale=args.time_scale
        )
    else:
        events = [KVEventEndpoints(e, r) for e, r in zip(args.kv_events_endpoints, args.kv_events_replay_endpoints)]
        fleet = ExternalFleet(
            _csv(args.engine),
            block_size=args.block_size,
            capacity_tokens=args.kv_capacity_tokens,
            api=args.api,
            kv_events=events if precise else (),
            data_parallel_size=args.data_parallel_size,
        )
        settings = RunSettings(speedup=args.speedup or 1.0, max_in_flight=args.max_in_flight, time_scale=1.0)
    rows = []
    try:
        for workload in workloads:
            runs: dict[Arrangement, list[tuple[float, float]]] = {
                a: [] for a in arrangements(counts, args.index, args.modes)
            }
            refused = dict.fromkeys(runs, 0)
            for _ in range(args.repeat):  # rounds: every arrangement once, then again
                for arrangement, results in runs.items():
                    try:
                        results.append(await run_one(arrangement, workload, fleet, settings, args.tokenizer))
                    except NotPrecise as refusal:
                        refused[arrangement] += 1
                        print(f"{workload.name} / {arrangement.name}: refused, {refusal}", file=sys.stderr)
            rows += [
                Row(a.name, workload.name, [h for h, _ in r], [t for _, t in r], a.single.name, refused[a])
                for a, r in runs.items()
            ]
    finally:
        fleet.stop()
    print(format_rows(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "multi_router.json").write_bytes(
            orjson.dumps([asdict(row) | {"hit_rate": row.hit_rate} for row in rows], option=orjson.OPT_INDENT_2)
        )
    # Every arrangement measured at least once, or the table is missing a row's figures.
    return 0 if all(row.hit_rates for row in rows) else 1


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--routers", default="1,2", help="router replica counts to compare (comma separated)")
    own.add_argument(
        "--index", default="approximate", help="index modes to compare: approximate, precise or both (comma separated)"
    )
    own.add_argument(
        "--kv-events-endpoints",
        default="",
        help="--engine URL,...: each engine's KV-event PUB endpoint, in the same order (for --index precise)",
    )
    own.add_argument(
        "--kv-events-replay-endpoints", default="", help="--engine URL,...: each engine's replay endpoint, same order"
    )
    own.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"arrangements of N > 1 routers to run, of {', '.join(MODES)} (comma separated)",
    )
    mine, rest = own.parse_known_args(argv)
    parser = build_parser()
    parser.prog = "python -m kvroute.benchmarks.multi_router"
    args = parser.parse_args(rest)
    args.routers = mine.routers
    args.index = _csv(mine.index)
    unknown = sorted(set(args.index) - set(INDEXES))
    if unknown:
        parser.error(f"--index: unknown modes {unknown}; known: {', '.join(INDEXES)}")
    args.modes = _csv(mine.modes)
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    if args.engine == "virtual":
        parser.error("--engine virtual: several routers need engines that answer over HTTP (sim or URLs)")
    external = args.engine != "sim"
    if not external and args.data_parallel_size > 1:
        parser.error("--data-parallel-size needs --engine URL,... (sims have no ranks)")
    args.kv_events_endpoints = _csv(mine.kv_events_endpoints)
    args.kv_events_replay_endpoints = _csv(mine.kv_events_replay_endpoints) or [None] * len(args.kv_events_endpoints)
    if external and "precise" in args.index and len(args.kv_events_endpoints) != len(_csv(args.engine)):
        parser.error("--index precise with --engine URL,...: give every engine's --kv-events-endpoints")
    if len(args.kv_events_replay_endpoints) != len(args.kv_events_endpoints):
        parser.error("--kv-events-replay-endpoints: one per KV-event endpoint")
    return fleets.run_stoppable(_main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
