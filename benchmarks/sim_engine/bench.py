"""How much CPU the simulator itself spends per request (it must stay cheap: benchmarks
run 4+ replicas on a 2-core machine).

Starts ``kvroute sim-engine`` as a subprocess at a high ``--time-scale`` so modelled
compute is negligible, drives it at fixed concurrency with ~2 KB chat bodies (streaming
with usage, and not), and reads the process's CPU time from ``/proc/<pid>/stat``::

    python -m kvroute.benchmarks.sim_engine.bench [--requests 2000] [--concurrency 32] [--out FILE]

Prints a table and writes JSON (default ``bench-out/sim_engine.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Result:
    scenario: str
    requests: int
    concurrency: int
    max_tokens: int
    seconds: float
    requests_per_s: float
    sim_cpu_us_per_request: float


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _chat_body(index: int, stream: bool, max_tokens: int) -> dict[str, object]:
    # ~2 KB: a shared system prompt (cache hits, as in real fleets) and a distinct question.
    system = "You are a helpful assistant for a logistics company. Answer precisely. " * 24
    body: dict[str, object] = {
        "model": "sim",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {index}: where is shipment {index * 7919}?"},
        ],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _drive(url: str, requests: int, concurrency: int, stream: bool, max_tokens: int) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while not queue.empty():
                index = queue.get_nowait()
                body = _chat_body(index, stream, max_tokens)
                async with session.post(url + "/v1/chat/completions", json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


async def _wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("sim-engine did not start")
            await asyncio.sleep(0.1)


async def run(requests: int, concurrency: int, max_tokens: int, time_scale: float) -> list[Result]:
    port = _free_port()
    command = [sys.executable, "-m", "kvroute.router.cli", "sim-engine", "--port", str(port),
               "--time-scale", str(time_scale), "--max-num-seqs", "1024"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        await _wait_ready(url, process)
        await _drive(url, min(200, requests), concurrency, False, max_tokens)  # warm-up
        for scenario, stream in (("chat", False), ("chat-stream+usage", True)):
            before = _cpu_seconds(process.pid)
            seconds = await _drive(url, requests, concurrency, stream, max_tokens)
            cpu = _cpu_seconds(process.pid) - before
            results.append(
                Result(
                    scenario,
                    requests,
                    concurrency,
                    max_tokens,
                    round(seconds, 3),
                    round(requests / seconds, 1),
                    round(cpu / requests * 1e6, 1),
                )
            )
    finally:
        process.terminate()
        process.wait(timeout=10)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.sim_engine.bench", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=10000.0)
    parser.add_argument("--out", type=Path, default=Path("bench-out/sim_engine.json"))
    args = parser.parse_args(argv)
    results = asyncio.run(run(args.requests, args.concurrency, args.max_tokens, args.time_scale))
    print(f"{'scenario':<20} {'requests':>8} {'conc':>5} {'tokens':>6} {'req/s':>8} {'sim CPU us/req':>15}")
    for result in results:
        print(f"{result.scenario:<20} {result.requests:>8} {result.concurrency:>5} {result.max_tokens:>6} "
              f"{result.requests_per_s:>8.1f} {result.sim_cpu_us_per_request:>15.1f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    args.out.write_text(json.dumps({"machine": machine, "results": [asdict(r) for r in results]}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
