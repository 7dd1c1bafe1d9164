"""What one placement costs on the router exchange: CPU per message on each side.

``python -m kvroute.benchmarks.bench_peer_exchange [--transport unix,ipc,tcp,curve] [--rate 2000] [--count 4000] [--blocks 32] [--out FILE]``

A publishing :class:`PeerExchange` in this process sends ``count`` placements of
``blocks`` block hashes at ``rate`` per second, one per event-loop turn (as a router
routing one request per turn does), to a subscribing exchange in a child process, both
on uvloop as the router runs: over ``unix://`` (Unix stream sockets, as the workers of
``kvroute serve --workers N`` are joined), ZMQ's ``ipc://`` (how they were joined
before), ZMQ over loopback TCP (routers on different hosts), or the same with CurveZMQ
(``curve``: ``--peer-secret-file``). Each repeat runs every transport in turn. CPU is each process's user + system
time, ZMQ's I/O threads included. The publisher's pacing costs CPU of its own (a timer
per turn), so a run with the same pacing and nothing published is subtracted from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import uvloop

from kvroute.benchmarks.fleet import free_port
from kvroute.benchmarks.results import machine
from kvroute.router.peer_key import PeerKey
from kvroute.router.routing.peer_exchange import PeerExchange, Placement

TRANSPORTS = ("unix", "ipc", "tcp", "curve")
#: The ``curve`` transport's key pair, derived alike in both processes.
BENCH_KEY = PeerKey.from_text("bench-peer-exchange-secret-0123456789")


@dataclass(frozen=True, slots=True)
class ExchangeCost:
    transport: str
    rate: float
    count: int
    blocks: int
    publisher_us: float
    subscriber_us: float
    received: int


async def _paced(count: int, rate: float, publish: PeerExchange | None, placement: Placement) -> float:
    """CPU seconds of ``count`` event-loop turns at ``rate``, publishing one placement each."""
    start = time.process_time()
    for _ in range(count):
        if publish is not None:
            publish.publish(placement)
        await asyncio.sleep(1 / rate)
    await asyncio.sleep(0.2)  # the last sends leave
    return time.process_time() - start


async def _publish(endpoint: str, rate: float, count: int, blocks: int, key: PeerKey | None) -> tuple[float, float]:
    exchange = PeerExchange(bind=endpoint, peers=[], apply=lambda _: None, max_bytes_per_s=1e12, key=key)
    await exchange.start()
    placement = Placement("http://10.0.0.1:8000", 16, np.arange(blocks, dtype=np.uint64), 16 * blocks)
    try:
        await asyncio.sleep(1.0)  # the subscriber connects
        idle = await _paced(count, rate, None, placement)
        busy = await _paced(count, rate, exchange, placement)
    finally:
        await exchange.stop()
    return idle, busy


async def _subscribe(endpoint: str, count: int, timeout_s: float, key: PeerKey | None) -> None:
    received: list[Placement] = []
    exchange = PeerExchange(bind=None, peers=[endpoint], apply=received.append, max_bytes_per_s=1e12, key=key)
    await exchange.start()
    print("ready", flush=True)
    deadline = time.monotonic() + timeout_s
    while not received and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    start = time.process_time()
    while len(received) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu = time.process_time() - start
    await exchange.stop()
    print(json.dumps({"cpu_s": cpu, "received": len(received)}), flush=True)


def measure(rate: float, count: int, blocks: int, transport: str = "unix") -> ExchangeCost:
    with tempfile.TemporaryDirectory() as folder:
        endpoint = f"{transport}://{folder}/exchange"
        if transport in ("tcp", "curve"):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
        curve = ["--curve"] if transport == "curve" else []
        child = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--subscriber", endpoint, "--count", str(count), *curve],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        key = BENCH_KEY if transport == "curve" else None
        idle, busy = uvloop.run(_publish(endpoint, rate, count, blocks, key))
        report = json.loads(child.stdout.readline())
        child.wait(timeout=30)
    return ExchangeCost(
        transport=transport,
        rate=rate,
        count=count,
        blocks=blocks,
        publisher_us=round((busy - idle) / count * 1e6, 1),
        subscriber_us=round(report["cpu_s"] / max(1, report["received"]) * 1e6, 1),
        received=report["received"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.bench_peer_exchange", description=__doc__)
    parser.add_argument(
        "--transport", default="unix,ipc", help=f"comma-separated, each of {', '.join(TRANSPORTS)}, alternated"
    )
    parser.add_argument("--rate", type=float, default=2000.0, help="placements per second")
    parser.add_argument("--count", type=int, default=4000)
    parser.add_argument("--blocks", type=int, default=32, help="block hashes per placement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--subscriber", help=argparse.SUPPRESS)
    parser.add_argument("--curve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.subscriber:
        uvloop.run(_subscribe(args.subscriber, args.count, timeout_s=60.0, key=BENCH_KEY if args.curve else None))
        return 0
    transports = [name.strip() for name in args.transport.split(",") if name.strip()]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown or not transports:
        parser.error(f"--transport: unknown {unknown}; known: {', '.join(TRANSPORTS)}")
    rows = [
        measure(args.rate, args.count, args.blocks, transport) for _ in range(args.repeats) for transport in transports
    ]
    for row in rows:
        print(
            f"{row.transport}, {row.rate:.0f}/s, {row.blocks} blocks: publisher {row.publisher_us} us, "
            f"subscriber {row.subscriber_us} us per placement ({row.received}/{row.count} received)"
        )
    print(machine())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
