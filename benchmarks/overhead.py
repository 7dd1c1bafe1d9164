"""``kvroute bench --overhead``: what a router costs, direct vs each policy vs each peer.

1,024 distinct ~2 KB chat requests (64 system prompts x 16 user turns) go to: one of the
upstreams directly, a ``kvroute serve`` per policy (and per ``--workers`` count), each
installed peer router (SGLang's, vLLM's) per ``--peer-policies``, and with ``--baseline
DIR`` each policy served from another source tree, all in front of the same trivial
upstreams (aiohttp processes with fixed answers, so the engine costs nothing). Every
target gets each body once first, so routers that memoise are measured in their steady
state. Then, in rounds that visit every target in turn (a shared machine drifts; every
target sees the same drift):

* closed loops of C clients (``--concurrency``) for a few seconds: requests/s, latency
  p50/p99, latency added over direct, and the router's CPU per request (user + system
  time of its process group from ``/proc``, divided by the requests it served); the most
  requests/s a target reached is its saturation throughput;
* a fixed offered rate, ``--rate-fraction`` of the slowest router's saturation, as an open
  loop: latency counted from each request's due time (at saturation latency only measures
  queueing), and CPU per request at that rate.

Figures are medians over rounds, with their spread (min, max). The client is Python and
shares the machine: compare CPU per request and added latency, not absolute requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.fleet import PEERS, ManagedProcess, free_port
from kvroute.benchmarks.replay import Progress
from kvroute.benchmarks.results import percentile
from kvroute.benchmarks.workloads import VOCABULARY, words
from kvroute.router.config import POLICY_NAMES

DIRECT = "direct"
MODEL = "overhead"


def chat_body(size_bytes: int = 2048, system: str = "You are a helpful assistant.", seed: int = 42) -> bytes:
    """A chat request of about ``size_bytes`` bytes: ``system``, then a random user turn."""
    import numpy as np

    text = words(np.random.default_rng(seed), size_bytes // 5)
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
    }
    encoded = orjson.dumps(body)
    while len(encoded) > size_bytes:
        text = text[: len(text) - (len(encoded) - size_bytes)]
        body["messages"][1]["content"] = text
        encoded = orjson.dumps(body)
    return encoded


def agent_messages(number: int, messages: int, system: str) -> list[dict[str, Any]]:
    """Agent conversation ``number`` with ``messages`` messages (even, >= 2): ``system``, a
    task, then per turn an assistant tool call and its tool result (what coding agents
    send), with ids, paths and texts of its own."""
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Task {number}: find why the tests of module {number} fail, and fix it."},
    ]
    for turn in range((messages - 2) // 2):
        call_id = f"call_{number}_{turn}"
        arguments = orjson.dumps({"path": f"src/module_{number}/part_{turn}.py"}).decode()
        call = {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": arguments}}
        chat += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": call_id,
                "content": f"# part {turn} of module {number}\n" + "def step(value):\n    return value + 1\n" * 8,
            },
        ]
    return chat


#: Messages per agent body, in turn: a conversation's second to seventh tool call.
AGENT_MESSAGES = (4, 6, 8, 10, 12, 14)


def _tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    properties = {key: {"type": "string", "description": text} for key, text in parameters.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(parameters)},
        },
    }


#: The tools a coding agent offers with every turn (``--bodies agent-tools``), ~2.5 KB.
AGENT_TOOLS = [
    _tool("read_file", "Read a file of the repository and return its text.", path="Path from the root."),
    _tool("write_file", "Write text to a file, replacing it.", path="Path from the root.", text="New text."),
    _tool("list_dir", "List the entries of a folder.", path="Folder path from the root."),
    _tool("grep", "Search files for a regular expression.", pattern="Python regex.", path="Where to search."),
    _tool("run_tests", "Run the test suite or some of it and return the report.", selector="pytest node ids."),
    _tool("run_shell", "Run a shell command in the repository and return its output.", command="The command."),
    _tool("edit_file", "Replace one exact text in a file.", path="Path.", old="Text to find.", new="Its replacement."),
    _tool("ask_user", "Ask the user a question and wait for the answer.", question="What to ask."),
]


def agent_bodies(system_prompts: int = 64, per_prompt: int = 16, *, tools: bool = False) -> list[bytes]:
    """``system_prompts`` x ``per_prompt`` distinct agent requests (:func:`agent_messages`,
    4 to 14 messages, ~1.5-4 KB; with ``tools``, :data:`AGENT_TOOLS` offered too): the
    traffic kvroute is built for, where every turn's history carries tool calls and
    results. Each ends with its tool result's text, as :class:`NewWords` needs."""
    import numpy as np

    rng = np.random.default_rng(7)
    systems = [f"Agent {number}. " + words(rng, 200) for number in range(system_prompts)]
    bodies = []
    for number, system in enumerate(systems):
        for turn in range(per_prompt):
            conversation = number * per_prompt + turn
            chat = agent_messages(conversation, AGENT_MESSAGES[conversation % len(AGENT_MESSAGES)], system)
            offered = {"tools": AGENT_TOOLS} if tools else {}
            bodies.append(orjson.dumps({"model": MODEL, "max_tokens": 8, **offered, "messages": chat}))
    return bodies


#: What ``--bodies`` names: the request bodies the overhead bench sends.
BODY_KINDS = ("chat", "agent", "agent-tools")


def bodies_of(kind: str, body_bytes: int = 2048, per_prompt: int = 16) -> list[bytes]:
    """The bodies ``--bodies kind`` sends: :func:`chat_bodies` of ``body_bytes``, or
    :func:`agent_bodies` (``agent-tools``: with the tools offered), ``per_prompt`` per
    system prompt."""
    if kind not in BODY_KINDS:
        raise ValueError(f"bodies must be one of {', '.join(BODY_KINDS)}, not {kind!r}")
    if kind == "chat":
        return chat_bodies(body_bytes, per_prompt=per_prompt)
    return agent_bodies(per_prompt=per_prompt, tools=kind == "agent-tools")


def chat_bodies(size_bytes: int = 2048, system_prompts: int = 64, per_prompt: int = 16) -> list[bytes]:
    """``system_prompts`` x ``per_prompt`` distinct requests of about ``size_bytes`` bytes.

    Each has one of ``system_prompts`` system prompts (about half the body, as a fleet of
    apps has) and its own user turn, so a router that keys on the prompt sees shared
    prefixes and new text on every request, not one body it can answer from a cache.
    """
    import numpy as np

    rng = np.random.default_rng(7)
    systems = [f"App {number}. " + words(rng, size_bytes // 10) for number in range(system_prompts)]
    return [
        chat_body(size_bytes, system, seed=number * per_prompt + turn)
        for number, system in enumerate(systems)
        for turn in range(per_prompt)
    ]


class NewWords:
    """Bodies to send, each ``bodies``' next one with ``words`` new to every router in its
    user turn: vocabulary words and a number no request had before (real traffic brings a
    new question or tool result in nearly every request; repeated bodies are all cached)."""

    def __init__(self, bodies: Sequence[bytes], words: int, seed: int = 11) -> None:
        self._next_body = itertools.cycle(bodies).__next__
        self._words = words
        self._rng = random.Random(seed)
        self._vocabulary = VOCABULARY
        self._numbers = itertools.count()

    def __call__(self) -> bytes:
        body = self._next_body()
        assert body.endswith(_BODY_END)  # the user turn's content is the body's last string
        added = " ".join(self._rng.choices(self._vocabulary, k=self._words)) + f" #{next(self._numbers)}"
        return body[: -len(_BODY_END)] + b" " + added.encode() + _BODY_END


#: What a body from :func:`chat_body` ends with: the user turn's closing quote and brackets.
_BODY_END = b'"}]}'
BodySource = Sequence[bytes] | Callable[[], bytes]


def _next_body(bodies: BodySource) -> Callable[[], bytes]:
    return bodies if callable(bodies) else itertools.cycle(bodies).__next__


# --- the fast upstream ---------------------------------------------------------------------

_COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-overhead",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
        # No prompt_tokens_details: this upstream does not tokenize, so any cached_tokens it
        # made up would contradict the router's (correct) prediction for the repeated body and
        # put drift trimming, which a real engine rarely triggers, on every request.
        "usage": {"prompt_tokens": 400, "completion_tokens": 1, "total_tokens": 401},
    }
)
_MODELS = orjson.dumps(
    {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "owned_by": "kvroute-overhead", "max_model_len": 32768}],
    }
)
#: The KV cache the trivial upstream reports (as SGLang does): routers bound their index to it.
UPSTREAM_CAPACITY_TOKENS = 32768
_SERVER_INFO = orjson.dumps(
    {
        "model_path": MODEL,
        "served_model_name": MODEL,
        "max_total_num_tokens": UPSTREAM_CAPACITY_TOKENS,
        "is_generation": True,
    }
)


def serve_upstream(port: int) -> None:
    """Run the trivial upstream: fixed answers, no work (``--serve-upstream PORT``)."""
    from aiohttp import web

    def fixed(payload: bytes):
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=payload, content_type="application/json")

        return handler

    app = web.Application(client_max_size=1 << 26)  # huge_prompts_served sends 3.5 MB chats
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
    argv = [sys.executable, "-m", "kvroute.router.cli", "bench", "--overhead", "--serve-upstream", str(port)]
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
    """One load run against one URL."""

    requests: int
    errors: int
    seconds: float
    latencies_s: list[float]
    cpu_s: float | None  # the router's CPU time over the run; None for direct

    @property
    def cpu_us_per_request(self) -> float | None:
        """The router's CPU microseconds per request answered (None for direct or no requests)."""
        if self.cpu_s is None or not self.requests:
            return None
        return self.cpu_s / self.requests * 1e6


class LoadClient:
    """One aiohttp session posting the bodies in turn; counts what it sees."""

    def __init__(self, url: str, bodies: BodySource, connections: int) -> None:
        self._url = url + "/v1/chat/completions"
        self._next_body = _next_body(bodies)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections), timeout=aiohttp.ClientTimeout(total=30)
        )
        self.latencies: list[float] = []
        #: When each answered request of :meth:`timed` was due, in the order of ``latencies``.
        self.due: list[float] = []
        #: When each failed one was due.
        self.failed_due: list[float] = []

    @property
    def errors(self) -> int:
        return len(self.failed_due)

    async def post(self, body: bytes) -> bool:
        """One chat request with this body; whether it was answered 200."""
        async with self._session.post(self._url, data=body, headers={"content-type": "application/json"}) as response:
            await response.read()
            return response.status == 200

    async def one(self) -> bool:
        return await self.post(self._next_body())

    async def timed(self, since: float) -> None:
        """One request; its latency counted from ``since`` (its send time or its due time)."""
        try:
            ok = await self.one()
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok:
            self.latencies.append(time.perf_counter() - since)
            self.due.append(since)
        else:
            self.failed_due.append(since)

    async def close(self) -> None:
        await self._session.close()


async def _measured(client: LoadClient, load: Coroutine[Any, Any, None], pgid: int | None) -> LoadRun:
    cpu_before = group_cpu_seconds(pgid) if pgid else None
    started = time.perf_counter()
    await load
    elapsed = time.perf_counter() - started
    cpu = group_cpu_seconds(pgid) - cpu_before if pgid and cpu_before is not None else None
    return LoadRun(len(client.latencies) + client.errors, client.errors, elapsed, client.latencies, cpu)


async def closed_loop(
    url: str,
    bodies: BodySource,
    concurrency: int,
    seconds: float,
    pgid: int | None,
    *,
    requests: int | None = None,
) -> LoadRun:
    """``concurrency`` clients sending ``bodies`` in turn, back to back, for ``seconds``
    (or, given ``requests``, until that many were sent)."""
    client = LoadClient(url, bodies, concurrency)
    try:
        await asyncio.gather(*(client.one() for _ in range(concurrency)))  # warm the connections
        deadline = time.perf_counter() + seconds
        left = itertools.count(requests, -1) if requests is not None else None

        def more() -> bool:
            return next(left) > 0 if left is not None else time.perf_counter() < deadline

        async def worker() -> None:
            while more():
                await client.timed(time.perf_counter())

        load = asyncio.gather(*(worker() for _ in range(concurrency)))
        return await _measured(client, load, pgid)
    finally:
        await client.close()


async def fixed_rate(
    url: str, bodies: BodySource, rate_per_s: float, seconds: float, pgid: int | None, connections: int = 256
) -> LoadRun:
    """Requests sent at a fixed ``rate_per_s`` for ``seconds`` whatever the answers do (an
    open loop); each latency counts from the request's due time, so a client or router that
    falls behind shows as latency instead of silently lowering the rate."""
    client = LoadClient(url, bodies, connections)
    try:
        await asyncio.gather(*(client.one() for _ in range(min(connections, 32))))
        total = max(1, round(rate_per_s * seconds))
        return await _measured(client, send_at_rate(client, rate_per_s, lambda sent: sent < total), pgid)
    finally:
        await client.close()


async def send_at_rate(client: LoadClient, rate_per_s: float, more: Callable[[int], bool]) -> None:
    """``client``'s requests (:meth:`LoadClient.timed`) at ``rate_per_s`` whatever the answers
    do, while ``more(requests sent so far)``; returns when every one has ended."""
    interval = 1.0 / rate_per_s
    start = time.perf_counter()
    pending: set[asyncio.Task[None]] = set()
    number = 0
    while more(number):
        due = start + number * interval
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(client.timed(due))
        pending.add(task)
        task.add_done_callback(pending.discard)
        number += 1
    if pending:
        await asyncio.wait(pending)


@dataclass(slots=True)
class OverheadRow:
    """Median over rounds for one target under one load: ``closed`` (``concurrency``
    clients back to back) or ``rate`` (``offered_per_s`` requests per second)."""

    target: str
    mode: str
    concurrency: int | None
    offered_per_s: float | None
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    added_p50_ms: float | None
    added_p99_ms: float | None
    router_cpu_us_per_request: float | None
    errors: int
    #: The spread over rounds: (min, max) of requests/s and of CPU per request.
    requests_per_s_range: tuple[float, float] = (0.0, 0.0)
    cpu_us_per_request_range: tuple[float, float] | None = None
    #: CPU per request in each round, in round order (paired with other targets' rounds).
    cpu_us_per_request_rounds: list[float | None] = field(default_factory=list)


@dataclass(slots=True)
class TargetSummary:
    """Per target: saturation throughput (the most requests/s any closed-loop concurrency
    got, median over rounds) and the router's CPU per request there; latency and CPU per
    request at the fixed offered rate (where a router's idle work, health checks and
    scrapes, weighs more per request)."""

    target: str
    saturation_per_s: float
    saturated_cpu_us_per_request: float | None
    router_cpu_us_per_request: float | None
    offered_per_s: float
    rate_p50_ms: float
    rate_p99_ms: float
    errors: int
    saturated_cpu_range: tuple[float, float] | None = None
    rate_cpu_range: tuple[float, float] | None = None


def _median(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _spread(values: Sequence[float | None]) -> tuple[float, float] | None:
    present = [value for value in values if value is not None]
    return (min(present), max(present)) if present else None


def _row(target: str, mode: str, load: float, measured: list[LoadRun], direct: list[LoadRun]) -> OverheadRow:
    p50 = _median([percentile(run.latencies_s, 50) for run in measured]) or 0.0
    p99 = _median([percentile(run.latencies_s, 99) for run in measured]) or 0.0
    direct_p50 = _median([percentile(run.latencies_s, 50) for run in direct])
    direct_p99 = _median([percentile(run.latencies_s, 99) for run in direct])
    is_router = target != DIRECT
    rates = [run.requests / run.seconds for run in measured]
    cpus = [run.cpu_us_per_request for run in measured]
    return OverheadRow(
        target=target,
        mode=mode,
        concurrency=int(load) if mode == "closed" else None,
        offered_per_s=float(load) if mode == "rate" else None,
        requests_per_s=_median(rates) or 0.0,
        latency_p50_ms=p50 * 1000,
        latency_p99_ms=p99 * 1000,
        added_p50_ms=(p50 - direct_p50) * 1000 if is_router and direct_p50 is not None else None,
        added_p99_ms=(p99 - direct_p99) * 1000 if is_router and direct_p99 is not None else None,
        router_cpu_us_per_request=_median(cpus),
        errors=sum(run.errors for run in measured),
        requests_per_s_range=_spread(rates) or (0.0, 0.0),
        cpu_us_per_request_range=_spread(cpus),
        cpu_us_per_request_rounds=cpus,
    )


RunKey = tuple[str, str, float]  # target, mode, concurrency or offered rate


def summarize(runs: dict[RunKey, list[LoadRun]]) -> list[OverheadRow]:
    return [
        _row(target, mode, load, measured, runs.get((DIRECT, mode, load), []))
        for (target, mode, load), measured in runs.items()
    ]


def target_summaries(rows: Sequence[OverheadRow]) -> list[TargetSummary]:
    summaries = []
    for row in rows:
        if row.mode != "rate":
            continue
        closed = [other for other in rows if other.target == row.target and other.mode == "closed"]
        busiest = max(closed, key=lambda other: other.requests_per_s, default=None)
        summaries.append(
            TargetSummary(
                target=row.target,
                saturation_per_s=busiest.requests_per_s if busiest else 0.0,
                saturated_cpu_us_per_request=busiest.router_cpu_us_per_request if busiest else None,
                router_cpu_us_per_request=row.router_cpu_us_per_request,
                offered_per_s=row.offered_per_s or 0.0,
                rate_p50_ms=row.latency_p50_ms,
                rate_p99_ms=row.latency_p99_ms,
                errors=row.errors,
                saturated_cpu_range=busiest.cpu_us_per_request_range if busiest else None,
                rate_cpu_range=row.cpu_us_per_request_range,
            )
        )
    return summaries


def _table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    table = [tuple(header), *map(tuple, lines)]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread_cell(value: float | None, spread: tuple[float, float] | None) -> str:
    """``median (min-max)`` over rounds."""
    if value is None:
        return "-"
    return f"{value:.0f}" if spread is None else f"{value:.0f} ({spread[0]:.0f}-{spread[1]:.0f})"


@dataclass(slots=True)
class BaselinePair:
    """A target against its ``@baseline`` under one load: CPU per request, round by round.

    The two run one right after the other in every round, so their ratio cancels most of
    a shared machine's drift between rounds, which spreads each target's own CPU per
    request by up to 2x; the ratio's median and spread resolve far smaller differences.
    """

    target: str
    mode: str
    load: float
    ratios: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)


def baseline_pairs(rows: Sequence[OverheadRow]) -> list[BaselinePair]:
    """Every target measured against a ``@baseline`` twin: its per-round CPU ratios."""
    by_key = {(row.target, row.mode, row.concurrency or row.offered_per_s): row for row in rows}
    pairs = []
    for (target, mode, load), row in by_key.items():
        twin = by_key.get((f"{target}@baseline", mode, load))
        if twin is None or load is None:
            continue
        ratios = [
            ours / theirs
            for ours, theirs in zip(row.cpu_us_per_request_rounds, twin.cpu_us_per_request_rounds, strict=False)
            if ours is not None and theirs
        ]
        if ratios:
            pairs.append(BaselinePair(target, mode, float(load), ratios))
    return pairs


def format_rows(rows: Sequence[OverheadRow]) -> str:
    """The summary per target, every closed-loop run, then each target against its baseline."""
    summaries = target_summaries(rows)
    parts = []
    if summaries:
        rate = summaries[0].offered_per_s
        parts.append(
            _table(
                (
                    "target",
                    "saturation req/s",
                    "CPU us/req saturated",
                    f"CPU us/req @{rate:.0f}/s",
                    f"p50 ms @{rate:.0f}/s",
                    f"p99 ms @{rate:.0f}/s",
                    "errors",
                ),
                [
                    (
                        s.target,
                        f"{s.saturation_per_s:.0f}",
                        _spread_cell(s.saturated_cpu_us_per_request, s.saturated_cpu_range),
                        _spread_cell(s.router_cpu_us_per_request, s.rate_cpu_range),
                        f"{s.rate_p50_ms:.2f}",
                        f"{s.rate_p99_ms:.2f}",
                        str(s.errors),
                    )
                    for s in summaries
                ],
            )
        )
    closed = sorted(
        (row for row in rows if row.mode == "closed"), key=lambda row: (row.concurrency or 0, row.target != DIRECT)
    )
    parts.append(
        _table(
            ("target", "conc", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "router CPU us/req", "errors"),
            [
                (
                    row.target,
                    str(row.concurrency),
                    f"{row.requests_per_s:.0f}",
                    f"{row.latency_p50_ms:.2f}",
                    f"{row.latency_p99_ms:.2f}",
                    _cell(row.added_p50_ms, ".2f"),
                    _cell(row.added_p99_ms, ".2f"),
                    _cell(row.router_cpu_us_per_request, ".0f"),
                    str(row.errors),
                )
                for row in closed
            ],
        )
    )
    pairs = baseline_pairs(rows)
    if pairs:
        parts.append(
            _table(
                ("target / @baseline", "load", "CPU ratio, median (min-max) over rounds", "rounds"),
                [
                    (
                        pair.target,
                        f"c={pair.load:.0f}" if pair.mode == "closed" else f"@{pair.load:.0f}/s",
                        f"{pair.median:.3f} ({min(pair.ratios):.3f}-{max(pair.ratios):.3f})",
                        str(len(pair.ratios)),
                    )
                    for pair in pairs
                ],
            )
        )
    return "\n\n".join(parts)


@dataclass(slots=True)
class Target:
    name: str
    url: str
    pgid: int | None


def baseline_env(tree: Path) -> dict[str, str]:
    """The environment that runs ``python -m kvroute.router.cli`` from ``tree``.

    This checkout is installed as ``kvroute.*`` through a package-dir mapping, which would
    win over ``tree``; a ``kvroute/`` directory of symlinks to ``tree``'s folders on
    ``PYTHONPATH`` comes first instead. ``tree`` itself follows it, for checkouts from before
    the namespace whose modules import ``router.*``. ``PYTHONSAFEPATH``: ``-m`` would put the
    working directory (this checkout) before both."""
    tree = tree.resolve()
    layout = Path(tempfile.mkdtemp(prefix="kvroute-baseline-"))
    atexit.register(shutil.rmtree, layout, ignore_errors=True)
    (layout / "kvroute").mkdir()
    for folder in ("router", "tokenizer_index", "benchmarks"):
        (layout / "kvroute" / folder).symlink_to(tree / folder)
    return {"PYTHONPATH": f"{layout}{os.pathsep}{tree}", "PYTHONSAFEPATH": "1"}


def offered_rate(runs: dict[RunKey, list[LoadRun]], fraction: float) -> float:
    """``fraction`` of the slowest router's saturation throughput (of direct's without routers)."""
    saturation: dict[str, float] = {}
    for (target, mode, _), measured in runs.items():
        if mode == "closed":
            rate = _median([run.requests / run.seconds for run in measured]) or 0.0
            saturation[target] = max(saturation.get(target, 0.0), rate)
    routers = [rate for target, rate in saturation.items() if target != DIRECT]
    return max(1.0, fraction * min(routers or saturation.values()))


async def measure(
    targets: Sequence[Target],
    bodies: Sequence[bytes],
    concurrencies: Sequence[int],
    seconds: float,
    rounds: int,
    rate_fraction: float,
    new_words: int = 0,
) -> list[OverheadRow]:
    """Closed loops at each concurrency, then the fixed rate, every target in each round
    (after the warm-up, with ``new_words`` new words in every request's user turn)."""
    runs: dict[RunKey, list[LoadRun]] = {}
    for target in targets:  # every body once: measured from then on is the routers' steady state
        await closed_loop(target.url, bodies, 32, 0.0, None, requests=len(bodies))
    # One source for every target and round: no text is ever sent twice.
    sent: BodySource = NewWords(bodies, new_words) if new_words else bodies
    progress = Progress(rounds * (len(concurrencies) + 1) * len(targets), "overhead runs")
    for _ in range(rounds):
        for concurrency in concurrencies:
            for target in targets:
                run = await closed_loop(target.url, sent, concurrency, seconds, target.pgid)
                runs.setdefault((target.name, "closed", concurrency), []).append(run)
                progress.advance(run.errors == 0)
    rate = offered_rate(runs, rate_fraction)
    for _ in range(rounds):
        for target in targets:
            run = await fixed_rate(target.url, sent, rate, seconds, target.pgid)
            runs.setdefault((target.name, "rate", rate), []).append(run)
            progress.advance(run.errors == 0)
    progress.close()
    return summarize(runs)


async def run_overhead(
    policies: Sequence[str],
    peers: Sequence[str],
    concurrencies: Sequence[int],
    seconds: float,
    rounds: int,
    body_bytes: int,
    *,
    workers: Sequence[int] = (1,),
    backends: int = 2,
    rate_fraction: float = 0.5,
    baseline: Path | None = None,
    peer_policies: Sequence[str] = ("cache_aware",),
    new_words: int = 0,
    body_kind: str = "chat",
) -> list[OverheadRow]:
    """Start the upstreams and every router, then measure them round by round.

    ``baseline``: another kvroute source tree (e.g. the commit before a change); each
    policy is also served from it (target ``POLICY@baseline``), measured in the same rounds.
    ``body_kind``: ``chat`` (:func:`chat_bodies` of ``body_bytes``) or ``agent``
    (:func:`agent_bodies`).
    """
    bodies = bodies_of(body_kind, body_bytes)
    upstreams = [start_upstream() for _ in range(backends)]
    fronts: dict[str, ManagedProcess | fleets.PeerRouter] = {}
    urls = [upstream.url for upstream in upstreams]
    baseline_environment = baseline_env(baseline) if baseline is not None else None
    try:
        await asyncio.gather(*(upstream.wait_ready() for upstream in upstreams))
        for policy in policies:
            for count in workers:
                name = policy if count == 1 else f"{policy} x{count}"
                extra = () if count == 1 else ("--workers", str(count))
                fronts[name] = await fleets.start_router(policy, urls, extra_args=extra)
                if baseline_environment is not None:
                    fronts[f"{name}@baseline"] = await fleets.start_router(
                        policy, urls, extra_args=extra, env=baseline_environment
                    )
        for peer in peers:
            for peer_policy in peer_policies:
                name = f"peer:{peer}" if peer_policy == "cache_aware" else f"peer:{peer}:{peer_policy}"
                fronts[name] = await fleets.start_peer(peer, urls, peer_policy)
        targets = [Target(DIRECT, urls[0], None)]
        for name, front in fronts.items():
            process = front.process if isinstance(front, fleets.PeerRouter) else front
            targets.append(Target(name, front.url, process.pid))
        return await measure(targets, bodies, concurrencies, seconds, rounds, rate_fraction, new_words)
    finally:
        for front in fronts.values():
            front.stop()
        for upstream in upstreams:
            upstream.stop()


def _csv(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _serve_has_workers() -> bool:
    from kvroute.router.serve import build_parser as serve_parser

    return any("--workers" in action.option_strings for action in serve_parser()._actions)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvroute bench --overhead",
        description="Router overhead: direct vs each kvroute policy vs each installed peer "
        "router, ~2 KB chat requests (64 system prompts) against trivial upstreams: CPU per "
        "request, saturation throughput, latency at a fixed offered rate.",
    )
    parser.add_argument("--policies", default=",".join(POLICY_NAMES))
    parser.add_argument(
        "--peers", default="installed", help=f"'installed' (default), 'none', or a comma list of {', '.join(PEERS)}"
    )
    parser.add_argument(
        "--peer", action="append", choices=PEERS, help="measure this peer router (repeatable; overrides --peers)"
    )
    parser.add_argument(
        "--peer-policies",
        default="cache_aware",
        help="comma list of the peers' policies, each a target (e.g. cache_aware,round_robin)",
    )
    parser.add_argument("--workers", default="1", help="comma list of kvroute serve --workers counts, each a target")
    parser.add_argument("--backends", type=int, default=2, help="trivial upstreams")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also serve each policy from this kvroute source tree (e.g. "
        "'git worktree add DIR HEAD~1'), as POLICY@baseline in the same rounds",
    )
    parser.add_argument(
        "--rate-fraction",
        type=float,
        default=0.5,
        help="the fixed offered rate, as a fraction of the slowest router's saturation throughput",
    )
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--seconds", type=float, default=3.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--body-bytes", type=int, default=2048, help="chat bodies' size")
    parser.add_argument(
        "--bodies",
        choices=BODY_KINDS,
        default="chat",
        help="chat: ~2 KB chats over 64 system prompts; agent: conversations of 4-14 messages "
        "with tool calls and tool results over 64 system prompts; agent-tools: those offering 8 tools",
    )
    parser.add_argument(
        "--new-words",
        type=int,
        default=0,
        metavar="N",
        help="add N words and a number no request had before to every measured request's user "
        "turn (new text, as real traffic brings; default 0: the 1,024 bodies repeat, all cached)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/overhead.json"))
    parser.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    """``kvroute bench --overhead`` (the flag itself is removed by :func:`kvroute.benchmarks.bench.main`)."""
    args = build_parser().parse_args(argv)
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return 0
    policies = _csv(args.policies)
    unknown = [policy for policy in policies if policy not in POLICY_NAMES]
    if unknown:
        print(f"kvroute bench --overhead: unknown policies {unknown}", file=sys.stderr)
        return 2
    workers = [int(value) for value in _csv(args.workers)]
    if any(count != 1 for count in workers) and not _serve_has_workers():
        print("kvroute bench --overhead: this kvroute serve has no --workers", file=sys.stderr)
        return 2
    if args.peer:
        peers = list(args.peer)
    elif args.peers == "installed":
        peers = [peer for peer in PEERS if fleets.peer_installed(peer)]
    elif args.peers == "none":
        peers = []
    else:
        peers = _csv(args.peers)
    for peer in PEERS:
        if not fleets.peer_installed(peer):
            print(f"kvroute bench --overhead: {peer} not installed (pip install {peer})", file=sys.stderr)
    peers = [peer for peer in peers if fleets.peer_installed(peer)]
    concurrencies = [int(value) for value in _csv(args.concurrency)]

    async def run() -> int:
        rows = await run_overhead(
            policies,
            peers,
            concurrencies,
            args.seconds,
            args.rounds,
            args.body_bytes,
            workers=workers,
            backends=args.backends,
            rate_fraction=args.rate_fraction,
            baseline=args.baseline,
            peer_policies=_csv(args.peer_policies),
            new_words=args.new_words,
            body_kind=args.bodies,
        )
        print(format_rows(rows))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0

    return fleets.run_stoppable(run())
