"""``kvroute bench``: replay workloads against one fleet under each routing target, side by side.

For every workload, every target gets the same requests at the same times against the same
engines with empty caches: each ``--policies`` entry behind a fresh ``kvroute serve``, each
installed ``--peer`` router, and ``bound``, the hit rate of one unbounded cache over the same
request sequence (computed offline with the same tokenizer and block size). A progress bar
goes to stderr, the table to stdout, and with ``--out DIR`` ``results.json`` and
``summary.png`` (see :mod:`kvroute.benchmarks.results`).

    kvroute bench --engine sim --replicas 4 --time-scale 10 \\
        --workload system-prompt --workload agent-sessions --sessions 4,8,16,32 \\
        --workload mooncake:../shared/traces/mooncake_conversation_trace.jsonl --limit 2000 \\
        --policies round_robin,sticky,cache_aware --peer sglang-router --out bench-out

``kvroute bench --overhead ...`` measures the router's own cost instead (see
:mod:`kvroute.benchmarks.overhead`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks import mooncake
from kvroute.benchmarks.bounds import Prompt, bounds
from kvroute.benchmarks.fleet import (
    PEERS,
    WHOLE_ENGINE,
    EngineCounters,
    ExternalFleet,
    Fleet,
    FleetError,
    RouterCounters,
    SimFleet,
    SimSpec,
)
from kvroute.benchmarks.placement_search import Placement, best, candidates, frontier, sessions_in_order
from kvroute.benchmarks.replay import Progress, ReplayResult, replay
from kvroute.benchmarks.results import (
    BEST_PLACEMENT_TARGET,
    BOUND_FLEET_TARGET,
    BOUND_TARGET,
    PEER_PREFIX,
    POOLED_LRU_TARGET,
    TargetResult,
    format_by_seed,
    format_repeats,
    format_table,
    percentile,
    plot_summary,
    ratio,
    shares,
    write_json,
)
from kvroute.benchmarks.virtual_fleet import VirtualFleet
from kvroute.benchmarks.wire import WIRES, on_wire
from kvroute.benchmarks.workloads import (
    CHAT_ENDPOINT,
    WORKLOAD_KINDS,
    Workload,
    WorkloadOptions,
    make_workloads,
)
from kvroute.router.config import POLICY_NAMES, Settings
from kvroute.router.routing.policies import LOAD_ONLY_POLICIES

#: Each sim engine's KV cache when ``--kv-capacity-tokens`` is not given.
DEFAULT_SIM_CAPACITY_TOKENS = 65536


def workload_prompts(workload: Workload, block_size: int, tokenizer_path: str | None) -> list[Prompt]:
    """Every request's prompt as block hashes, tokenized as the engines and routers do."""
    from kvroute.tokenizer_index import RequestTokenizer

    tokenizer = RequestTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else RequestTokenizer.default()
    prompts = []
    for request in workload.requests:
        body = request.body
        if request.endpoint == CHAT_ENDPOINT:
            tokens = tokenizer.encode_chat(body["messages"], tools=body.get("tools"))
        else:
            tokens = tokenizer.encode_prompt(body["prompt"])
        prompts.append(Prompt.of(tokens, block_size))
    return prompts


def unbounded_hit_rate(workload: Workload, block_size: int, tokenizer_path: str | None) -> tuple[float, int]:
    """(hit rate, prompt tokens) of one unbounded prefix cache over the workload, in order.

    Counted as an engine counts: whole blocks only, and never the whole prompt (the last
    token is always computed), so it is directly comparable with the engines' counters.
    """
    result = bounds(workload_prompts(workload, block_size, tokenizer_path), None)
    return result.bound, result.prompt_tokens


def sent_order(run: ReplayResult) -> list[int]:
    """Indices of the workload's requests in the order this run sent them."""
    return sorted(range(len(run.records)), key=lambda index: (run.records[index].sent_s, index))


#: Every fleet the bench runs: started sims, running engines, or sims in virtual time.
AnyFleet = Fleet | VirtualFleet


@dataclass(frozen=True, slots=True)
class RunSettings:
    """How requests are replayed, for every target alike."""

    speedup: float
    max_in_flight: int
    time_scale: float
    setting: str = ""  # the settings-sweep point this run belongs to, if any
    #: The API chat requests go over (:mod:`kvroute.benchmarks.wire`).
    wire: str = "chat"

    def in_flight_limit(self, workload: Workload) -> int:
        """The client's bound on requests in flight: ``--max-in-flight``, or the workload's
        own (a benchmark client's ``--max-concurrency``) when lower."""
        if workload.max_concurrency is None:
            return self.max_in_flight
        return min(self.max_in_flight, workload.max_concurrency)


def summarize(
    target: str,
    workload: Workload,
    run: ReplayResult,
    engines: dict[str, EngineCounters],
    router: RouterCounters | None,
) -> TargetResult:
    """A TargetResult from one replay and the counter deltas around it."""
    ok = [record for record in run.records if record.ok]
    queried = sum(counters.queried_tokens for counters in engines.values())
    hits = sum(counters.hit_tokens for counters in engines.values())
    reported_prompt = sum(record.prompt_tokens or 0 for record in ok)
    reported_cached = sum(record.cached_tokens or 0 for record in ok)
    observed = ratio(hits, queried) if queried > 0 else ratio(reported_cached, reported_prompt)
    predicted = ratio(router.predicted_cached_tokens, router.prompt_tokens) if router is not None else None
    engine_requests = {url: counters.requests for url, counters in engines.items()}
    engine_tokens = {url: counters.prompt_tokens for url, counters in engines.items()}
    if sum(engine_requests.values()) <= 0:  # engines without request counters: use headers
        engine_requests = dict(Counter(record.backend or "?" for record in ok))
        engine_tokens = {}
        for record in ok:
            key = record.backend or "?"
            engine_tokens[key] = engine_tokens.get(key, 0) + (record.prompt_tokens or 0)
    ttfts = [record.ttft_s for record in ok if record.ttft_s is not None]
    latencies = [record.latency_s for record in ok if record.latency_s is not None]
    return TargetResult(
        target=target,
        workload=workload.name,
        requests=len(run.records),
        errors=run.errors,
        hit_rate_observed=observed,
        hit_rate_predicted=predicted,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        throughput_rps=ratio(len(ok), run.duration_s),
        duration_s=run.duration_s,
        backend_share=shares(engine_requests, engine_tokens),
        prompt_tokens=reported_prompt,
        cached_tokens_reported=reported_cached,
        sessions=workload.sessions,
        error_sample=next((record.error for record in run.records if record.error), None),
    )


async def run_target(
    target: str,
    workload: Workload,
    fleet: Fleet,
    settings: RunSettings,
    tokenizer: str | None,
    on_ready: Callable[[str], None] | None = None,
    prompts: Sequence[Prompt] | None = None,
) -> TargetResult:
    """One target x workload: fresh engines, a fresh router, the replay, the counters.

    ``on_ready`` is called with the router's URL once it serves, before the replay starts.
    With the workload's ``prompts`` (:func:`workload_prompts`), the result carries the
    offline caches over the order this run sent the requests (:func:`attach_bounds`).
    """
    await fleet.fresh()
    is_peer = target.startswith(PEER_PREFIX)
    # Load-only policies predict nothing: their router keeps no prefix index.
    predicts = not is_peer and target.partition(WHOLE_ENGINE)[0] not in LOAD_ONLY_POLICIES
    front = await fleets.start_target(target, fleet, tokenizer=tokenizer)
    try:
        if on_ready is not None:
            on_ready(front.url)
        engines_before = await fleets.engine_counters(fleet.urls)
        router_before = await fleets.router_counters(front.url) if predicts else None
        progress = Progress(len(workload.requests), f"{workload.name} / {target}")
        run = await replay(
            front.url,
            [on_wire(request, settings.wire) for request in workload.requests],
            speedup=settings.speedup,
            max_in_flight=settings.in_flight_limit(workload),
            progress=progress,
        )
        engines_after = await fleets.engine_counters(fleet.urls)
        router_delta = None if router_before is None else await fleets.router_counters(front.url) - router_before
    finally:
        front.stop()
    deltas = {url: engines_after[url] - engines_before[url] for url in fleet.urls}
    result = summarize(target, workload, run, deltas, router_delta)
    await asyncio.to_thread(_complete, result, run, fleet, settings, prompts)
    return result


def run_virtual_target(
    target: str,
    workload: Workload,
    fleet: VirtualFleet,
    settings: RunSettings,
    tokenizer: str | None,
    prompts: Sequence[Prompt] | None = None,
    placement: Placement | None = None,
) -> TargetResult:
    """One policy x workload in virtual time (:mod:`kvroute.benchmarks.virtual_fleet`);
    with ``placement``, its fixed placement of sessions under a load-only policy instead."""
    policy = "round_robin" if placement is not None else target
    router = Settings(
        policy=policy, block_size=fleets.router_block_size(fleet.api, fleet.block_size), tokenizer=tokenizer
    )
    virtual = fleet.replay(
        workload,
        router,
        max_in_flight=settings.in_flight_limit(workload),
        placement=placement.replica_of if placement is not None else None,
    )
    predicts = policy not in LOAD_ONLY_POLICIES
    result = summarize(target, workload, virtual.result, virtual.engines, virtual.router if predicts else None)
    result.placement = placement.label if placement is not None else None
    _complete(result, virtual.result, fleet, settings, prompts)
    return result


def run_best_placement(
    workload: Workload,
    fleet: VirtualFleet,
    settings: RunSettings,
    tokenizer: str | None,
    prompts: Sequence[Prompt] | None = None,
) -> TargetResult:
    """Every candidate fixed placement (:mod:`kvroute.benchmarks.placement_search`) in
    virtual time; the one with the highest hit rate, each one's figures on stderr. Only the
    winner is replayed again for the offline caches over its order (a replay is
    deterministic; the caches cost more than the replay)."""
    runs = []
    for placement in candidates(sessions_in_order(workload.requests), len(fleet.urls)):
        result = run_virtual_target(BEST_PLACEMENT_TARGET, workload, fleet, settings, tokenizer, None, placement)
        print(
            f"kvroute bench: {workload.name} / placement {placement.label}: hit rate "
            f"{result.hit_rate_observed or 0.0:.3f}, TTFT p50 {result.ttft_p50_s or 0.0:.2f} s, "
            f"p99 {result.ttft_p99_s or 0.0:.2f} s",
            file=sys.stderr,
        )
        runs.append((placement, result))
    winner, result = best(runs)
    print(
        f"kvroute bench: {workload.name} / best placement: {winner.label}; frontier (hit rate, TTFT p99):",
        file=sys.stderr,
    )
    for placement, point in frontier(runs):
        print(
            f"    {placement.label}: {point.hit_rate_observed or 0.0:.3f}, {point.ttft_p99_s or 0.0:.2f} s",
            file=sys.stderr,
        )
    if prompts is None:
        return result
    return run_virtual_target(BEST_PLACEMENT_TARGET, workload, fleet, settings, tokenizer, prompts, winner)


def _complete(
    result: TargetResult, run: ReplayResult, fleet: AnyFleet, settings: RunSettings, prompts: Sequence[Prompt] | None
) -> None:
    """The run's setting, and with the workload's ``prompts`` the offline caches over the
    order this run sent the requests (:func:`attach_bounds`)."""
    result.time_scale = settings.time_scale
    result.setting = settings.setting
    if prompts is not None:
        ordered = [prompts[index] for index in sent_order(run)]
        attach_bounds(result, ordered, fleet_capacity_blocks(fleet))


def fleet_capacity_blocks(fleet: AnyFleet) -> int | None:
    """The fleet's total KV capacity in blocks; None when the engines' size is unknown."""
    if fleet.capacity_tokens is None:
        return None
    return len(fleet.urls) * fleet.data_parallel_size * (fleet.capacity_tokens // fleet.block_size)


def attach_bounds(result: TargetResult, prompts: Sequence[Prompt], capacity: int | None) -> None:
    """Set ``result``'s pooled bounds over ``prompts`` (in the order they were sent)."""
    found = bounds(prompts, capacity)
    result.bound_fleet, result.pooled_lru = found.bound_fleet, found.pooled_lru
    result.fleet_capacity_blocks = capacity
    if result.hit_rate_observed is not None and found.bound_fleet:
        result.of_bound_fleet = result.hit_rate_observed / found.bound_fleet


def offline_rows(
    workload: Workload, prompts: Sequence[Prompt], capacity: int | None, setting: str = ""
) -> list[TargetResult]:
    """The ``bound``, ``bound_fleet`` and ``pooled_lru`` rows over the arrival order."""
    found = bounds(prompts, capacity)
    rates = {BOUND_TARGET: found.bound, BOUND_FLEET_TARGET: found.bound_fleet, POOLED_LRU_TARGET: found.pooled_lru}
    rows = []
    for target, rate in rates.items():
        if rate is None:
            continue
        row = TargetResult(
            target,
            workload.name,
            len(prompts),
            0,
            rate,
            None,
            None,
            None,
            None,
            prompt_tokens=found.prompt_tokens,
            sessions=workload.sessions,
            setting=setting,
        )
        attach_bounds(row, prompts, capacity)
        rows.append(row)
    return rows


def _targets(policies: Sequence[str], peers: Sequence[str]) -> list[str]:
    return [*policies, *(PEER_PREFIX + peer for peer in peers)]


def _not_run(target: str, workload: Workload, status: str, setting: str = "") -> TargetResult:
    return TargetResult(
        target,
        workload.name,
        0,
        0,
        None,
        None,
        None,
        None,
        None,
        sessions=workload.sessions,
        status=status,
        setting=setting,
    )


async def run_bench(
    workloads: Sequence[Workload],
    fleet: AnyFleet,
    targets: Sequence[str],
    settings: RunSettings,
    *,
    tokenizer: str | None = None,
    bound: bool = True,
    repeats: int = 1,
) -> list[TargetResult]:
    """Every target on every workload, ``repeats`` rounds of every target in turn (so drift
    of a shared machine spreads over all targets alike); the fleet is stopped at the end,
    also on errors."""
    virtual = isinstance(fleet, VirtualFleet)  # peers never run there, installed or not
    missing = {
        target
        for target in targets
        if target.startswith(PEER_PREFIX)
        and not virtual
        and not fleets.peer_installed(target.removeprefix(PEER_PREFIX))
    }
    for target in sorted(missing):
        peer = target.removeprefix(PEER_PREFIX)
        print(f"kvroute bench: {peer} is not installed (pip install {peer}); skipped", file=sys.stderr)
    results: list[TargetResult] = []
    capacity = fleet_capacity_blocks(fleet)
    try:
        for workload in workloads:
            prompts = None
            if bound:
                prompts = await asyncio.to_thread(workload_prompts, workload, fleet.block_size, tokenizer)
                results += await asyncio.to_thread(offline_rows, workload, prompts, capacity, settings.setting)
            for repeat, target in itertools.product(range(repeats), targets):
                if target in missing:
                    if repeat == 0:
                        results.append(_not_run(target, workload, "not installed", settings.setting))
                    continue
                if target == BEST_PLACEMENT_TARGET:
                    if repeat == 0:  # a fixed placement in virtual time is deterministic
                        results.append(await _best_placement(workload, fleet, settings, tokenizer, prompts))
                    continue
                if isinstance(fleet, VirtualFleet):
                    if target.startswith(PEER_PREFIX):
                        if repeat == 0:
                            results.append(_not_run(target, workload, "not in virtual time", settings.setting))
                        continue
                    result = await asyncio.to_thread(
                        run_virtual_target, target, workload, fleet, settings, tokenizer, prompts
                    )
                    result.repeat = repeat
                    results.append(result)
                    continue
                try:
                    result = await run_target(target, workload, fleet, settings, tokenizer, prompts=prompts)
                    result.repeat = repeat
                    results.append(result)
                except FleetError as exc:
                    print(f"kvroute bench: {target} on {workload.name} failed: {exc}", file=sys.stderr)
                    results.append(_not_run(target, workload, "failed to start", settings.setting))
    finally:
        fleet.stop()
    return results


async def _best_placement(
    workload: Workload, fleet: AnyFleet, settings: RunSettings, tokenizer: str | None, prompts: Sequence[Prompt] | None
) -> TargetResult:
    """The ``best_placement`` row, or why it was not run (wall clock, or no session ids)."""
    if not isinstance(fleet, VirtualFleet):
        return _not_run(BEST_PLACEMENT_TARGET, workload, "virtual time only", settings.setting)
    if any(request.session_id is None for request in workload.requests):
        return _not_run(BEST_PLACEMENT_TARGET, workload, "no session ids", settings.setting)
    return await asyncio.to_thread(run_best_placement, workload, fleet, settings, tokenizer, prompts)


async def _served_model(url: str) -> str:
    """The first model an external engine serves (its ``/v1/models``)."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as client, client.get(url + "/v1/models") as response:
        response.raise_for_status()
        data = await response.json()
    return str(data["data"][0]["id"])


def _token_range(tokenizer_path: str | None) -> tuple[int, int]:
    """Token ids a Mooncake prompt may use: past the byte alphabet, below the special tokens
    (which the default and most Hugging Face tokenizers append at the end)."""
    from kvroute.tokenizer_index import RequestTokenizer

    tokenizer = RequestTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else RequestTokenizer.default()
    first = mooncake.DEFAULT_FIRST_TOKEN_ID
    added = [i for i in tokenizer.backend.get_added_tokens_decoder() if i > first]
    return first, min(added) if added else tokenizer.vocab_size


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute bench",
        description="Replay workloads and traces against a fleet under each routing policy, "
        "next to peer routers and the unbounded-cache bound. 'kvroute bench --overhead' "
        "measures the router's own cost instead.",
    )
    what = parser.add_argument_group("workloads")
    what.add_argument(
        "--workload",
        action="append",
        metavar="NAME",
        help=f"one of {', '.join(WORKLOAD_KINDS)} (repeatable; default system-prompt and agent-sessions)",
    )
    what.add_argument("--limit", type=int, help="at most N requests per workload")
    what.add_argument(
        "--max-output-tokens", type=int, help="cap every request's max_tokens (the trace's output lengths too)"
    )
    what.add_argument(
        "--speedup",
        type=float,
        help="divide arrival times by this (default: --time-scale for sim "
        "engines, so the load matches real time; 1 for external engines)",
    )
    what.add_argument("--seed", type=int, default=0)
    what.add_argument(
        "--seeds",
        type=parse_seeds,
        metavar="LIST",
        help="run every workload at each of these seeds (e.g. 0-9 or 0,3,5) instead of --seed, "
        "and print medians over them and each seed's hit rates: in virtual time, where a "
        "seed's run is deterministic, the spread to report",
    )
    what.add_argument("--users", type=int, default=8, help="system-prompt: users")
    what.add_argument("--turns", type=int, default=4, help="system-prompt, multi-turn: turns")
    what.add_argument("--system-tokens", type=int, default=4000, help="system-prompt: system prompt length")
    what.add_argument("--conversations", type=int, default=16, help="multi-turn: conversations")
    what.add_argument("--sessions", default="4,8,16,32", help="agent-sessions: session counts to sweep")
    what.add_argument("--agent-turns", type=int, default=8, help="agent-sessions: turns")
    what.add_argument(
        "--agent-scale",
        type=float,
        default=0.25,
        help="agent-sessions: fraction of a production turn (88K in, 400 out)",
    )
    what.add_argument(
        "--think-time",
        type=float,
        metavar="MEAN",
        help="agent-sessions, multi-turn: exponential think time of this mean "
        "(seconds, seeded) between an answer and the session's next turn; "
        "scaled by --speedup like arrival times (default: none, lockstep)",
    )
    what.add_argument(
        "--arrival-rate",
        type=float,
        metavar="R",
        help="agent-sessions, multi-turn: sessions start by a Poisson process "
        "of R per second (seeded) instead of together",
    )
    where = parser.add_argument_group("fleet")
    where.add_argument(
        "--engine",
        default="sim",
        help="'sim' to start simulated replicas, 'virtual' to replay against the sims' scheduler "
        "in virtual time (deterministic, seconds per run, routing only), or URL,URL,... of running engines",
    )
    where.add_argument("--replicas", type=int, default=4)
    where.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help="KV cache of each engine in tokens (sims: default "
        f"{DEFAULT_SIM_CAPACITY_TOKENS}; external engines: their real size, "
        "for bound_fleet and the routers' capacity model; unknown if not given)",
    )
    where.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="external engines: data-parallel ranks behind each URL (vllm serve --data-parallel-size); "
        "kvroute routes to the ranks, and each policy also runs as POLICY@whole-engine, routing to "
        "engines as wholes; --kv-capacity-tokens is then each rank's",
    )
    where.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    where.add_argument("--decode-tokens-per-s", type=float, default=50.0)
    where.add_argument(
        "--time-scale", type=float, default=1.0, help="sim engines run this many times faster than real time"
    )
    where.add_argument(
        "--sweep-time-scale",
        metavar="LIST",
        help="sims only: run everything at each of these time scales "
        "(e.g. 1,10), to see whether the comparison depends on them",
    )
    where.add_argument(
        "--sweep-prefill", metavar="LIST", help="sims only: ... and at each of these prefill rates (tokens/s)"
    )
    where.add_argument(
        "--api",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the engines' API: sims speak it, caches are emptied its way "
        "(vLLM /reset_prefix_cache, SGLang /flush_cache)",
    )
    where.add_argument(
        "--block-size",
        type=int,
        help="engine block size, SGLang's page size (sims use it; give the real "
        "one for engines; default 16, --api sglang 1)",
    )
    where.add_argument(
        "--model", help="model name to request (default: sim, or the first model the external engines serve)"
    )
    where.add_argument("--tokenizer", help="tokenizer directory for sims, routers and bound")
    where.add_argument(
        "--wire",
        choices=WIRES,
        default="chat",
        help="external engines: send the chat workloads over this API: OpenAI's chat completions, its "
        "Responses API (/v1/responses), Anthropic's Messages API (/v1/messages, Claude Code's), or "
        "vLLM's scale-out token-in generation (tokens: each chat rendered by the engine, "
        "/v1/chat/completions/render, then /inference/v1/generate; needs --enable-scale-out), "
        "carrying the same conversations",
    )
    who = parser.add_argument_group("targets")
    who.add_argument(
        "--policies",
        default="round_robin,sticky,cache_aware",
        help=f"kvroute policies, comma separated ({', '.join(POLICY_NAMES)})",
    )
    who.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=[*PEERS, "all"],
        help="also run a peer router (repeatable; needs its package)",
    )
    who.add_argument("--no-bound", action="store_true", help="skip the unbounded-cache bound")
    who.add_argument(
        "--placement-search",
        action="store_true",
        help="--engine virtual: also replay fixed placements of sessions on replicas and "
        "report the best as the best_placement row (benchmarks/placement_search.py)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, help="directory for results.json and summary.png")
    out.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every target N times per workload, in rounds (every target "
        "once, then again), and print medians and spread",
    )
    out.add_argument("--max-in-flight", type=int, default=256, help="client concurrency limit")
    return parser


def parse_seeds(text: str) -> list[int]:
    """``0-9`` or ``0,3,5`` (or both: ``0-2,7``) as a list of seeds."""
    seeds: list[int] = []
    try:
        for part in _csv(text):
            first, _, last = part.partition("-")
            seeds += range(int(first), int(last or first) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are numbers or ranges like 0-9, not {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return list(dict.fromkeys(seeds))


def default_block_size(api: str) -> int:
    """The engines' block size when ``--block-size`` is not given: vLLM's 16, SGLang's page of 1."""
    return 1 if api == "sglang" else 16


def _sim_spec(args: argparse.Namespace, time_scale: float, prefill: float) -> SimSpec:
    """The sims the bench's flags describe."""
    return SimSpec(
        replicas=args.replicas,
        model=args.model or "sim",
        block_size=args.block_size,
        kv_capacity_tokens=args.kv_capacity_tokens or DEFAULT_SIM_CAPACITY_TOKENS,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=args.decode_tokens_per_s,
        time_scale=time_scale,
        tokenizer=args.tokenizer,
        api=args.api,
    )


def _sim_fleet(args: argparse.Namespace, time_scale: float, prefill: float) -> SimFleet | VirtualFleet:
    fleet = VirtualFleet if args.engine == "virtual" else SimFleet
    return fleet(_sim_spec(args, time_scale, prefill))


def _sweep_points(args: argparse.Namespace) -> list[tuple[float, float]]:
    """(time scale, prefill tokens/s) of every settings-sweep point; one when not sweeping."""
    scales = [float(v) for v in _csv(args.sweep_time_scale or "")] or [args.time_scale]
    prefills = [float(v) for v in _csv(args.sweep_prefill or "")] or [args.prefill_tokens_per_s]
    return [(scale, prefill) for scale in scales for prefill in prefills]


async def _main(args: argparse.Namespace) -> int:
    policies = _csv(args.policies)
    unknown = [policy for policy in policies if policy not in POLICY_NAMES]
    if unknown:
        print(f"kvroute bench: unknown policies {unknown}; known: {', '.join(POLICY_NAMES)}", file=sys.stderr)
        return 2
    peers = list(PEERS) if "all" in args.peer else list(dict.fromkeys(args.peer))
    virtual = args.engine == "virtual"
    sim = args.engine == "sim" or virtual
    if args.block_size is None:
        args.block_size = default_block_size(args.api)
    points = _sweep_points(args)
    swept = len(points) > 1 or bool(args.sweep_time_scale or args.sweep_prefill)
    if not sim and swept:
        print("kvroute bench: --sweep-* needs --engine sim", file=sys.stderr)
        return 2
    if sim and args.wire != "chat":
        print("kvroute bench: --wire needs --engine URL,... (sims speak the chat API)", file=sys.stderr)
        return 2
    if sim and args.data_parallel_size > 1:
        print("kvroute bench: --data-parallel-size needs --engine URL,... (sims have no ranks)", file=sys.stderr)
        return 2
    if sim:
        model = args.model or "sim"
    else:
        external = ExternalFleet(
            _csv(args.engine),
            block_size=args.block_size,
            capacity_tokens=args.kv_capacity_tokens,
            api=args.api,
            data_parallel_size=args.data_parallel_size,
        )
        model = args.model or await _served_model(external.urls[0])
    first_token, end_token = _token_range(args.tokenizer)
    options = WorkloadOptions(
        vocab_size=end_token,
        first_token_id=first_token,
        model=model,
        seed=args.seed,
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        conversations=args.conversations,
        sessions=tuple(int(count) for count in _csv(args.sessions)),
        agent_turns=args.agent_turns,
        agent_scale=args.agent_scale,
        limit=args.limit,
        max_output_tokens=args.max_output_tokens,
        think_time=args.think_time,
        arrival_rate=args.arrival_rate,
    )
    seeds: list[int] = args.seeds or [args.seed]
    specs = args.workload or ["system-prompt", "agent-sessions"]
    try:
        seeded = {
            seed: [w for spec in specs for w in make_workloads(spec, replace(options, seed=seed))] for seed in seeds
        }
    except (ValueError, OSError) as exc:
        print(f"kvroute bench: {exc}", file=sys.stderr)
        return 2
    targets = _targets(fleets.rank_targets(policies, args.data_parallel_size), peers) + (
        [BEST_PLACEMENT_TARGET] if args.placement_search else []
    )
    started = time.monotonic()
    results: list[TargetResult] = []
    for (time_scale, prefill), seed in itertools.product(points, seeds):
        workloads = seeded[seed]
        fleet = _sim_fleet(args, time_scale, prefill) if sim else external
        speedup = args.speedup or (time_scale if sim else 1.0)
        setting = f"time-scale={time_scale:g} prefill={prefill:g}" if swept else ""
        print(
            f"kvroute bench: {len(workloads)} workload(s) x {len(targets)} target(s) x "
            f"{args.repeat} run(s) on {len(fleet.urls)} engine(s); arrivals sped up "
            f"{speedup:g}x" + (f"; {setting}" if setting else "") + (f"; seed {seed}" if args.seeds else ""),
            file=sys.stderr,
        )
        settings = RunSettings(
            speedup=speedup,
            max_in_flight=args.max_in_flight,
            time_scale=time_scale if sim else 1.0,
            setting=setting,
            wire=args.wire,
        )
        ran = await run_bench(
            workloads, fleet, targets, settings, tokenizer=args.tokenizer, bound=not args.no_bound, repeats=args.repeat
        )
        if args.seeds:
            for result in ran:
                result.seed = seed
        results += ran
    print(format_table(results))
    if args.repeat > 1 or len(seeds) > 1:
        print()
        print(format_repeats(results))
    if len(seeds) > 1:
        print()
        print(format_by_seed(results))
    scales = {point[0] for point in points} if sim and not virtual else {1.0}
    clock = "modelled engine seconds (virtual time)" if virtual else "wall seconds"
    print(
        f"\n({time.monotonic() - started:.0f} s; TTFT and latency in {clock}"
        + (
            " of sims running " + "/".join(f"{scale:g}" for scale in sorted(scales)) + "x real time)"
            if scales != {1.0}
            else ")"
        )
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(results, args.out / "results.json")
        plot_summary(results, args.out / "summary.png")
        print(f"wrote {args.out / 'results.json'} and {args.out / 'summary.png'}")
    return 0


def main(argv: list[str]) -> int:
    """``kvroute bench``; ``kvroute bench --overhead`` runs :mod:`kvroute.benchmarks.overhead`."""
    if "--overhead" in argv:
        from kvroute.benchmarks import overhead

        return overhead.main([arg for arg in argv if arg != "--overhead"])
    return fleets.run_stoppable(_main(build_parser().parse_args(argv)))
