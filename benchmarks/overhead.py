"""``kvroute bench --overhead``: what a router costs, direct vs each policy vs each peer.

A fixed ~2 KB chat request is sent by a closed loop of C clients (C = 32 and 128) for a few
seconds to: the upstream directly, a ``kvroute serve`` per policy, and each installed peer
router (SGLang's, vLLM's; ``cache_aware``), all in front of the same fast upstream (a
trivial aiohttp responder in its own process, so the engine costs nothing). Per target and
concurrency: requests/s, latency p50/p99, the latency added over direct at the same
concurrency, and the router's CPU time per request (user + system time of its process
group from ``/proc``, divided by the requests it served).

Targets are measured in rounds, each round visiting every target in turn, so "direct" and
every router see the same machine conditions (on a shared 2-core machine they drift); the
reported figure is the median over rounds. The client is Python, so on a small machine the
absolute requests/s says as much about the client as about the router: compare the added
latency and the CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson

from benchmarks import fleet as fleets
from benchmarks.fleet import PEERS, ManagedProcess, free_port
from benchmarks.replay import Progress
from benchmarks.results import percentile
from benchmarks.workloads import words
from router.config import POLICY_NAMES

DIRECT = "direct"
MODEL = "overhead"


def chat_body(size_bytes: int = 2048) -> bytes:
    """A fixed chat request of about ``size_bytes`` bytes."""
    import numpy as np

    text = words(np.random.default_rng(42), size_bytes // 5)
    body = {
        "model": MODEL, "max_tokens": 8,
        "messages": [{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": text}],
    }
    encoded = orjson.dumps(body)
    while len(encoded) > size_bytes:
        text = text[: len(text) - (len(encoded) - size_bytes)]
        body["messages"][1]["content"] = text
        encoded = orjson.dumps(body)
    return encoded


# --- the fast upstream ---------------------------------------------------------------------

_COMPLETION = orjson.dumps({
    "id": "chatcmpl-overhead", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    # No prompt_tokens_details: this upstream does not tokenize, so any cached_tokens it
    # made up would contradict the router's (correct) prediction for the repeated body and
    # put drift trimming, which a real engine rarely triggers, on every request.
    "usage": {"prompt_tokens": 400, "completion_tokens": 1, "total_tokens": 401},
})
_MODELS = orjson.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "owned_by": "kvroute-overhead", "max_model_len": 32768}
]})
_SERVER_INFO = orjson.dumps({"model_path": MODEL, "served_model_name": MODEL,
                             "max_total_num_tokens": 32768, "is_generation": True})


def serve_upstream(port: int) -> None:
    """Run the trivial upstream: fixed answers, no work (``--serve-upstream PORT``)."""
    from aiohttp import web

    def fixed(payload: bytes):
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=payload, content_type="application/json")

        return handler

    app = web.Application()
    app.router.add_post("/v1/chat/completions", fixed(_COMPLETION))
    app.router.add_get("/v1/models", fixed(_MODELS))
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, fixed(_SERVER_INFO))
    app.router.add_get("/health", fixed(b"{}"))
    app.router.add_get("/metrics", lambda request: web.Response(text=""))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_upstream() -> ManagedProcess:
    port = free_port()
    argv = [sys.executable, "-m", "router.cli", "bench", "--overhead", "--serve-upstream",
            str(port)]
    return ManagedProcess("overhead-upstream", argv, f"http://127.0.0.1:{port}")


# --- measuring -----------------------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # After "pid (comm)": state ppid pgrp ...; utime and stime are fields 14 and 15.
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


@dataclass(slots=True)
class LoadRun:
    """One closed-loop run against one URL."""

    requests: int
    errors: int
    seconds: float
    latencies_s: list[float]
    cpu_s: float | None  # the router's CPU time over the run; None for direct


async def closed_loop(url: str, body: bytes, concurrency: int, seconds: float,
                      pgid: int | None) -> LoadRun:
    """``concurrency`` clients sending ``body`` back to back for ``seconds``."""
    latencies: list[float] = []
    errors = 0
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30)) as client:

        async def one() -> bool:
            async with client.post(url + "/v1/chat/completions", data=body,
                                   headers=headers) as response:
                await response.read()
                return response.status == 200

        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm the connections
        cpu_before = group_cpu_seconds(pgid) if pgid else None
        started = time.perf_counter()
        deadline = started + seconds

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                try:
                    ok = await one()
                except (TimeoutError, aiohttp.ClientError):
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        cpu = group_cpu_seconds(pgid) - cpu_before if pgid and cpu_before is not None else None
    return LoadRun(len(latencies) + errors, errors, elapsed, latencies, cpu)


@dataclass(slots=True)
class OverheadRow:
    """Median over rounds for one target at one concurrency."""

    target: str
    concurrency: int
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    router_cpu_us_per_request: float | None
    errors: int


def _median(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def summarize(runs: dict[tuple[str, int], list[LoadRun]]) -> list[OverheadRow]:
    rows: list[OverheadRow] = []
    for (target, concurrency), measured in runs.items():
        p50 = _median([percentile(run.latencies_s, 50) for run in measured]) or 0.0
        p99 = _median([percentile(run.latencies_s, 99) for run in measured]) or 0.0
        direct = runs.get((DIRECT, concurrency), [])
        direct_p50 = _median([percentile(run.latencies_s, 50) for run in direct])
        direct_p99 = _median([percentile(run.latencies_s, 99) for run in direct])
        cpu = _median([
            run.cpu_s / run.requests * 1e6 if run.cpu_s is not None and run.requests else None
            for run in measured
        ])
        rows.append(OverheadRow(
            target=target, concurrency=concurrency,
            requests_per_s=_median([run.requests / run.seconds for run in measured]) or 0.0,
            latency_p50_ms=p50 * 1000, latency_p99_ms=p99 * 1000,
            added_p50_ms=None if target == DIRECT or direct_p50 is None
            else (p50 - direct_p50) * 1000,
            added_p99_ms=None if target == DIRECT or direct_p99 is None
            else (p99 - direct_p99) * 1000,
            router_cpu_us_per_request=cpu, errors=sum(run.errors for run in measured),
        ))
    return rows


def format_rows(rows: Sequence[OverheadRow]) -> str:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    header = ("target", "conc", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms",
              "router CPU us/req", "errors")
    table = [header] + [
        (row.target, str(row.concurrency), f"{row.requests_per_s:.0f}",
         f"{row.latency_p50_ms:.2f}", f"{row.latency_p99_ms:.2f}",
         cell(row.added_p50_ms, ".2f"), cell(row.added_p99_ms, ".2f"),
         cell(row.router_cpu_us_per_request, ".0f"), str(row.errors))
        for row in sorted(rows, key=lambda row: (row.concurrency, row.target != DIRECT))
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table
    )


async def run_overhead(policies: Sequence[str], peers: Sequence[str],
                       concurrencies: Sequence[int], seconds: float, rounds: int,
                       body_bytes: int) -> list[OverheadRow]:
    """Start the upstream and every router, then measure them round by round."""
    body = chat_body(body_bytes)
    upstream = start_upstream()
    fronts: dict[str, ManagedProcess | fleets.PeerRouter] = {}
    try:
        await upstream.wait_ready()
        for policy in policies:
            fronts[policy] = await fleets.start_router(policy, [upstream.url])
        for peer in peers:
            fronts[f"peer:{peer}"] = await fleets.start_peer(peer, [upstream.url])
        targets: list[tuple[str, str, int | None]] = [(DIRECT, upstream.url, None)]
        for name, front in fronts.items():
            process = front.process if isinstance(front, fleets.PeerRouter) else front
            targets.append((name, front.url, process.pid))
        runs: dict[tuple[str, int], list[LoadRun]] = {}
        progress = Progress(rounds * len(concurrencies) * len(targets), "overhead runs")
        for _ in range(rounds):
            for concurrency in concurrencies:
                for name, url, pgid in targets:
                    run = await closed_loop(url, body, concurrency, seconds, pgid)
                    runs.setdefault((name, concurrency), []).append(run)
                    progress.advance(run.errors == 0)
        progress.close()
        return summarize(runs)
    finally:
        for front in fronts.values():
            front.stop()
        upstream.stop()


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute bench --overhead",
        description="Router overhead: direct vs each kvroute policy vs each installed peer "
        "router, fixed ~2 KB chat requests against a trivial upstream.",
    )
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument("--peers", default="installed",
                        help="'installed' (default), 'none', or a comma list of "
                        f"{', '.join(PEERS)}")
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--seconds", type=float, default=3.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--body-bytes", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("bench-out/overhead.json"))
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    """``kvroute bench --overhead`` (the flag itself is removed by :func:`benchmarks.bench.main`)."""
    args = build_parser().parse_args(argv)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return 0
    policies = _csv(args.policies)
    unknown = [policy for policy in policies if policy not in POLICY_NAMES]
    if unknown:
        print(f"kvroute bench --overhead: unknown policies {unknown}", file=sys.stderr)
        return 2
    if args.peers == "installed":
        peers = [peer for peer in PEERS if fleets.peer_installed(peer)]
    elif args.peers == "none":
        peers = []
    else:
        peers = _csv(args.peers)
    for peer in PEERS:
        if not fleets.peer_installed(peer):
            print(f"kvroute bench --overhead: {peer} not installed (pip install {peer})",
                  file=sys.stderr)
    peers = [peer for peer in peers if fleets.peer_installed(peer)]
    concurrencies = [int(value) for value in _csv(args.concurrency)]

    async def run() -> int:
        rows = await run_overhead(policies, peers, concurrencies, args.seconds, args.rounds,
                                  args.body_bytes)
        print(format_rows(rows))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0

    return fleets.run_stoppable(run())
