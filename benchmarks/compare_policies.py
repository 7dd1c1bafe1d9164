"""Engine-observed prefix-cache hit rate of round_robin, sticky and cache_aware, in one run.

Four simulated replicas with finite caches, each policy behind a fresh ``kvroute serve``,
the engines restarted (empty caches) between policies, the same requests for all:

(a) ``system-prompt``: 8 users share one long system prompt and take several turns each;
(b) ``agent-sessions:S``: S agent sessions in lockstep whose histories grow to tens of
    thousands of tokens, swept over S past what the fleet's caches hold.

The references are the hit rate of one unbounded cache over the same request sequence
(``bound``) and of one cache of the fleet's total capacity evicted optimally
(``bound_fleet``, see :mod:`kvroute.benchmarks.bounds`). Hit rates are the engines' own counters (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` summed over the replicas). The summary says, per
workload, whether the fleet's total cache holds the working set (the tokens of every
session's last prompt) and how close each policy gets to the bound; cache_aware should
reach 90 % of it where the working set fits.

    python -m kvroute.benchmarks.compare_policies --out compare-out

prints the full ``kvroute bench`` table and the summary, and writes ``compare.json``
(summary rows plus every result). The measure here is the hit rate: the sims run 20x
faster than real time, so on a small machine TTFT is largely the router's and the sims'
own CPU time (tokenizing 20K-token prompts), which load-only policies do not spend. ``--quick`` runs a smaller sweep. Knobs of the policy
can be varied through the environment of the routers it starts, e.g.
``KVROUTE_LOAD_WEIGHT=0.5 python -m kvroute.benchmarks.compare_policies``.

This is the small, self-contained comparison of the cache-aware issue; the general tool
with more workloads, traces and peer routers is ``kvroute bench``
(:mod:`kvroute.benchmarks.bench`), whose fleet, replay and result code this reuses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute.benchmarks.bench import RunSettings, run_bench
from kvroute.benchmarks.fleet import SimFleet, SimSpec, run_stoppable
from kvroute.benchmarks.results import (
    BOUND_FLEET_TARGET,
    BOUND_TARGET,
    TargetResult,
    format_table,
)
from kvroute.benchmarks.workloads import Workload, WorkloadOptions, make_workloads

POLICIES = ("round_robin", "sticky", "cache_aware")
#: cache_aware's target on workloads whose working set fits the fleet's caches.
TARGET_OF_BOUND = 0.90


@dataclass(frozen=True, slots=True)
class SummaryRow:
    """One workload: its size against the fleet's cache, and each policy's hit rate."""

    workload: str
    working_set_tokens: int
    fleet_cache_tokens: int
    fits: bool
    bound: float | None
    hit_rate: dict[str, float | None]
    of_bound: dict[str, float | None]
    bound_fleet: float | None = None  # the pooled Belady bound over the arrival order
    of_bound_fleet: dict[str, float | None] | None = None  # each over its own sent order


def working_set_tokens(workload: Workload, tokenizer_path: str | None) -> int:
    """Tokens of every session's last prompt: what the fleet must hold to keep them all."""
    from kvroute.tokenizer_index import RequestTokenizer

    tokenizer = RequestTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else RequestTokenizer.default()
    last: dict[str, dict] = {}
    for request in workload.requests:
        last[request.session_id or str(id(request))] = request.body
    total = 0
    for body in last.values():
        if "messages" in body:
            total += len(tokenizer.encode_chat(body["messages"], tools=body.get("tools")))
        else:
            total += len(tokenizer.encode_prompt(body["prompt"]))
    return total


def summarize(
    results: list[TargetResult],
    workloads: list[Workload],
    sizes: dict[str, int],
    fleet_tokens: int,
    policies: tuple[str, ...],
) -> list[SummaryRow]:
    rows = []
    for workload in workloads:
        mine = {r.target: r for r in results if r.workload == workload.name}
        bound = mine[BOUND_TARGET].hit_rate_observed if BOUND_TARGET in mine else None
        hit_rate = {p: mine[p].hit_rate_observed if p in mine else None for p in policies}
        of_bound = {p: (rate / bound if rate is not None and bound else None) for p, rate in hit_rate.items()}
        size = sizes[workload.name]
        fleet_bound = mine[BOUND_FLEET_TARGET].hit_rate_observed if BOUND_FLEET_TARGET in mine else None
        of_fleet = {p: mine[p].of_bound_fleet if p in mine else None for p in policies}
        rows.append(
            SummaryRow(
                workload.name,
                size,
                fleet_tokens,
                size <= fleet_tokens,
                bound,
                hit_rate,
                of_bound,
                fleet_bound,
                of_fleet,
            )
        )
    return rows


def format_summary(rows: list[SummaryRow], policies: tuple[str, ...]) -> str:
    header = [
        "workload",
        "working set",
        "fits fleet",
        "bound",
        "bound_fleet",
        *policies,
        "cache_aware/bound",
        "cache_aware/bound_fleet",
    ]
    lines = []
    for row in rows:
        cells = [
            row.workload,
            f"{row.working_set_tokens:,}",
            "yes" if row.fits else "no",
            "-" if row.bound is None else f"{row.bound:.3f}",
            "-" if row.bound_fleet is None else f"{row.bound_fleet:.3f}",
            *("-" if row.hit_rate[p] is None else f"{row.hit_rate[p]:.3f}" for p in policies),
        ]
        ratio = row.of_bound.get("cache_aware")
        verdict = ""
        if ratio is not None:
            verdict = f"{ratio:.0%}"
            if row.fits:
                verdict += " (target >= 90 %: " + ("met" if ratio >= TARGET_OF_BOUND else "MISSED") + ")"
        of_fleet = (row.of_bound_fleet or {}).get("cache_aware")
        lines.append([*cells, verdict, "-" if of_fleet is None else f"{of_fleet:.0%}"])
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.benchmarks.compare_policies",
        description="Engine-observed hit rate of round_robin, sticky and cache_aware on 4 sim "
        "engines with finite caches, next to one unbounded cache.",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=49152,
        help="cache size of each replica (default 48K: the fleet holds 192K)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=20.0, help="sim engines run this many times faster than real time"
    )
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6, help="system-prompt turns per user")
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--sessions", default="4,8,12,16,24", help="agent-sessions: session counts to sweep")
    parser.add_argument("--agent-turns", type=int, default=8)
    parser.add_argument(
        "--agent-scale", type=float, default=0.25, help="last agent prompt ~ scale x 88K tokens (0.25: ~22K)"
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="sessions 8,16 and 4 turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="directory for compare.json")
    return parser


async def _main(args: argparse.Namespace) -> int:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    sessions = "8,16" if args.quick else args.sessions
    turns = 4 if args.quick else args.turns
    options = WorkloadOptions(
        seed=args.seed,
        users=args.users,
        turns=turns,
        system_tokens=args.system_tokens,
        sessions=tuple(int(s) for s in sessions.split(",")),
        agent_turns=args.agent_turns,
        agent_scale=args.agent_scale,
    )
    workloads = make_workloads("system-prompt", options) + make_workloads("agent-sessions", options)
    spec = SimSpec(replicas=args.replicas, kv_capacity_tokens=args.kv_capacity_tokens, time_scale=args.time_scale)
    fleet = SimFleet(spec)
    fleet_tokens = args.replicas * args.kv_capacity_tokens
    sizes = {w.name: await asyncio.to_thread(working_set_tokens, w, None) for w in workloads}
    print(
        f"compare_policies: {len(workloads)} workloads x {len(policies)} policies on {args.replicas} "
        f"sim engines of {args.kv_capacity_tokens:,} tokens ({fleet_tokens:,} in all)",
        file=sys.stderr,
    )
    started = time.monotonic()
    settings = RunSettings(speedup=args.time_scale, max_in_flight=256, time_scale=args.time_scale)
    results = await run_bench(workloads, fleet, list(policies), settings)
    rows = summarize(results, workloads, sizes, fleet_tokens, policies)
    print(format_table(results))
    print()
    print(format_summary(rows, policies))
    print(f"\n({time.monotonic() - started:.0f} s; sims at {args.time_scale:g}x real time)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "compare.json"
        path.write_text(
            json.dumps({"summary": [asdict(row) for row in rows], "results": [r.to_json() for r in results]}, indent=2)
            + "\n"
        )
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_stoppable(_main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
