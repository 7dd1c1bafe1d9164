"""The routing engine's CPU per request, stage by stage, in one process (no HTTP, no profiler).

    python3 -m kvroute.benchmarks.profile_routing [--passes 7] [--per-prompt 16] [--evict-mb 16] [--neighbour]
                                                  [--new-words 20] [--bodies agent] [--json FILE]

The ~2 KB chat bodies of ``kvroute bench --overhead`` (64 system prompts; ``--bodies
agent``: its agent conversations, 4 to 14 messages with tool calls) go through the
stages ``kvroute serve --policy cache_aware`` runs for each request, each stage timed on
its own over all bodies with the thread's CPU clock (``time.thread_time_ns``), so neither
other processes on a shared machine nor a profiler's own cost count: parse (the JSON
body), render (the chat template), tokenize (the rendered text, pieces memoised), hash
(chained block hashes), route (index match, the policy's choice, inserting the blocks,
the in-flight ledger; :data:`IN_FLIGHT` requests at a time) and observe (the feedback
after the answer). ``prepare`` is render +
tokenize + hash as the engine runs them together (its sum check). Every body is sent
through once before timing (the steady state of a repeated set, as the overhead
benchmark measures); each figure is the median over ``--passes``, with its spread.

``--new-words N`` adds N vocabulary words and a number no request had before to every
user turn, as ``kvroute bench --overhead --new-words N`` sends them: each stage of each
pass gets bodies of its own, so the tokenizer meets new text in every request, as it
does in real traffic (a new question or tool result), not a cached piece.

Run stage after stage over every body, each stage's code and data stay in the CPU's
caches, which a loaded server's requests never find: between two requests' routing the
HTTP work of others has evicted them. ``--evict-mb N`` touches N MB (untimed) before
every item of every stage, which brings these timings close to the server's stage timers
(:mod:`kvroute.benchmarks.stage_timers`) at saturation.

``--neighbour`` pins this process to one CPU and runs a Python process that churns dicts
(:data:`NEIGHBOUR_CODE`) on another, as a loaded router always has next to it (its clients,
the engines, other routers). On the shared 2-core VM that alone doubles every stage's
thread CPU time (benchmarks/README.md, "Round 9"), while a neighbour that computes in
registers (sha256 of 256 bytes) changes nothing: the two CPUs share caches, and what a
request costs is mostly what it must fetch again.

It complements :mod:`kvroute.benchmarks.profile_request` (a loaded server sampled by py-spy,
whose wall-clock samples also charge waits for the CPU to the call that waited): this
one is exact for the routing stages and blind to the HTTP server and the relay.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from kvroute.benchmarks.overhead import BODY_KINDS, UPSTREAM_CAPACITY_TOKENS, NewWords, bodies_of
from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.request_info import ENDPOINTS, parse_request
from kvroute.router.routing.routing_engine import RoutingEngine
from kvroute.tokenizer_index import RequestTokenizer
from kvroute.tokenizer_index.hashing import block_hashes, request_salt

CHAT = next(endpoint for endpoint in ENDPOINTS if endpoint.path == "/v1/chat/completions")
BLOCK_SIZE = 16
#: Requests routed before their answers are observed, as ``kvroute bench --overhead
#: --concurrency 32`` keeps at most in flight: the blocks they compute are what later
#: requests' routes look through (all 1,024 bodies in flight made each route ~30 us dearer).
IN_FLIGHT = 32
#: The ``--neighbour`` process: an interpreter allocating and dropping small objects, as
#: the load generator, the engines and other routers on the same machine do.
NEIGHBOUR_CODE = """
table = {}
while True:
    for key in range(2000):
        table[str(key)] = [key, str(key)]
    table.clear()
"""


@dataclass(slots=True)
class StageTime:
    stage: str
    median_us: float
    min_us: float
    max_us: float


def _timed(items: Sequence[Any], step: Callable[[Any], object], evict: Callable[[], object] | None = None) -> float:
    """Thread CPU microseconds per item of running ``step`` over ``items``; with ``evict``,
    called untimed before each item."""
    if evict is None:
        started = time.thread_time_ns()
        for item in items:
            step(item)
        return (time.thread_time_ns() - started) / len(items) / 1000
    clock = time.thread_time_ns
    total = 0
    for item in items:
        evict()
        started = clock()
        step(item)
        total += clock() - started
    return total / len(items) / 1000


def _evictor(megabytes: int) -> Callable[[], object] | None:
    """Touches ``megabytes`` of memory, read and write, so the caches hold little else."""
    if not megabytes:
        return None
    junk = np.ones(megabytes * (1 << 20) // 8, dtype=np.int64)

    def evict() -> None:
        junk[::8] += 1  # one write per 64-byte line

    return evict


@contextlib.contextmanager
def busy_neighbour() -> Iterator[int]:
    """This process pinned to its first allowed CPU and :data:`NEIGHBOUR_CODE` running on
    the second, until the block ends; yields the neighbour's pid."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        raise RuntimeError("--neighbour needs two CPUs")
    own, other = sorted(allowed)[:2]
    os.sched_setaffinity(0, {own})
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR_CODE])
    try:
        os.sched_setaffinity(neighbour.pid, {other})
        yield neighbour.pid
    finally:
        neighbour.kill()
        neighbour.wait()
        os.sched_setaffinity(0, allowed)


class _StageInputs:
    """What each stage reads, from one list of bodies: each computed on first use, so a
    stage's texts are new to the tokenizer unless an earlier stage read them."""

    def __init__(self, raws: list[bytes], engine: RoutingEngine, tokenizer: RequestTokenizer) -> None:
        self.raws = raws
        self._engine = engine
        self._tokenizer = tokenizer

    @functools.cached_property
    def parsed(self) -> list[Any]:
        return [parse(raw) for raw in self.raws]

    @functools.cached_property
    def chats(self) -> list[tuple[Any, Any]]:
        """Each body's messages and tools (what the render reads)."""
        return [(body["messages"], body.get("tools")) for body in map(orjson.loads, self.raws)]

    @functools.cached_property
    def texts(self) -> list[str]:
        return [render(self._tokenizer, chat) for chat in self.chats]

    @functools.cached_property
    def tokens(self) -> list[np.ndarray]:
        return [self._tokenizer.encode_text_array(text) for text in self.texts]

    @functools.cached_property
    def pairs(self) -> list[tuple[Any, Any]]:
        return [(request, self._engine.prepare(CHAT.path, request.body)) for request in self.parsed]


def parse(raw: bytes) -> Any:
    return parse_request(raw, CHAT, {}, "x-session-id")


def render(tokenizer: RequestTokenizer, chat: tuple[Any, Any]) -> str:
    messages, tools = chat
    return tokenizer.render_chat(messages, tools=tools)


def profile_stages(
    passes: int = 7, per_prompt: int = 16, evict_mb: int = 0, new_words: int = 0, body_kind: str = "chat"
) -> list[StageTime]:
    bodies = bodies_of(body_kind, per_prompt=per_prompt)
    engine = RoutingEngine(Settings(policy="cache_aware", block_size=BLOCK_SIZE))
    # Bounded as kvroute serve bounds the overhead bench's upstreams: the bodies' blocks
    # exceed the caches, so routes evict as a loaded router's do.
    candidates = [Backend(url, capacity_tokens=UPSTREAM_CAPACITY_TOKENS) for url in ("http://b0", "http://b1")]
    tokenizer = RequestTokenizer.default()
    salt = request_salt("overhead")
    repeated = _StageInputs(bodies, engine, tokenizer)
    with_new_words = NewWords(bodies, new_words) if new_words else None

    def inputs() -> _StageInputs:
        """The repeated bodies, or (``--new-words``) bodies no stage has seen."""
        if with_new_words is None:
            return repeated
        return _StageInputs([with_new_words() for _ in bodies], engine, tokenizer)

    def prepare(request: Any) -> Any:
        return engine.prepare(CHAT.path, request.body)

    def route(pair: tuple[Any, Any]) -> Any:
        request, prompt = pair
        return engine.route(CHAT.path, request.body, {}, candidates, prepared=prompt, parsed=request)

    plans: list[Any] = []

    def route_and_keep(pair: tuple[Any, Any]) -> None:
        plans.append(route(pair))

    def observe(plan: Any) -> None:
        engine.observe(plan, None)

    def route_and_observe(pairs: Sequence[tuple[Any, Any]]) -> tuple[float, float]:
        """Thread CPU microseconds per request of routing and of observing, up to
        :data:`IN_FLIGHT` requests at a time: routed, then their answers observed."""
        routing = observing = 0.0
        for start in range(0, len(pairs), IN_FLIGHT):
            chunk = pairs[start : start + IN_FLIGHT]
            routing += _timed(chunk, route_and_keep, evict) * len(chunk)
            observing += _timed(plans, observe, evict) * len(plans)
            plans.clear()
        return routing / len(pairs), observing / len(pairs)

    for pair in repeated.pairs:  # the index, the ledgers and the caches in their steady state
        observe(route(pair))
    repeated.tokens  # noqa: B018 (every stage's repeated input read once before timing)
    stages: dict[str, list[float]] = {}
    evict = _evictor(evict_mb)
    for _ in range(passes):
        measured = {
            "parse": _timed(inputs().raws, parse, evict),
            "render": _timed(inputs().chats, functools.partial(render, tokenizer), evict),
            "tokenize": _timed(inputs().texts, tokenizer.encode_text_array, evict),
            "hash": _timed(inputs().tokens, lambda ids: block_hashes(ids, BLOCK_SIZE, salt), evict),
            "prepare (render+tokenize+hash)": _timed(inputs().parsed, prepare, evict),
        }
        measured["route"], measured["observe"] = route_and_observe(inputs().pairs)
        for stage, value in measured.items():
            stages.setdefault(stage, []).append(value)
    rows = [StageTime(stage, statistics.median(values), min(values), max(values)) for stage, values in stages.items()]
    end_to_end = [
        sum(stages[stage][number] for stage in ("parse", "prepare (render+tokenize+hash)", "route", "observe"))
        for number in range(passes)
    ]
    rows.append(
        StageTime("parse+prepare+route+observe", statistics.median(end_to_end), min(end_to_end), max(end_to_end))
    )
    return rows


def format_stages(rows: Sequence[StageTime]) -> str:
    lines = [f"{'stage':<32} {'median us':>10} {'min':>8} {'max':>8}"]
    lines += [f"{row.stage:<32} {row.median_us:>10.1f} {row.min_us:>8.1f} {row.max_us:>8.1f}" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m kvroute.benchmarks.profile_routing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--per-prompt", type=int, default=16)
    parser.add_argument("--evict-mb", type=int, default=0, help="MB touched before each item (cold caches)")
    parser.add_argument(
        "--neighbour", action="store_true", help="a dict-churning Python process on another CPU while timing"
    )
    parser.add_argument(
        "--new-words", type=int, default=0, help="new words in every request's last turn (new text each pass)"
    )
    parser.add_argument("--bodies", choices=BODY_KINDS, default="chat", help="as kvroute bench --overhead sends")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with busy_neighbour() if args.neighbour else contextlib.nullcontext():
        rows = profile_stages(args.passes, args.per_prompt, args.evict_mb, args.new_words, args.bodies)
    print(format_stages(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
