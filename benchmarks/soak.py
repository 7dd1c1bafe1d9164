"""Soak: N minutes of steady load with streams and hang-ups; the router's resources must stay flat.

``python -m kvroute.benchmarks.soak --minutes 10`` starts sim engines and ``kvroute serve``
(subprocesses, the cache_aware policy), runs :class:`~kvroute.benchmarks.steady_load.SteadyLoad`
against it (streaming and non-streaming chats drawn from ``--distinct-prompts`` user turns
behind shared system prompts, a share of clients hanging up mid-stream), and every
``--interval-s`` reads from the router's ``/metrics``:

* resident memory (``kvroute_process_resident_memory_bytes``) and open file descriptors
  (``kvroute_process_open_fds``),
* tasks on its event loop (``kvroute_asyncio_tasks``),
* the prefix index (``kvroute_index_bytes``, ``kvroute_index_blocks``),
* requests in flight.

It writes ``soak.json`` (every sample, the request account, the verdict) and
``soak.png`` (one panel per resource), and prints a table. Verdict: after the warm-up
(the first ``--warmup-fraction`` of the run), memory grows by at most ``--max-rss-growth``,
file descriptors and tasks stay within the warm-up's range plus the load's concurrency,
the index stays within its bound, and no request was lost.

Why a bounded set of prompts: the router keeps two caches that are bounded by size and
age rather than by count -- the tokenizer's piece cache (64 MiB) and the cache-aware
policy's conversation ledger (idle conversations leave after 10 minutes) -- and with a
brand-new prompt every request they take longer than 10 minutes to fill, so memory would
rise for the whole run without any leak. ``--distinct-prompts 0`` runs that worst case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from kvroute.benchmarks.fleet import SimFleet, SimSpec, run_stoppable, scrape, start_router
from kvroute.benchmarks.steady_load import LoadMix, SteadyLoad, Tally


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of the router's resources."""

    t_s: float
    rss_bytes: float
    open_fds: float
    asyncio_tasks: float
    index_bytes: float
    index_blocks: float
    in_flight: float
    requests_sent: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the resources stayed flat after the warm-up, with the numbers that say so."""

    rss_growth: float  # relative: last sample vs the end of the warm-up
    fds_over_warmup: float  # the peak after warm-up minus the warm-up's peak
    tasks_over_warmup: float
    index_growth: float  # relative, last third vs middle third of the run
    lost: int
    flat: bool


async def _sample(client: aiohttp.ClientSession, router_url: str, started: float, load: SteadyLoad) -> Sample:
    samples = await scrape(client, router_url + "/metrics")
    return Sample(
        t_s=round(time.monotonic() - started, 1),
        rss_bytes=samples.get("kvroute_process_resident_memory_bytes", 0.0),
        open_fds=samples.get("kvroute_process_open_fds", 0.0),
        asyncio_tasks=samples.get("kvroute_asyncio_tasks", 0.0),
        index_bytes=samples.get("kvroute_index_bytes", 0.0),
        index_blocks=samples.get("kvroute_index_blocks", 0.0),
        in_flight=samples.get("kvroute_backend_in_flight_requests", 0.0),
        requests_sent=len(load.records),
    )


def judge(
    samples: list[Sample], tally: Tally, *, warmup_fraction: float, max_rss_growth: float, concurrency: int
) -> Verdict:
    """Flat after warm-up: see the module docstring."""
    split = max(1, int(len(samples) * warmup_fraction))
    warm, steady = samples[:split], samples[split:] or samples[-1:]
    rss_growth = steady[-1].rss_bytes / max(warm[-1].rss_bytes, 1.0) - 1.0
    fds_over = max(s.open_fds for s in steady) - max(s.open_fds for s in warm)
    tasks_over = max(s.asyncio_tasks for s in steady) - max(s.asyncio_tasks for s in warm)
    third = max(1, len(samples) // 3)
    middle = samples[third : 2 * third] or samples
    last = samples[-third:]
    index_growth = _mean([s.index_bytes for s in last]) / max(_mean([s.index_bytes for s in middle]), 1.0) - 1.0
    # Requests in flight hold sockets and tasks: samples differ by up to the load's concurrency.
    flat = (
        rss_growth <= max_rss_growth
        and fds_over <= concurrency
        and tasks_over <= 2 * concurrency
        and index_growth <= max_rss_growth
        and tally.lost == 0
    )
    return Verdict(round(rss_growth, 4), fds_over, tasks_over, round(index_growth, 4), tally.lost, flat)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def plot(samples: list[Sample], path: Path, title: str) -> None:
    """Four panels: memory, file descriptors, asyncio tasks, prefix index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.t_s / 60 for s in samples]
    panels = [
        ("resident memory (MiB)", [s.rss_bytes / 2**20 for s in samples]),
        ("open file descriptors", [s.open_fds for s in samples]),
        ("asyncio tasks", [s.asyncio_tasks for s in samples]),
        ("prefix index (MiB)", [s.index_bytes / 2**20 for s in samples]),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 9), sharex=True)
    for axis, (label, values) in zip(axes, panels, strict=True):
        axis.plot(minutes, values, marker=".", linewidth=1)
        axis.set_ylabel(label)
        axis.set_ylim(bottom=0, top=max(values + [1.0]) * 1.25)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


async def soak(args: argparse.Namespace) -> int:
    spec = SimSpec(
        replicas=args.replicas,
        time_scale=args.time_scale,
        decode_tokens_per_s=50.0,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )
    fleet = SimFleet(spec)
    await fleet.fresh()
    try:
        router = await start_router("cache_aware", fleet.urls, capacity_tokens=spec.kv_capacity_tokens)
        try:
            return await _run(args, router.url)
        finally:
            router.stop()
    finally:
        fleet.stop()


async def _run(args: argparse.Namespace, router_url: str) -> int:
    mix = LoadMix(
        stream_share=0.6,
        disconnect_share=0.25,
        min_tokens=8,
        max_tokens=64,
        prompt_words=60,
        distinct_prompts=args.distinct_prompts or None,
    )
    load = SteadyLoad(router_url, concurrency=args.concurrency, mix=mix, seed=args.seed, request_timeout_s=60.0)
    duration_s = args.minutes * 60.0
    samples: list[Sample] = []
    started = time.monotonic()
    load.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
            while True:
                samples.append(await _sample(client, router_url, started, load))
                last = samples[-1]
                print(
                    f"{last.t_s:7.0f} s  rss {last.rss_bytes / 2**20:7.1f} MiB  fds {last.open_fds:4.0f}  "
                    f"tasks {last.asyncio_tasks:4.0f}  index {last.index_bytes / 2**20:6.2f} MiB  "
                    f"requests {last.requests_sent}",
                    file=sys.stderr,
                )
                if time.monotonic() - started >= duration_s:
                    break
                await asyncio.sleep(min(args.interval_s, max(0.0, duration_s - (time.monotonic() - started))))
    finally:
        await load.stop()
        await load.close()
    tally = load.tally()
    verdict = judge(
        samples,
        tally,
        warmup_fraction=args.warmup_fraction,
        max_rss_growth=args.max_rss_growth,
        concurrency=args.concurrency,
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "replicas": args.replicas,
        "requests": tally.as_dict(),
        "verdict": asdict(verdict),
        "samples": [asdict(s) for s in samples],
    }
    (args.out_dir / "soak.json").write_text(json.dumps(result, indent=2))
    plot(
        samples,
        args.out_dir / "soak.png",
        f"kvroute soak: {args.minutes:g} min, {tally.sent} requests, {tally.lost} lost",
    )
    first, last = samples[min(len(samples) - 1, max(1, int(len(samples) * args.warmup_fraction)) - 1)], samples[-1]
    print(f"\n{'':<24}{'after warm-up':>16}{'end':>16}")
    print(f"{'resident memory (MiB)':<24}{first.rss_bytes / 2**20:>16.1f}{last.rss_bytes / 2**20:>16.1f}")
    print(f"{'open file descriptors':<24}{first.open_fds:>16.0f}{last.open_fds:>16.0f}")
    print(f"{'asyncio tasks':<24}{first.asyncio_tasks:>16.0f}{last.asyncio_tasks:>16.0f}")
    print(f"{'prefix index (MiB)':<24}{first.index_bytes / 2**20:>16.2f}{last.index_bytes / 2**20:>16.2f}")
    print(
        f"\nrequests: {tally.sent} sent, {tally.completed} completed, {tally.failed} failed with an error, "
        f"{tally.disconnected} hung up by the client, {tally.lost} lost"
    )
    print(
        f"verdict: {'flat' if verdict.flat else 'NOT flat'} (rss growth {verdict.rss_growth:+.1%}, "
        f"fds +{verdict.fds_over_warmup:.0f}, tasks +{verdict.tasks_over_warmup:.0f}, "
        f"index {verdict.index_growth:+.1%})"
    )
    print(f"written: {args.out_dir / 'soak.json'}, {args.out_dir / 'soak.png'}")
    return 0 if verdict.flat else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=10.0, help="sim engines run this much faster")
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=65536,
        help="per engine; small enough that caches (and the router's index) fill and evict",
    )
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed after warm-up (0.10: 10%%)")
    parser.add_argument(
        "--distinct-prompts",
        type=int,
        default=2000,
        help="user turns drawn from this many texts; 0: a new one every request (then the tokenizer's piece "
        "cache and the conversation ledger grow until their bounds, 64 MiB and 10 min, longer than 10 minutes)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path("soak"))
    args = parser.parse_args(argv)
    return run_stoppable(soak(args))


if __name__ == "__main__":
    sys.exit(main())
