"""The proxy's own cost: throughput, added latency, router CPU per request, and stream TTFB.

    python -m kvroute.benchmarks.bench_proxy [--seconds 3] [--rounds 3] [--concurrency 32,128]
                                     [--policies round_robin] [--out bench-out/proxy.json]

Two parts, each measured direct and through ``kvroute serve`` (a subprocess per policy):

1. **Request overhead** (:mod:`kvroute.benchmarks.overhead`, shared with ``kvroute bench
   --overhead``): a closed loop of C clients sending a fixed ~2 KB chat request to a
   trivial upstream; requests/s, latency p50/p99, latency added over direct, and the
   router's CPU time per request from ``/proc/<pid>/stat``.
2. **Stream time to first byte**: streaming chat requests to a simulated engine
   (``kvroute sim-engine`` with a high time scale, so its compute is near zero) at
   concurrency 1 and C; the first SSE byte's latency direct vs through the router
   (which injects ``include_usage`` and relays chunk by chunk).

Targets alternate within each round so a noisy shared machine affects all alike; each
figure is the median over rounds. The load generator is Python too: on a small machine
compare the added latency and the CPU per request, not the absolute requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.fleet import ManagedProcess, SimSpec, free_port
from kvroute.benchmarks.overhead import DIRECT, MODEL, format_rows, run_overhead
from kvroute.benchmarks.results import percentile

STREAM_MAX_TOKENS = 16


@dataclass(slots=True)
class TTFBRow:
    """Median over rounds of one stream target at one concurrency."""

    target: str
    concurrency: int
    streams: int
    ttfb_p50_ms: float
    ttfb_p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    errors: int


def stream_body(index: int) -> bytes:
    """A small streaming chat request; distinct per client so no two share a prompt."""
    return orjson.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": STREAM_MAX_TOKENS,
            "messages": [{"role": "user", "content": f"client {index}: describe the weather in one line"}],
        }
    )


async def stream_ttfbs(url: str, concurrency: int, per_client: int) -> tuple[list[float], int]:
    """``concurrency`` clients, each sending ``per_client`` streams in a row; TTFB of each."""
    ttfbs: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as client:

        async def worker(index: int) -> None:
            nonlocal errors
            body = stream_body(index)
            for _ in range(per_client):
                sent = time.perf_counter()
                try:
                    async with client.post(
                        url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
                    ) as response:
                        first = await response.content.readany()
                        ttfb = time.perf_counter() - sent
                        rest = await response.read()
                    if response.status != 200 or not (first + rest).rstrip().endswith(b"[DONE]"):
                        errors += 1
                        continue
                    ttfbs.append(ttfb)
                except (TimeoutError, aiohttp.ClientError):
                    errors += 1

        await asyncio.gather(*(worker(index) for index in range(concurrency)))
    return ttfbs, errors


async def run_stream_ttfb(
    policies: Sequence[str], concurrencies: Sequence[int], streams: int, rounds: int
) -> list[TTFBRow]:
    """Time to first byte of streams, direct vs through a router per policy."""
    spec = SimSpec(replicas=1, model=MODEL, time_scale=1000.0, decode_tokens_per_s=200.0)
    port = free_port()
    sim = ManagedProcess("bench-proxy-sim", spec.argv(port), f"http://127.0.0.1:{port}")
    routers: dict[str, ManagedProcess] = {}
    try:
        await sim.wait_ready()
        for policy in policies:
            routers[policy] = await fleets.start_router(policy, [sim.url])
        targets = [(DIRECT, sim.url), *((policy, router.url) for policy, router in routers.items())]
        measured: dict[tuple[str, int], list[tuple[list[float], int]]] = {}
        for _ in range(rounds):
            for concurrency in concurrencies:
                per_client = max(1, streams // concurrency)
                for name, url in targets:
                    measured.setdefault((name, concurrency), []).append(
                        await stream_ttfbs(url, concurrency, per_client)
                    )
        return _ttfb_rows(measured)
    finally:
        for router in routers.values():
            router.stop()
        sim.stop()


def _ttfb_rows(measured: dict[tuple[str, int], list[tuple[list[float], int]]]) -> list[TTFBRow]:
    def median_of(runs: list[tuple[list[float], int]], q: float) -> float:
        values = [percentile(ttfbs, q) for ttfbs, _ in runs if ttfbs]
        return statistics.median(values) * 1000 if values else float("nan")

    rows = []
    for (target, concurrency), runs in measured.items():
        direct = measured.get((DIRECT, concurrency), [])
        p50, p99 = median_of(runs, 50), median_of(runs, 99)
        rows.append(
            TTFBRow(
                target=target,
                concurrency=concurrency,
                streams=sum(len(ttfbs) for ttfbs, _ in runs),
                ttfb_p50_ms=p50,
                ttfb_p99_ms=p99,
                added_p50_ms=None if target == DIRECT else p50 - median_of(direct, 50),
                added_p99_ms=None if target == DIRECT else p99 - median_of(direct, 99),
                errors=sum(errors for _, errors in runs),
            )
        )
    return rows


def format_ttfb(rows: Sequence[TTFBRow]) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = ("target", "conc", "streams", "TTFB p50 ms", "TTFB p99 ms", "+p50 ms", "+p99 ms", "errors")
    table = [header] + [
        (
            row.target,
            str(row.concurrency),
            str(row.streams),
            cell(row.ttfb_p50_ms),
            cell(row.ttfb_p99_ms),
            cell(row.added_p50_ms),
            cell(row.added_p99_ms),
            str(row.errors),
        )
        for row in sorted(rows, key=lambda row: (row.concurrency, row.target != DIRECT, row.target))
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in table)


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.benchmarks.bench_proxy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--policies", default="round_robin", help="comma list of kvroute policies")
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--seconds", type=float, default=3.0, help="per overhead run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--body-bytes", type=int, default=2048)
    parser.add_argument("--streams", type=int, default=256, help="streams per TTFB run")
    parser.add_argument("--skip-streams", action="store_true", help="only the request overhead part")
    parser.add_argument("--out", type=Path, default=Path("bench-out/proxy.json"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]

    async def run() -> int:
        overhead = await run_overhead(policies, [], concurrencies, args.seconds, args.rounds, args.body_bytes)
        print(f"Request overhead (~{args.body_bytes} B chat body, trivial upstream):")
        print(format_rows(overhead))
        ttfb: list[TTFBRow] = []
        if not args.skip_streams:
            ttfb = await run_stream_ttfb(policies, [1, concurrencies[0]], args.streams, args.rounds)
            print(f"\nStream time to first byte ({STREAM_MAX_TOKENS}-token streams, simulated engine):")
            print(format_ttfb(ttfb))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "machine": machine(),
            "overhead": [asdict(row) for row in overhead],
            "stream_ttfb": [asdict(row) for row in ttfb],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
        return 0

    return fleets.run_stoppable(run())


if __name__ == "__main__":
    sys.exit(main())
