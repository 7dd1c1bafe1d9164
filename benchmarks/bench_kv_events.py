"""How fast the router takes in KV events: decode, apply, and the whole ZeroMQ path.

``python -m kvroute.benchmarks.bench_kv_events [--out bench-out/kv_events.json] [--quick]``

Three measurements, each on vLLM-shaped traffic (a step = one message holding stores of
new blocks, continuing earlier ones, and evictions of old ones, so the index stays at a
steady size):

* **decode** — ``KVEventDecoder.decode_payload`` alone, map and array event forms, for
  steps of 1, 8 and 64 events: events/s and blocks/s.
* **apply** — decode plus ``PreciseIndex.apply_events`` and ``flush`` per step (hashing
  the stored tokens with the router's chained hash, updating the engine-hash map, writing
  the step's net change to the index).
* **stream** — a real PUB socket sending pre-encoded steps as fast as it can to a real
  ``KVEventSubscriber`` feeding a ``PreciseIndex`` over TCP loopback: what a busy engine
  would see; also reports gaps (messages the subscriber lost and had to recover).

A busy GPU replica prefilling 50K tokens/s at block size 16 stores ~3K blocks/s; the
numbers below are to be compared with that.

``--paced RATE`` adds what a subscriber costs at a steady rate rather than flat out: a
publisher in another process sends one-event steps at ``RATE`` per second over ``ipc://``
and this process reports its own CPU (ZMQ's I/O thread included) per step received. An
engine sends a step each scheduler step that changes its cache (tens per second), so a
router following many engines pays this per engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from kvroute.benchmarks.results import machine
from kvroute.router.routing.kv_events import KVEventDecoder, KVEventsState
from kvroute.router.routing.precise_index import PreciseIndex

ENCODE = msgspec.msgpack.Encoder().encode
BACKEND = "http://127.0.0.1:1"


@dataclass(frozen=True, slots=True)
class Result:
    """One row of the table."""

    stage: str
    form: str
    block_size: int
    events_per_step: int
    steps: int
    events_per_s: float
    blocks_per_s: float
    mb_per_s: float


class StepSource:
    """vLLM-like steps: each store continues a live sequence or starts one; old sequences
    are evicted tail-first so the engine holds a bounded set."""

    def __init__(self, block_size: int, events_per_step: int, form: str, seed: int = 0) -> None:
        self.block_size = block_size
        self.events_per_step = events_per_step
        self.array = form == "array"
        self._rng = np.random.default_rng(seed)
        self._next_hash = 1
        self._sequences: list[list[int]] = []  # engine hashes, head first

    def _new_hashes(self, count: int) -> list[int]:
        first = self._next_hash
        self._next_hash += count
        return list(range(first, first + count))

    def _store(self, blocks: int) -> Any:
        tokens = self._rng.integers(0, 32000, size=blocks * self.block_size).tolist()
        extend = self._sequences and self._rng.random() < 0.5
        sequence = self._sequences[int(self._rng.integers(len(self._sequences)))] if extend else []
        parent = sequence[-1] if sequence else None
        hashes = self._new_hashes(blocks)
        sequence.extend(hashes)
        if not extend:
            self._sequences.append(sequence)
        fields = [hashes, parent, tokens, self.block_size, None, "GPU", None]
        if self.array:
            return ["BlockStored", *fields]
        names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
        return {"type": "BlockStored", **dict(zip(names, fields))}

    def _evict(self) -> Any:
        sequence = self._sequences.pop(0)
        gone = sequence[::-1]  # tail first, as the engine frees them
        return (
            ["BlockRemoved", gone, "GPU"]
            if self.array
            else {"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"}
        )

    def step(self) -> tuple[bytes, int]:
        """(payload, blocks mentioned) of one step."""
        events: list[Any] = []
        blocks = 0
        for _ in range(self.events_per_step):
            if len(self._sequences) > 64:
                event = self._evict()
                blocks += len(event[1] if self.array else event["block_hashes"])
            else:
                count = int(self._rng.integers(1, 9))
                event = self._store(count)
                blocks += count
            events.append(event)
        return ENCODE([time.time(), events, 0]), blocks


def make_steps(block_size: int, events_per_step: int, form: str, steps: int) -> tuple[list[bytes], int, int]:
    """Pre-encoded steps, their event count and block count."""
    source = StepSource(block_size, events_per_step, form)
    payloads, blocks = [], 0
    for _ in range(steps):
        payload, step_blocks = source.step()
        payloads.append(payload)
        blocks += step_blocks
    return payloads, steps * events_per_step, blocks


def _result(
    stage: str,
    form: str,
    block_size: int,
    per_step: int,
    payloads: list[bytes],
    events: int,
    blocks: int,
    seconds: float,
) -> Result:
    size = sum(len(payload) for payload in payloads)
    return Result(
        stage,
        form,
        block_size,
        per_step,
        len(payloads),
        events / seconds,
        blocks / seconds,
        size / seconds / 1e6,
    )


def bench_decode(payloads: list[bytes], repeats: int) -> float:
    """Median seconds to decode every payload once."""
    times = []
    for _ in range(repeats):
        decoder = KVEventDecoder()
        start = time.perf_counter()
        for seq, payload in enumerate(payloads):
            decoder.decode_payload(seq, payload)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_apply(payloads: list[bytes], repeats: int) -> float:
    """Median seconds to decode and apply every payload to a fresh precise index, writing
    each step to the index before the next (the worst case: a subscriber batches the
    steps that queue up while it works)."""
    times = []
    for _ in range(repeats):
        decoder = KVEventDecoder()
        index = PreciseIndex()
        index.set_state(BACKEND, KVEventsState.PRECISE)
        start = time.perf_counter()
        for seq, payload in enumerate(payloads):
            index.apply_events(BACKEND, decoder.decode_payload(seq, payload).events)
            index.flush()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _publish(port: int, payloads: list[bytes], ready: threading.Event) -> None:
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.setsockopt(zmq.LINGER, 2000)
    pub.bind(f"tcp://127.0.0.1:{port}")
    ready.wait(10)
    time.sleep(0.3)  # let the SUB's subscription reach the PUB before the first step
    for seq, payload in enumerate(payloads):
        pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))
    pub.close()
    context.term()


async def bench_stream(payloads: list[bytes]) -> tuple[float, int]:
    """Seconds per full run of ``payloads`` through real sockets into a precise index, and
    the gaps the subscriber had to recover (the steps before the first one it saw are
    lost to the subscription's start, so the time is scaled to the whole run)."""
    port = free_port()
    index = PreciseIndex()
    index.add_backend(BACKEND, f"tcp://127.0.0.1:{port}")
    subscriber = index.subscriber(BACKEND)
    assert subscriber is not None
    ready = threading.Event()
    publisher = threading.Thread(target=_publish, args=(port, payloads, ready), daemon=True)
    publisher.start()
    await index.start()
    ready.set()
    while subscriber.stats.messages == 0:
        await asyncio.sleep(0.0005)
    start = time.perf_counter()
    first_seen = subscriber.expected_seq or 0
    deadline = time.monotonic() + 120
    while (subscriber.expected_seq or 0) < len(payloads) and time.monotonic() < deadline:
        await asyncio.sleep(0.0005)
    elapsed = time.perf_counter() - start
    gaps = subscriber.stats.gaps
    await index.stop()
    publisher.join(10)
    measured = max(1, len(payloads) - first_seen)
    return elapsed * len(payloads) / measured, gaps


def _publish_paced(endpoint: str, rate: float, steps: int) -> None:
    """The paced publisher (a child process): one-event steps at ``rate`` per second."""
    payloads, _, _ = make_steps(16, 1, "array", steps)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100_000)
    pub.bind(endpoint)
    time.sleep(1.0)  # the subscriber connects and subscribes
    start = time.monotonic()
    for seq, payload in enumerate(payloads):
        pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))
        time.sleep(max(0.0, start + (seq + 1) / rate - time.monotonic()))
    time.sleep(0.5)
    pub.close()
    context.term()


async def bench_paced(rate: float, steps: int) -> tuple[float, int]:
    """This process's CPU seconds per step a subscriber takes at ``rate``, and steps measured."""
    with tempfile.TemporaryDirectory() as folder:
        endpoint = f"ipc://{folder}/kv-events"
        index = PreciseIndex()
        index.add_backend(BACKEND, endpoint)
        subscriber = index.subscriber(BACKEND)
        assert subscriber is not None
        command = [
            sys.executable,
            "-m",
            __spec__.name,
            "--publish",
            endpoint,
            "--rate",
            str(rate),
            "--steps",
            str(steps),
        ]
        publisher = subprocess.Popen(command)
        await index.start()
        try:
            while subscriber.stats.messages == 0:
                await asyncio.sleep(0.001)
            cpu, seen = time.process_time(), subscriber.stats.messages
            await asyncio.sleep(max(0.5, (steps - seen) / rate - 1.0))  # stop before the last steps
            cpu, seen = time.process_time() - cpu, subscriber.stats.messages - seen
        finally:
            await index.stop()
            publisher.wait(timeout=60)
    return cpu / max(1, seen), seen


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def print_table(results: list[Result]) -> None:
    header = f"{'stage':<7} {'form':<6} {'block':>5} {'ev/step':>7} {'steps':>6} {'events/s':>12} {'blocks/s':>12} {'MB/s':>8}"
    print(header)
    print("-" * len(header))
    for row in results:
        print(
            f"{row.stage:<7} {row.form:<6} {row.block_size:>5} {row.events_per_step:>7} {row.steps:>6} "
            f"{row.events_per_s:>12,.0f} {row.blocks_per_s:>12,.0f} {row.mb_per_s:>8.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/kv_events.json"))
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--paced", type=float, default=0.0, help="also: subscriber CPU per step at this rate")
    parser.add_argument("--publish", help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=500.0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3000, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.publish:
        _publish_paced(args.publish, args.rate, args.steps)
        return 0
    steps, repeats = (300, 2) if args.quick else (1000, 3)
    results: list[Result] = []
    for block_size in (16, 32):
        for per_step in (1, 8, 64):
            for form in ("map", "array"):
                payloads, events, blocks = make_steps(block_size, per_step, form, max(50, steps // per_step * 4))
                seconds = bench_decode(payloads, repeats)
                results.append(_result("decode", form, block_size, per_step, payloads, events, blocks, seconds))
                seconds = bench_apply(payloads, repeats)
                results.append(_result("apply", form, block_size, per_step, payloads, events, blocks, seconds))
    for form in ("map", "array"):
        payloads, events, blocks = make_steps(16, 8, form, steps * 5)
        seconds, gaps = asyncio.run(bench_stream(payloads))
        results.append(_result("stream", form, 16, 8, payloads, events, blocks, seconds))
        if gaps:
            print(f"stream ({form}): {gaps} gaps recovered", file=sys.stderr)
    print_table(results)
    report: dict[str, Any] = {"results": [asdict(row) for row in results]}
    if args.paced:
        paced_steps = int(args.paced * (2 if args.quick else 6))
        cpu_per_step, measured = asyncio.run(bench_paced(args.paced, paced_steps))
        report["paced"] = {"rate": args.paced, "steps": measured, "cpu_us_per_step": round(cpu_per_step * 1e6, 1)}
        print(
            f"\npaced: {args.paced:.0f} steps/s, 1 event of 16 blocks each: {cpu_per_step * 1e6:.0f} us "
            f"of subscriber CPU per step ({measured} steps)"
        )
    print(machine())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
