"""Long prompts: a 100K-token agent turn on a 1M-block index, and what a 1M-token prompt stalls.

    python -m kvroute.benchmarks.bench_long_prompts [--prompt-tokens 100000] [--new-tokens 500,2000,8000]
        [--index-blocks 1000000] [--repeats 15] [--text ascii|typographic] [--huge-tokens 1000000]
        [--huge-prompts 2] [--out bench-out/long-prompts.json]

**The agent turn** (issue 16: <= 5 ms, and <= 5 % of a cold tokenization). An agent
conversation (a system prompt, tools, a task, then turns of an assistant's tool call and the
tool's result of ``--new-tokens`` tokens) grows to ``--prompt-tokens``. Every turn it had was
routed, so the tokenizer's piece cache and the prefix index hold its previous prompt; the
index holds ``--index-blocks`` blocks over 16 backends, each filled to its capacity with
conversations behind shared system prompts, so every insert evicts. Each repetition appends
a possible next turn (each repetition another one: the prompt stays ~100K tokens) and
routes it with the calls the routing engine makes (``RoutingEngine.prepare``, then
``route``), one stage at a time: render the chat template (``render_chat``), tokenize the
text (``encode_rendered_chat_array``: with ``render_chat``, what ``encode_chat_array`` does),
hash the blocks, match, insert (wall time and the process's CPU time). Beside it:

* ``cold``: the same turn on a tokenizer whose caches were just emptied (render and
  tokenize every piece): the denominator of the 5 % target;
* ``whole``: the plain ``tokenizers`` library on the rendered text, the reference the
  router's ids must equal (checked every repetition);
* ``engine``: the whole ``RoutingEngine.route`` (``cache_aware``) of the same turn on its own
  index of the same size (filled through ``apply_placement``): prepare, match, the policy,
  insert and the conversation ledger.

**The 1M-token prompt** (it must not stall other requests). In one asyncio loop, ~2 KB chats
arrive at ``--small-rate`` per second and are parsed and routed on the loop, as the proxy
routes them; then ``--huge-prompts`` chats, each a fresh ``--huge-tokens`` document, arrive one
after another. Each way of routing them (``--modes``) runs on its own engine, whose index
holds ``--stall-index-blocks`` blocks over 4 backends at their capacity (the huge prompt's
insert evicts as many); with ``--precise`` the backends stream KV events, so each prompt also
goes to the precise index's speculative layer (empty at the start, unbounded):

* ``sync``: parse and route on the loop;
* ``thread``: the proxy's way for bodies of ``THREAD_PREPARE_BYTES`` or more: parse on the
  loop, ``RoutingEngine.prepare`` in a worker thread, the rest of ``route`` on the loop, its
  index insert a slice per loop turn (``route(sliced=True)``, then ``learn_slice``);
* ``thread-1ms``: the same with the interpreter's switch interval at 1 ms instead of 5 (how
  long the loop's thread may wait for the GIL while the worker runs Python code).

Reported: the loop's worst stall (how late a 1 ms ticker ran), the small chats' latency from
their due time (p50, p99, max) before and while huge prompts arrive, and each huge prompt's
routing time.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from tokenizers import AddedToken, Tokenizer

from kvroute.benchmarks.overhead import chat_bodies
from kvroute.benchmarks.results import machine, percentile
from kvroute.benchmarks.workloads import AGENT_TOOLS, words
from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.forwarding.proxy import THREAD_PREPARE_BYTES
from kvroute.router.routing.kv_events import BlockStored, KVEventsState
from kvroute.router.routing.peer_exchange import Placement
from kvroute.router.routing.precise_index import PreciseIndex
from kvroute.router.routing.request_info import ENDPOINTS, parse_request
from kvroute.router.routing.routing_engine import RoutingEngine
from kvroute.tokenizer_index import PrefixIndex, RequestTokenizer
from kvroute.tokenizer_index.hashing import block_hashes, request_salt

CHAT = next(endpoint for endpoint in ENDPOINTS if endpoint.path == "/v1/chat/completions")
MODEL = "agent"
BLOCK_SIZE = 16
BACKENDS = 16
#: Backends of the 1M-token stall runs (their index is filled as the agent turn's is).
STALL_BACKENDS = 4
#: Chat templates for ``--chat-template`` (the tokenizer's own is ChatML).
TEMPLATES = Path(__file__).parent / "templates"
LLAMA3_ADDED_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
#: The fill's prompts: random token ids behind a few shared system prompts.
FILL_VOCAB = 8_000
FILL_SYSTEM_PROMPTS = 4
FILL_SYSTEM_TOKENS = 1_024
FILL_TURN_TOKENS = (1_024, 8_192)
AGENT_SYSTEM_TOKENS = 2_000
AGENT_TASK_TOKENS = 200
#: The assistant's text before its tool call, each turn.
ASSISTANT_TOKENS = 60
SESSION_HEADER = "x-session-id"
TARGET_MS = 5.0
TARGET_COLD_SHARE = 0.05
#: A stall of the event loop longer than this is worth a design change (the lead's bar).
STALL_BAR_MS = 50.0
STAGES = ("render", "tokenize", "hash", "match", "insert")
MODES = ("sync", "thread", "thread-1ms")
SHORT_SWITCH_INTERVAL_S = 0.001


# --- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spread:
    """Median and range of one measurement over the repetitions (milliseconds)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(round(statistics.median(values), 3), round(min(values), 3), round(max(values), 3))

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f})"


@dataclass
class Samples:
    """Wall and CPU milliseconds of named steps, one sample per repetition.

    CPU is the whole process's (the tokenizer encodes batches on its own threads).
    """

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def time(self, name: str, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        cpu, wall = time.process_time_ns(), time.perf_counter_ns()
        result = step(*args, **kwargs)
        self.add(name, (time.perf_counter_ns() - wall) / 1e6, (time.process_time_ns() - cpu) / 1e6)
        return result

    def add(self, name: str, wall_ms: float, cpu_ms: float) -> None:
        self.wall.setdefault(name, []).append(wall_ms)
        self.cpu.setdefault(name, []).append(cpu_ms)

    def spread(self, name: str, *, cpu: bool = False) -> Spread:
        return Spread.of((self.cpu if cpu else self.wall)[name])


# --- the agent conversation and the index ---------------------------------------------------------


#: What one turn adds: an assistant's tool call and the tool's result (``agent``), or an
#: assistant's answer and the user's next question (``chat``: under Qwen 3's template a new
#: query every turn, which its incremental render cannot reuse across).
TURN_SHAPES = ("agent", "chat")
#: The turns' text: the vocabulary's ASCII words, or the same typeset as models and web
#: pages write (curly quotes and apostrophes, dashes, ellipses: a character beyond ASCII
#: every few words, so new text takes the word cutter's path for such text).
TEXT_STYLES = ("ascii", "typographic")
_TYPOGRAPHY = ("\u2019s", " \u2014", "\u201d", " \u201c", "\u2026", " \u2013")


def typeset(text: str, rng: np.random.Generator) -> str:
    """``text`` with a typographic mark after about one word in eight."""
    words_ = text.split(" ")
    marks = rng.integers(0, len(_TYPOGRAPHY), size=len(words_)).tolist()
    picks = rng.integers(0, 8, size=len(words_)).tolist()
    return " ".join(
        word + _TYPOGRAPHY[mark] if pick == 0 else word for word, mark, pick in zip(words_, marks, picks, strict=True)
    )


class AgentConversation:
    """An agent's messages: system prompt, task, then (tool call, tool result) turns, or
    (answer, question) turns for a chat."""

    def __init__(self, seed: int, result_tokens: int, shape: str = "agent", text: str = "ascii") -> None:
        self._rng = np.random.default_rng(seed)
        self.result_tokens = result_tokens
        self.shape = shape
        self.text = text
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.words(self._rng, AGENT_SYSTEM_TOKENS)},
            {"role": "user", "content": "Task: " + self.words(self._rng, AGENT_TASK_TOKENS)},
        ]

    def words(self, rng: np.random.Generator, tokens: int) -> str:
        """About ``tokens`` tokens of text in the conversation's style (``TEXT_STYLES``)."""
        text = words(rng, tokens)
        return typeset(text, rng) if self.text == "typographic" else text

    def add_turn(self) -> None:
        """The assistant calls a tool (its answer to the last prompt) and the tool answers."""
        self.messages += self.turn(self._rng, len(self.messages))

    def turn(self, rng: np.random.Generator, number: int) -> list[dict[str, Any]]:
        """The messages of one turn: the assistant's text and tool call, the tool's result
        (or, for a chat, the assistant's text and the user's next question)."""
        if self.shape == "chat":
            return [
                {"role": "assistant", "content": self.words(rng, ASSISTANT_TOKENS)},
                {"role": "user", "content": self.words(rng, self.result_tokens)},
            ]
        function = AGENT_TOOLS[int(rng.integers(len(AGENT_TOOLS)))]["function"]
        argument = function["parameters"]["required"][0]
        call_id = f"call-{number}"
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": function["name"], "arguments": json.dumps({argument: words(rng, 8)})},
        }
        return [
            {"role": "assistant", "content": self.words(rng, ASSISTANT_TOKENS), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": self.words(rng, self.result_tokens)},
        ]

    def body(self, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The request the agent sends (a JSON round trip: fresh objects, as parsed)."""
        request = {
            "model": MODEL,
            "messages": self.messages if messages is None else messages,
            "tools": list(AGENT_TOOLS),
            "max_tokens": 400,
        }
        return orjson.loads(orjson.dumps(request))  # type: ignore[no-any-return]

    def next_turn_body(self, seed: int) -> dict[str, Any]:
        """The next turn's request, one of many possible (the conversation itself stays)."""
        return self.body(self.messages + self.turn(np.random.default_rng([seed, 7]), len(self.messages)))


def fill_prompts(
    rng: np.random.Generator, names: list[str], held: Callable[[str], int], capacity: int
) -> Iterator[tuple[str, np.ndarray]]:
    """(backend, token ids) to insert until every backend holds ``capacity`` blocks:
    conversations of 1-8K random tokens, round robin, behind shared system prompts."""
    systems = [rng.integers(0, FILL_VOCAB, FILL_SYSTEM_TOKENS, dtype=np.int64) for _ in range(FILL_SYSTEM_PROMPTS)]
    while min(held(name) for name in names) < capacity:
        for name in names:
            system = systems[int(rng.integers(FILL_SYSTEM_PROMPTS))]
            turn = rng.integers(0, FILL_VOCAB, int(rng.integers(*FILL_TURN_TOKENS)), dtype=np.int64)
            yield name, np.concatenate((system, turn))


def stream_events(precise: PreciseIndex, names: list[str]) -> None:
    """The backends ``names`` stream KV events into ``precise`` from now on (applied by hand:
    no subscription), their block size learned from a first event. The exact layer holds
    that one block per backend; routing inserts each prompt into the speculative layer."""
    for name in names:
        precise.add_backend(name)
        precise.set_state(name, KVEventsState.PRECISE)
        first = BlockStored(
            block_hashes=[1],
            parent_block_hash=None,
            token_ids=list(range(BLOCK_SIZE)),
            block_size=BLOCK_SIZE,
            medium="GPU",
            lora_name=None,
            extra_keys=None,
        )
        precise.apply_events(name, [first])


def filled_engine(
    path: Path, names: list[str], index_blocks: int, seed: int, *, precise: bool = False
) -> tuple[RoutingEngine, list[Backend]]:
    """A cache-aware routing engine whose index holds ``index_blocks`` blocks over the
    backends ``names``, each at its capacity (so every insert evicts, as in a router that
    has run a while), and those backends as candidates; none, unbounded, for 0.
    ``precise``: the backends then stream KV events (:func:`stream_events`)."""
    settings = Settings(policy="cache_aware", block_size=BLOCK_SIZE, tokenizer=str(path))
    events = PreciseIndex() if precise else None
    engine = RoutingEngine(settings, precise=events)
    candidates = [Backend(name) for name in names]
    if index_blocks > 0:
        capacity = index_blocks // len(names)
        salt = request_salt(MODEL)
        candidates = [Backend(name, capacity_tokens=capacity * BLOCK_SIZE) for name in names]
        # A first request bounds each candidate's index at its capacity (unknown ones hold less).
        hello = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
        engine.route(CHAT.path, hello, {}, candidates)
        # Before the backends stream events: until then index_tokens reads the approximate index.
        for name, tokens in fill_prompts(
            np.random.default_rng(seed), names, lambda url: engine.index_tokens(url) // BLOCK_SIZE, capacity
        ):
            placement = Placement(name, BLOCK_SIZE, block_hashes(tokens, BLOCK_SIZE, salt), len(tokens))
            engine.apply_placement(placement)
    if events is not None:
        stream_events(events, names)
    return engine, candidates


# --- part 1: the agent turn -----------------------------------------------------------------------


@dataclass(frozen=True)
class TurnResult:
    """One new-turn size: medians and ranges over the repetitions (ms)."""

    result_tokens: int
    prompt_tokens: int
    messages: int
    new_tokens: int
    matched_tokens: int
    stages: dict[str, Spread]
    stages_cpu: dict[str, Spread]
    total: Spread
    total_cpu: Spread
    engine: Spread
    cold: Spread
    whole: Spread
    total_vs_cold: float
    exact: bool
    text: str = "ascii"


def measure_turns(
    path: Path,
    result_tokens: int,
    prompt_tokens: int,
    index_blocks: int,
    repeats: int,
    seed: int,
    shape: str = "agent",
    *,
    chunk_chars: int | None = None,
    style: str = "ascii",
) -> TurnResult:
    names = [f"http://10.0.0.{number + 1}:8000" for number in range(BACKENDS)]
    capacity = index_blocks // BACKENDS
    salt = request_salt(MODEL)
    index = PrefixIndex(block_size=BLOCK_SIZE, capacity_blocks=capacity)
    for name, tokens in fill_prompts(np.random.default_rng(seed), names, index.blocks, capacity):
        index.insert_hashes(name, block_hashes(tokens, BLOCK_SIZE, salt))
    engine, candidates = filled_engine(path, names, index_blocks, seed)

    # (chunk_chars only where given: a baseline tree run by this script may not know it.)
    options = {} if chunk_chars is None else {"chunk_chars": chunk_chars}
    tokenizer = RequestTokenizer.from_pretrained(path, **options)
    cold = RequestTokenizer.from_pretrained(path, **options)
    # Run on a tree from before encode_rendered_chat_array (a baseline), encode_chat_array then
    # went on with encode_text_array after rendering.
    tokenize_rendered = getattr(tokenizer, "encode_rendered_chat_array", None) or (
        lambda text, _messages: tokenizer.encode_text_array(text)
    )
    backend = names[0]

    def route_here(body: dict[str, Any]) -> np.ndarray:
        """The conversation's turn as this router sees it: the ids, then the index learns them."""
        ids = tokenizer.encode_chat_array(body["messages"], tools=body["tools"])
        index.insert_hashes(backend, block_hashes(ids, BLOCK_SIZE, salt))
        engine.route(CHAT.path, body, {}, candidates)
        return ids

    agent = AgentConversation(seed, result_tokens, shape, style)
    ids = route_here(agent.body())
    turn_tokens = len(route_here(agent.next_turn_body(seed))) - len(ids)
    while len(ids) + turn_tokens < prompt_tokens:  # every earlier turn was routed
        agent.add_turn()
        ids = route_here(agent.body())

    # Each repetition is one possible next turn of the same conversation, so every one
    # repeats the same prompt and adds a turn that nothing holds yet.
    samples = Samples()
    matched, new_tokens, exact = [], [], True
    for repetition in range(repeats):
        body = agent.next_turn_body(seed + 1 + repetition)
        messages, tools = body["messages"], body["tools"]
        text = samples.time("render", tokenizer.render_chat, messages, tools=tools)
        turn_ids = samples.time("tokenize", tokenize_rendered, text, messages)
        hashes = samples.time("hash", block_hashes, turn_ids, BLOCK_SIZE, salt)
        found = samples.time("match", index.match_hashes, hashes)
        samples.time("insert", index.insert_hashes, backend, hashes)
        samples.time("engine", engine.route, CHAT.path, orjson.loads(orjson.dumps(body)), {}, candidates)
        cold.clear_cache()
        cold_ids = samples.time("cold", cold.encode_chat_array, messages, tools=tools)
        [encoding] = samples.time("whole", tokenizer.backend.encode_batch_fast, [text], add_special_tokens=False)
        exact = exact and turn_ids.tolist() == encoding.ids and np.array_equal(cold_ids, turn_ids)
        matched.append(found.get(backend, 0))
        new_tokens.append(len(turn_ids) - len(ids))
    for clock in (samples.wall, samples.cpu):
        clock["total"] = [sum(values) for values in zip(*(clock[stage] for stage in STAGES))]
    total, cold_time = samples.spread("total"), samples.spread("cold")
    return TurnResult(
        result_tokens=result_tokens,
        prompt_tokens=len(turn_ids),
        messages=len(messages),
        new_tokens=int(statistics.median(new_tokens)),
        matched_tokens=int(statistics.median(matched)),
        stages={stage: samples.spread(stage) for stage in STAGES},
        stages_cpu={stage: samples.spread(stage, cpu=True) for stage in STAGES},
        total=total,
        total_cpu=samples.spread("total", cpu=True),
        engine=samples.spread("engine"),
        cold=cold_time,
        whole=samples.spread("whole"),
        total_vs_cold=round(total.median / cold_time.median, 4),
        exact=exact,
        text=style,
    )


# --- part 2: the 1M-token prompt --------------------------------------------------------------------


@dataclass(frozen=True)
class StallResult:
    """One way of routing huge prompts: the loop's stalls and the small chats' latency (ms)."""

    mode: str
    huge_tokens: int
    huge_route_ms: list[float]
    #: Of each huge prompt's routing, the time spent on the event loop itself.
    huge_loop_ms: list[float]
    worst_stall_ms: float
    small_requests: int
    small_before: Spread
    small_before_p99: float
    small_during: Spread
    small_during_p99: float


class _Ticker:
    """A 1 ms timer on the loop; its lateness is how long the loop could not run anything."""

    def __init__(self) -> None:
        self.worst_ms = 0.0
        self._running = True

    async def run(self) -> None:
        last = time.perf_counter()
        while self._running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst_ms = max(self.worst_ms, (now - last - 0.001) * 1000)
            last = now

    def stop(self) -> None:
        self._running = False


def huge_body(tokens: int, seed: int, model: str = MODEL) -> bytes:
    """A chat carrying a fresh document of about ``tokens`` tokens (nothing of it cached)."""
    document = words(np.random.default_rng([seed, 1_000_003]), tokens)
    messages = [
        {"role": "system", "content": "You answer questions about the document."},
        {"role": "user", "content": f"Document:\n{document}\n\nWhat is it about?"},
    ]
    return orjson.dumps({"model": model, "messages": messages, "max_tokens": 200})


async def _stall_run(
    mode: str,
    huge: list[bytes],
    small: list[bytes],
    rate: float,
    quiet_s: float,
    filled: tuple[RoutingEngine, list[Backend]],
) -> StallResult:
    engine, candidates = filled
    # A tree from before sliced inserts (a baseline) inserts a prompt's blocks in route().
    sliced = {"sliced": True} if hasattr(engine, "learn_slice") else {}

    def route(raw: bytes, *, prepared: Any = None) -> None:
        parsed = parse_request(raw, CHAT, {}, SESSION_HEADER)
        if prepared is None and len(raw) < THREAD_PREPARE_BYTES:
            prepared = engine.prepare(CHAT.path, parsed.body)
        plan = engine.route(CHAT.path, parsed.body, {}, candidates, prepared=prepared, parsed=parsed)
        engine.observe(plan, None)

    for raw in small:  # the small chats' steady state: pieces and blocks seen before
        route(raw)
    ticker = _Ticker()
    ticking = asyncio.create_task(ticker.run())
    latencies: dict[str, list[float]] = {"before": [], "during": []}
    phase = "before"
    started = time.perf_counter()
    stopping = False

    async def small_chats() -> None:
        sent = 0
        while not stopping:
            due = started + sent / rate
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            route(small[sent % len(small)])
            latencies[phase].append((time.perf_counter() - due) * 1000)
            sent += 1
            if sent % 8 == 0:
                await asyncio.sleep(0)  # let the ticker in when catching up on overdue chats

    sending = asyncio.create_task(small_chats())
    await asyncio.sleep(quiet_s)
    phase = "during"
    route_ms, loop_ms = [], []
    for raw in huge:
        begin = time.perf_counter()
        if mode.startswith("thread") and len(raw) >= THREAD_PREPARE_BYTES:
            parsed = parse_request(raw, CHAT, {}, SESSION_HEADER)
            on_loop = time.perf_counter() - begin
            prepared = await asyncio.to_thread(engine.prepare, CHAT.path, parsed.body)
            route_start = time.perf_counter()
            plan = engine.route(CHAT.path, parsed.body, {}, candidates, prepared=prepared, parsed=parsed, **sliced)
            on_loop += time.perf_counter() - route_start
            # As the proxy does: a slice per loop turn (``pending_insert`` in trees before 2026-12-06).
            more = bool(getattr(plan, "pending_inserts", ())) or getattr(plan, "pending_insert", None) is not None
            while more:
                await asyncio.sleep(0)
                slice_start = time.perf_counter()
                more = engine.learn_slice(plan)
                on_loop += time.perf_counter() - slice_start
            engine.observe(plan, None)
            end = time.perf_counter()
        else:
            route(raw)
            end = time.perf_counter()
            on_loop = end - begin
        route_ms.append(round((end - begin) * 1000, 1))
        loop_ms.append(round(on_loop * 1000, 1))
        await asyncio.sleep(quiet_s / 2)
    stopping = True
    await sending
    ticker.stop()
    await ticking
    before, during = latencies["before"], latencies["during"]
    return StallResult(
        mode=mode,
        huge_tokens=0,
        huge_route_ms=route_ms,
        huge_loop_ms=loop_ms,
        worst_stall_ms=round(ticker.worst_ms, 1),
        small_requests=len(before) + len(during),
        small_before=Spread.of(before),
        small_before_p99=round(percentile(before, 99) or 0.0, 3),
        small_during=Spread.of(during),
        small_during_p99=round(percentile(during, 99) or 0.0, 3),
    )


def with_chat_template(tokenizer: Path, template: Path, added_tokens: Sequence[str] = ()) -> Path:
    """A temporary copy of the ``tokenizer`` directory whose chat template is ``template``'s
    text (as ``chat_template.jinja``, which takes precedence over ``tokenizer_config.json``'s),
    with ``added_tokens`` added as special tokens (a model family's tokenizer has the ones
    its template writes; the router cuts prompts into pieces at them)."""
    copy = Path(tempfile.mkdtemp(prefix="kvroute-template-"))
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, copy / name)
    backend = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in added_tokens])
    backend.save(str(copy / "tokenizer.json"))
    (copy / "chat_template.jinja").write_text(template.read_text())
    return copy


def renders_incrementally(tokenizer: Path) -> bool:
    """Whether the tokenizer's chat template (with tools) renders a conversation's new messages only."""
    loaded = RequestTokenizer.from_pretrained(tokenizer)
    return loaded.renders_incrementally(loaded.chat_template(tools=True))


def measure_stalls(
    path: Path,
    modes: list[str],
    huge_tokens: int,
    huge_prompts: int,
    rate: float,
    quiet_s: float,
    seed: int,
    index_blocks: int,
    precise: bool = False,
) -> list[StallResult]:
    small = chat_bodies(per_prompt=4)
    tokenizer = RequestTokenizer.from_pretrained(path)
    first = huge_body(huge_tokens, seed)
    tokens = len(tokenizer.encode_chat_array(orjson.loads(first)["messages"]))
    results = []
    for number, mode in enumerate(modes):
        huge = [huge_body(huge_tokens, seed + 1 + number * huge_prompts + k) for k in range(huge_prompts)]
        default_interval = sys.getswitchinterval()
        sys.setswitchinterval(SHORT_SWITCH_INTERVAL_S if mode.endswith("-1ms") else default_interval)
        try:
            names = [f"http://10.0.1.{number + 1}:8000" for number in range(STALL_BACKENDS)]
            filled = filled_engine(path, names, index_blocks, seed, precise=precise)
            result = asyncio.run(_stall_run(mode, huge, small, rate, quiet_s, filled))
        finally:
            sys.setswitchinterval(default_interval)
        results.append(replace(result, huge_tokens=tokens))
    return results


# --- report -----------------------------------------------------------------------------------------


def format_turns(rows: list[TurnResult]) -> str:
    lines = [
        "agent turn, stage by stage: median wall ms (min-max) over the repetitions",
        f"{'tool result':>11} {'prompt':>8} {'msgs':>5} {'new':>6} | "
        + " ".join(f"{stage:>17}" for stage in STAGES)
        + f" | {'total':>17} {'engine.route':>17} | {'cold':>19} {'whole':>19} {'total/cold':>10}",
    ]
    for row in rows:
        lines.append(
            f"{row.result_tokens:>11,} {row.prompt_tokens:>8,} {row.messages:>5} {row.new_tokens:>6,} | "
            + " ".join(f"{row.stages[stage]!s:>17}" for stage in STAGES)
            + f" | {row.total!s:>17} {row.engine!s:>17} | {row.cold!s:>19} {row.whole!s:>19} {row.total_vs_cold:>10.1%}"
        )
    lines.append(
        "process CPU ms: "
        + "; ".join(
            f"{row.result_tokens:,}: "
            + ", ".join(f"{stage} {row.stages_cpu[stage].median:.2f}" for stage in STAGES)
            + f", total {row.total_cpu.median:.2f}"
            for row in rows
        )
    )
    return "\n".join(lines)


def format_stalls(rows: list[StallResult]) -> str:
    lines = [
        "1M-token prompts among ~2 KB chats: loop stall and small-chat latency from due time (ms)",
        f"{'mode':>7} {'huge tokens':>11} {'huge route ms':>20} {'of it on loop':>16} {'worst stall':>11} "
        f"{'small p50 before':>16} {'p99 before':>10} {'p50 during':>10} {'p99 during':>10} {'max during':>10}",
    ]
    for row in rows:
        lines.append(
            f"{row.mode:>7} {row.huge_tokens:>11,} {'/'.join(map(str, row.huge_route_ms)):>20} "
            f"{'/'.join(map(str, row.huge_loop_ms)):>16} {row.worst_stall_ms:>11.1f} {row.small_before.median:>16.2f} "
            f"{row.small_before_p99:>10.2f} {row.small_during.median:>10.2f} {row.small_during_p99:>10.2f} "
            f"{row.small_during.high:>10.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.benchmarks.bench_long_prompts", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tokenizer", type=Path, default=RequestTokenizer.default_path())
    parser.add_argument(
        "--chat-template",
        type=Path,
        help="render with this Jinja chat template instead of the tokenizer's (e.g. "
        f"{TEMPLATES / 'llama31_style.jinja'}: Llama 3.1's shape, which peels the system message off)",
    )
    parser.add_argument(
        "--added-tokens",
        default="",
        help="comma list of special tokens the template writes, added to the tokenizer with "
        f"--chat-template (for Llama 3.1's shape: {','.join(LLAMA3_ADDED_TOKENS)})",
    )
    parser.add_argument("--prompt-tokens", type=int, default=100_000, help="the agent turn's prompt")
    parser.add_argument("--new-tokens", default="500,2000,8000", help="tool-result sizes per turn, comma-separated")
    parser.add_argument("--index-blocks", type=int, default=1_000_000, help="backend-blocks in the index")
    parser.add_argument("--repeats", type=int, default=15, help="agent turns timed per size")
    parser.add_argument("--turn", choices=TURN_SHAPES, default="agent", help="what each turn adds (see TURN_SHAPES)")
    parser.add_argument("--text", choices=TEXT_STYLES, default="ascii", help="the turns' text (see TEXT_STYLES)")
    parser.add_argument("--huge-tokens", type=int, default=1_000_000, help="0 skips the stall measurement")
    parser.add_argument("--huge-prompts", type=int, default=2, help="huge prompts per mode")
    parser.add_argument(
        "--stall-index-blocks",
        type=int,
        default=1_000_000,
        help="blocks in the stall runs' index (4 backends at capacity); 0: an empty index",
    )
    parser.add_argument(
        "--precise",
        action="store_true",
        help="the stall runs' backends stream KV events: each prompt also goes to the speculative layer",
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"ways to route the huge prompts, of {MODES}")
    parser.add_argument("--small-rate", type=float, default=200.0, help="small chats per second")
    parser.add_argument("--quiet-s", type=float, default=1.0, help="small chats alone before the huge prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chunk-chars", type=int, help="the tokenizer's chunk size for the turns (default: its own choice)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/long-prompts.json"))
    args = parser.parse_args(argv)
    if args.chat_template is not None:
        added = [token for token in args.added_tokens.split(",") if token]
        args.tokenizer = with_chat_template(args.tokenizer, args.chat_template, added)

    turns = [
        measure_turns(
            args.tokenizer,
            int(size),
            args.prompt_tokens,
            args.index_blocks,
            args.repeats,
            args.seed,
            args.turn,
            chunk_chars=args.chunk_chars,
            style=args.text,
        )
        for size in args.new_tokens.split(",")
    ]
    print(format_turns(turns))
    met = [row.total.median <= TARGET_MS and row.total_vs_cold <= TARGET_COLD_SHARE for row in turns]
    print(
        f"targets (<= {TARGET_MS} ms and <= {TARGET_COLD_SHARE:.0%} of cold): "
        + ", ".join(f"{row.result_tokens:,} {'met' if ok else 'NOT met'}" for row, ok in zip(turns, met))
        + f"; ids equal the tokenizers library's: {all(row.exact for row in turns)}"
    )
    stalls: list[StallResult] = []
    if args.huge_tokens:
        stalls = measure_stalls(
            args.tokenizer,
            args.modes.split(","),
            args.huge_tokens,
            args.huge_prompts,
            args.small_rate,
            args.quiet_s,
            args.seed,
            args.stall_index_blocks,
            args.precise,
        )
        print()
        print(format_stalls(stalls))
    print()
    print(machine())
    report = {
        "benchmark": "long_prompts",
        "argv": sys.argv[1:] if argv is None else argv,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "block_size": BLOCK_SIZE,
        "index_blocks": args.index_blocks,
        "stall_index_blocks": args.stall_index_blocks,
        "precise": args.precise,
        "chat_template": str(args.chat_template) if args.chat_template else None,
        "turn": args.turn,
        "text": args.text,
        "renders_incrementally": renders_incrementally(args.tokenizer),
        "backends": BACKENDS,
        "turns": [asdict(row) for row in turns],
        "targets_met": met,
        "stall_bar_ms": STALL_BAR_MS,
        "stalls": [asdict(row) for row in stalls],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(row.exact for row in turns) else 1


if __name__ == "__main__":
    sys.exit(main())
