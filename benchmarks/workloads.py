"""Benchmark workloads: seeded, reproducible streams of OpenAI requests with arrival times.

Every workload is a list of :class:`WorkloadRequest` in arrival order. A request carries the
OpenAI body to send (chat ``messages`` or a completions ``prompt``, plus ``max_tokens``), the
time in seconds at which it may be sent, and the session it belongs to. The replay driver
sends a session's requests in order (a turn waits for the previous turn's answer), so arrival
times are the earliest send times, not a promise.

Text workloads are chat conversations: the chat template puts special tokens between
messages, and BPE never merges across them, so turn N's rendered prompt is a token-exact
prefix of turn N+1's. Message text is random words drawn from a fixed vocabulary with a seed
derived from (workload seed, session), so two sessions share only what the workload means
them to share (a system prompt), and the same seed gives byte-identical requests.

Workloads (``--workload``):

``system-prompt``
    N users (8) share one long system prompt and take several turns each: the case where the
    fleet should compute the system prompt once per replica, not once per request.
``multi-turn``
    Independent chat conversations whose histories grow turn by turn.
``agent-sessions``
    S agent sessions taking turns in lockstep (session 0, 1, ..., S-1, then again), each turn
    appending the assistant's tool call and the tool's result (OpenAI ``tools`` /
    ``tool_calls`` / ``tool`` messages), so histories grow to tens of thousands of tokens. A production
    agent turn is about 88K tokens in and 400 out; ``agent_scale`` scales both. Swept over S
    (``--sessions 4,8,16,32``) past what the fleet's caches hold, it shows the cliff where
    turns go from nearly free to full prefill.

Timing variants (``agent-sessions`` and ``multi-turn``; flags ``--think-time MEAN`` and
``--arrival-rate R``, or per workload as ``agent-sessions:16+think=0.3+rate=0.5``):

think time
    Each turn after the first waits ``think`` seconds after the previous turn's answer,
    drawn from an exponential distribution of mean MEAN with a seed per (seed, session), so
    sessions that start together drift apart the way users and tools do. Think time is
    modelled time like arrival times: the replay divides both by its ``speedup`` (the sims'
    time scale by default), so a think time means the same against sims at 10x as against
    real engines at 1x. Its :attr:`WorkloadRequest.arrival_s` is then the session's start
    plus the think times so far, a lower bound of when the turn really goes out (the
    answers take time), which orders the workload sensibly for offline bounds.
open arrivals
    Sessions start by a Poisson process of R sessions per second (seeded) instead of all at
    once. Every session ends after its turns, so under open arrivals finished sessions'
    blocks stay in the engines' caches as dead weight while new sessions arrive.

Without either, the workloads are exactly as before (same requests, same arrival times).
The message text never depends on the timing: a variant sends the same bodies in another
order.
``prefix-repetition[:P]``
    The shape of vLLM's ``vllm bench serve --dataset-name prefix_repetition``: P (12)
    documents of ~1,024 tokens, each sent 16 times with a different ~64-token question after
    it, in shuffled order, as completions asking for 8 tokens, by a client that keeps at most
    8 requests in flight (:attr:`Workload.max_concurrency`; ``--max-in-flight`` lowers it).
``mooncake:PATH``
    A Mooncake production trace (see :mod:`kvroute.benchmarks.mooncake`), sent as completions with a
    token-id prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvroute.benchmarks import mooncake

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"

#: Words a message is made of. Common English words, so every tokenizer splits them into a
#: token or two; the exact split does not matter, only that it is deterministic.
VOCABULARY: tuple[str, ...] = tuple(
    """the of and to in is it that for you was with on as have be at one this from by hot
    word but what some we can out other were all there when up use your how said an each
    she which do their time if will way about many then them write would like so these her
    long make thing see him two has look more day could go come did number sound no most
    people my over know water than call first who may down side been now find any new work
    part take get place made live where after back little only round man year came show
    every good me give our under name very through just form sentence great think say help
    low line differ turn cause much mean before move right boy old too same tell does set
    three want air well also play small end put home read hand port large spell add even
    land here must big high such follow act why ask men change went light kind off need
    house picture try us again animal point mother world near build self earth father head
    stand own page should country found answer school grow study still learn plant cover
    food sun four between state keep eye never last let thought city tree cross farm hard
    start might story saw far sea draw left late run while press close night real life few
    north open seem together next white children begin got walk example ease paper group
    always music those both mark often letter until mile river car feet care second book
    carry took science eat room friend began idea fish mountain stop once base hear horse
    cut sure watch color face wood main enough plain girl usual young ready above ever red
    list though feel talk bird soon body dog family direct pose leave song measure door
    product black short numeral class wind question happen complete ship area half rock
    order fire south problem piece told knew pass since top whole king space heard best hour
    better true during hundred five remember step early hold west ground interest reach fast
    verb sing listen six table travel less morning ten simple several vowel toward war lay
    against pattern slow center love person money serve appear road map rain rule govern
    pull cold notice voice unit power town fine certain fly fall lead cry dark machine note
    wait plan figure star box noun field rest correct able pound done beauty drive stood
    contain front teach week final gave green quick develop ocean warm free minute strong
    special mind behind clear tail produce fact street inch multiply nothing course stay
    wheel full force blue object decide surface deep moon island foot system busy test
    record boat common gold possible plane stead dry wonder laugh thousand ago ran check
    game shape equate miss brought heat snow tire bring yes distant fill east paint language
    among grand ball yet wave drop heart present heavy dance engine position arm wide sail
    material size vary settle speak weight general ice matter circle pair include divide
    syllable felt perhaps pick sudden count square reason length represent art subject
    region energy hunt probable bed brother egg ride cell believe fraction forest sit race
    window store summer train sleep prove lone leg exercise wall catch mount wish sky board
    joy winter sat written wild instrument kept glass grass cow job edge sign visit past
    soft fun bright gas weather month million bear finish happy hope flower clothe strange
    gone jump baby eight village meet root buy raise solve metal whether push seven
    paragraph third shall held hair describe cook floor either result burn hill safe cat
    century consider type law bit coast copy phrase silent tall sand soil roll temperature
    finger industry value fight lie beat excite natural view sense ear else quite broke case
    middle kill son lake moment scale loud spring observe child straight consonant nation
    dictionary milk speed method organ pay age section dress cloud surprise quiet stone tiny
    climb cool design poor lot experiment bottom key iron single stick flat twenty skin
    smile crease hole trade melody trip office receive row mouth exact symbol die least
    trouble shout except wrote seed tone join suggest clean break lady yard rise bad blow
    oil blood touch grew cent mix team wire cost lost brown wear garden equal sent choose
    fell fit flow fair bank collect save control decimal gentle woman captain practice
    separate difficult doctor please protect noon whose locate ring character insect caught
    period indicate radio spoke atom human history effect electric expect crop modern
    element hit student corner party supply bone rail imagine provide agree thus capital
    chair danger fruit rich thick soldier process operate guess necessary sharp wing create
    neighbor wash bat rather crowd corn compare poem string bell depend meat rub tube
    famous dollar stream fear sight thin triangle planet hurry chief colony clock mine tie
    enter major fresh search send yellow gun allow print dead spot desert suit current lift
    rose continue block chart hat sell success company subtract event particular deal swim
    term opposite wife shoe shoulder spread arrange camp invent cotton born determine quart
    nine truck noise level chance gather shop stretch throw shine property column molecule
    select wrong gray repeat require broad prepare salt nose plural anger claim continent
    oxygen sugar death pretty skill women season solution magnet silver thank branch match
    suffix especially fig afraid huge sister steel discuss forward similar guide experience
    score apple bought led pitch coat mass card band rope slip win dream evening condition
    feed tool total basic smell valley nor double seat arrive master track parent shore
    division sheet substance favor connect post spend chord fat glad original share station
    dad bread charge proper bar offer segment slave duck instant market degree populate chick
    dear enemy reply drink occur support speech nature range steam motion path liquid log
    meant quotient teeth shell neck""".split()
)

#: Tokens per vocabulary word with a space before it, measured with the project's default
#: tokenizer (``RequestTokenizer.default()``); used only to size messages in tokens.
TOKENS_PER_WORD = 1.7


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload: what to send, where, when, and for which session."""

    arrival_s: float
    endpoint: str
    body: dict[str, Any]
    session_id: str | None = None
    turn: int = 0
    #: Seconds (modelled, like ``arrival_s``) to wait after this session's previous answer.
    think_s: float = 0.0

    @property
    def max_tokens(self) -> int:
        return int(self.body.get("max_tokens", 16))


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, ordered request stream. ``sessions`` is set for the agent-sessions sweep."""

    name: str
    kind: str
    requests: list[WorkloadRequest]
    sessions: int | None = None
    description: str = ""
    think_time: float | None = None  # mean seconds between an answer and the next turn
    arrival_rate: float | None = None  # sessions starting per second (open arrivals)
    #: The client's own bound on requests in flight (None: the replay's ``--max-in-flight``).
    max_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class WorkloadOptions:
    """Knobs shared by the workload generators (``kvroute bench`` flags)."""

    model: str = "sim"
    seed: int = 0
    users: int = 8
    turns: int = 4
    system_tokens: int = 4000
    user_tokens: int | None = None  # None: the workload's own default
    reply_tokens: int | None = None
    conversations: int = 16
    sessions: tuple[int, ...] = (4, 8, 16, 32)
    agent_turns: int = 8
    agent_scale: float = 0.25
    limit: int | None = None
    max_output_tokens: int | None = None  # cap every request's max_tokens
    vocab_size: int = mooncake.DEFAULT_VOCAB_SIZE
    first_token_id: int = mooncake.DEFAULT_FIRST_TOKEN_ID
    think_time: float | None = None  # mean think time (s); None: no think time
    arrival_rate: float | None = None  # sessions/s by a Poisson process; None: all at once


def _rng(seed: int, *scope: int) -> np.random.Generator:
    """An independent, reproducible random stream for (seed, scope...)."""
    return np.random.default_rng([seed, *scope])


def words(rng: np.random.Generator, tokens: int) -> str:
    """Random vocabulary words amounting to about ``tokens`` tokens."""
    count = max(1, round(tokens / TOKENS_PER_WORD))
    picks = rng.integers(0, len(VOCABULARY), size=count)
    return " ".join(VOCABULARY[i] for i in picks)


def _chat(
    arrival_s: float,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    session_id: str,
    turn: int,
    think_s: float = 0.0,
) -> WorkloadRequest:
    body = {"model": model, "messages": list(messages), "max_tokens": max_tokens}
    return WorkloadRequest(arrival_s, CHAT_ENDPOINT, body, session_id, turn, think_s)


@dataclass(frozen=True, slots=True)
class Timing:
    """When a session's turns go out: its start, then a fixed pace or think times.

    ``think_time`` None keeps the workload's own pace (turn ``t`` at ``start + t * pace``,
    sent no earlier than the previous answer). A mean gives each later turn an exponential
    think time after the previous answer, seeded per (seed, stream, session).
    """

    think_time: float | None = None
    seed: int = 0
    stream: int = 0

    def turns(self, session: int, start: float, turns: int, pace: float) -> list[tuple[float, float]]:
        """(arrival_s, think_s) of each of ``turns`` turns of one session."""
        if self.think_time is None:
            return [(start + turn * pace, 0.0) for turn in range(turns)]
        draws = _rng(self.seed, self.stream, session).exponential(self.think_time, size=turns)
        draws[0] = 0.0  # the first turn goes out at the session's start
        arrivals = start + np.cumsum(draws)
        return [(float(a), float(d)) for a, d in zip(arrivals, draws)]


def poisson_starts(rate: float, count: int, seed: int, stream: int) -> np.ndarray:
    """Start times of ``count`` sessions arriving by a Poisson process of ``rate`` per second."""
    if rate <= 0:
        raise ValueError("arrival rate must be positive")
    return np.cumsum(_rng(seed, stream).exponential(1.0 / rate, size=count))


def system_prompt(
    *,
    users: int = 8,
    turns: int = 4,
    system_tokens: int = 4000,
    user_tokens: int = 120,
    reply_tokens: int = 80,
    max_tokens: int = 32,
    stagger_s: float = 0.4,
    think_s: float = 2.0,
    model: str = "sim",
    seed: int = 0,
) -> Iterator[WorkloadRequest]:
    """N users sharing one long system prompt, several turns each, users interleaved."""
    system = {"role": "system", "content": words(_rng(seed, 1), system_tokens)}
    histories = [[system] for _ in range(users)]
    rngs = [_rng(seed, 2, user) for user in range(users)]
    for turn in range(turns):
        for user in range(users):
            history = histories[user]
            history.append({"role": "user", "content": words(rngs[user], user_tokens)})
            arrival = user * stagger_s + turn * think_s
            yield _chat(arrival, model, history, max_tokens, f"user-{user}", turn)
            history.append({"role": "assistant", "content": words(rngs[user], reply_tokens)})


def multi_turn(
    *,
    conversations: int = 16,
    turns: int = 6,
    user_tokens: int = 250,
    reply_tokens: int = 200,
    max_tokens: int = 64,
    mean_gap_s: float = 0.5,
    think_s: float = 3.0,
    model: str = "sim",
    seed: int = 0,
    think_time: float | None = None,
    arrival_rate: float | None = None,
) -> Iterator[WorkloadRequest]:
    """Independent conversations whose histories grow turn by turn (Poisson starts).

    Conversations start ``mean_gap_s`` apart on average (``arrival_rate`` per second when
    given); turns follow every ``think_s`` seconds, or ``think_time`` on average after the
    previous answer when given (see the module's timing variants).
    """
    starts = poisson_starts(arrival_rate or 1.0 / mean_gap_s, conversations, seed, 3)
    timing = Timing(think_time, seed, 8)
    system = {"role": "system", "content": "You are a helpful assistant."}
    pending: list[WorkloadRequest] = []
    for conv in range(conversations):
        rng = _rng(seed, 4, conv)
        history = [system]
        times = timing.turns(conv, float(starts[conv]), turns, think_s)
        for turn, (arrival, think) in enumerate(times):
            history.append({"role": "user", "content": words(rng, user_tokens)})
            pending.append(_chat(arrival, model, history, max_tokens, f"conv-{conv}", turn, think))
            history.append({"role": "assistant", "content": words(rng, reply_tokens)})
    yield from sorted(pending, key=lambda request: request.arrival_s)


#: A production agent turn: about 88K prompt tokens by the end of a session, 400 out.
AGENT_CONTEXT_TOKENS = 88_000
AGENT_OUTPUT_TOKENS = 400

#: The agent's tools, sent with every agent request as OpenAI function tools.
AGENT_TOOLS: tuple[dict[str, Any], ...] = tuple(
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string"}},
                "required": [argument],
            },
        },
    }
    for name, argument, description in (
        ("run_command", "command", "Run a shell command in the workspace; returns its output."),
        ("read_file", "path", "Read a file of the workspace; returns its text."),
        ("search_code", "query", "Search the workspace's code; returns matching lines."),
    )
)


def _tool_call(rng: np.random.Generator, call_id: str) -> dict[str, Any]:
    """An assistant tool call (OpenAI shape) to one of the agent's tools."""
    function = AGENT_TOOLS[int(rng.integers(0, len(AGENT_TOOLS)))]["function"]
    argument = function["parameters"]["required"][0]
    value = "/".join(words(rng, 6).split()[:3])
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": function["name"], "arguments": json.dumps({argument: value})},
    }


def agent_sessions(
    *,
    sessions: int = 8,
    turns: int = 8,
    scale: float = 0.25,
    system_tokens: int = 2000,
    gap_s: float = 0.25,
    model: str = "sim",
    seed: int = 0,
    think_time: float | None = None,
    arrival_rate: float | None = None,
) -> Iterator[WorkloadRequest]:
    """S agent sessions in round-robin lockstep; each turn appends a tool call and its result.

    The last turn's prompt is about ``scale * 88K`` tokens, the output ``scale * 400``. All
    sessions share the agent's system prompt and tools. A turn's history is the previous
    turn's plus the assistant's answer (some text and a tool call) and the tool's result.

    Session ``s`` starts at ``s * gap_s`` (at Poisson times of ``arrival_rate`` per second
    when given) and takes a turn every ``sessions * gap_s`` seconds, or ``think_time`` on
    average after its previous answer when given (see the module's timing variants).
    """
    starts = (
        poisson_starts(arrival_rate, sessions, seed, 9) if arrival_rate is not None else np.arange(sessions) * gap_s
    )
    timing = Timing(think_time, seed, 7)
    times = [timing.turns(s, float(starts[s]), turns, sessions * gap_s) for s in range(sessions)]
    final_tokens = AGENT_CONTEXT_TOKENS * scale
    max_tokens = max(8, round(AGENT_OUTPUT_TOKENS * scale))
    tool_tokens = max(16, round((final_tokens - system_tokens) / turns) - max_tokens)
    system = {"role": "system", "content": words(_rng(seed, 5), system_tokens)}
    histories: list[list[dict[str, Any]]] = []
    rngs = [_rng(seed, 6, session) for session in range(sessions)]
    for session in range(sessions):
        task = {"role": "user", "content": "Task: " + words(rngs[session], 200)}
        histories.append([system, task])
    for turn in range(turns):
        for session in range(sessions):
            history, rng = histories[session], rngs[session]
            if turn > 0:
                call = _tool_call(rng, f"call-{session}-{turn}")
                history.append({"role": "assistant", "content": words(rng, max_tokens - 20), "tool_calls": [call]})
                history.append({"role": "tool", "tool_call_id": call["id"], "content": words(rng, tool_tokens)})
            arrival, think = times[session][turn]
            body = {"model": model, "messages": list(history), "tools": list(AGENT_TOOLS), "max_tokens": max_tokens}
            yield WorkloadRequest(arrival, CHAT_ENDPOINT, body, f"agent-{session}", turn, think)


#: vLLM's prefix_repetition run in issue 12: 16 prompts per prefix, concurrency 8.
PREFIX_REPETITION_PROMPTS_PER_PREFIX = 16
PREFIX_REPETITION_CONCURRENCY = 8


def prefix_repetition(
    *,
    prefixes: int = 12,
    prompts_per_prefix: int = PREFIX_REPETITION_PROMPTS_PER_PREFIX,
    prefix_tokens: int = 1024,
    suffix_tokens: int = 64,
    max_tokens: int = 8,
    model: str = "sim",
    seed: int = 0,
) -> Iterator[WorkloadRequest]:
    """Completions of ``prefixes`` long documents, each with ``prompts_per_prefix`` different
    questions after it, all due at once in a seeded shuffled order (as vLLM's dataset)."""
    documents = [words(_rng(seed, 10, prefix), prefix_tokens) for prefix in range(prefixes)]
    prompts = [
        documents[prefix] + " " + words(_rng(seed, 11, prefix, number), suffix_tokens)
        for prefix in range(prefixes)
        for number in range(prompts_per_prefix)
    ]
    for position in _rng(seed, 12).permutation(len(prompts)):
        body = {"model": model, "prompt": prompts[position], "max_tokens": max_tokens}
        yield WorkloadRequest(0.0, COMPLETIONS_ENDPOINT, body)


def mooncake_trace(
    path: Path,
    *,
    limit: int | None = None,
    model: str = "sim",
    vocab_size: int = mooncake.DEFAULT_VOCAB_SIZE,
    first_token_id: int = mooncake.DEFAULT_FIRST_TOKEN_ID,
) -> Iterator[WorkloadRequest]:
    """A Mooncake trace as completions with token-id prompts, at the trace's own times."""
    mapping = mooncake.BlockMapping(vocab_size=vocab_size, first_token_id=first_token_id)
    for record in mooncake.load_trace(path, limit=limit):
        body = {
            "model": model,
            "prompt": mapping.prompt_tokens(record).tolist(),
            "max_tokens": max(1, record.output_length),
        }
        yield WorkloadRequest(record.timestamp_ms / 1000.0, COMPLETIONS_ENDPOINT, body)


def _finish(requests: Iterator[WorkloadRequest], options: WorkloadOptions) -> list[WorkloadRequest]:
    """In arrival order, cut to ``limit``, ``max_tokens`` capped at ``max_output_tokens``."""
    ordered = sorted(requests, key=lambda request: request.arrival_s)
    if options.limit is not None:
        ordered = ordered[: options.limit]
    cap = options.max_output_tokens
    if cap is None:
        return ordered
    return [
        replace(request, body={**request.body, "max_tokens": min(request.max_tokens, cap)})
        if request.max_tokens > cap
        else request
        for request in ordered
    ]


WORKLOAD_KINDS = (
    "system-prompt",
    "multi-turn[+think=S][+rate=R]",
    "agent-sessions[:S][+think=S][+rate=R]",
    "prefix-repetition[:P]",
    "mooncake:PATH",
)
#: Workloads that take the timing variants.
_TIMED_KINDS = ("multi-turn", "agent-sessions")


def _timing(spec: str, options: WorkloadOptions) -> tuple[str, WorkloadOptions]:
    """Split ``kind[:arg]+think=S+rate=R`` into ``kind[:arg]`` and options with those set."""
    base, *variants = spec.split("+")
    values: dict[str, float] = {}
    for variant in variants:
        key, _, value = variant.partition("=")
        if key not in ("think", "rate"):
            raise ValueError(
                f"unknown workload variant {variant!r} in {spec!r}; known: think=SECONDS, rate=SESSIONS_PER_S"
            )
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"{key} needs a number in {spec!r}") from None
    return base, replace(
        options,
        think_time=values.get("think", options.think_time),
        arrival_rate=values.get("rate", options.arrival_rate),
    )


def _variant_name(name: str, options: WorkloadOptions) -> str:
    """The workload's name with its timing variant: ``agent-sessions:16+think=0.3``."""
    if options.think_time is not None:
        name += f"+think={options.think_time:g}"
    if options.arrival_rate is not None:
        name += f"+rate={options.arrival_rate:g}"
    return name


def _timed(
    name: str,
    kind: str,
    requests: Iterator[WorkloadRequest],
    options: WorkloadOptions,
    description: str,
    sessions: int | None = None,
) -> Workload:
    return Workload(
        _variant_name(name, options),
        kind,
        _finish(requests, options),
        sessions=sessions,
        description=description,
        think_time=options.think_time,
        arrival_rate=options.arrival_rate,
    )


def make_workloads(spec: str, options: WorkloadOptions) -> list[Workload]:
    """The workload(s) a ``--workload`` value names; agent-sessions gives one per S.

    ``multi-turn`` and ``agent-sessions`` take timing variants after the name
    (``agent-sessions:16+think=0.3+rate=0.5``), overriding ``--think-time`` and
    ``--arrival-rate`` for that workload only.
    """
    if spec.split(":")[0].split("+")[0] in _TIMED_KINDS:
        spec, options = _timing(spec, options)
    kind, _, argument = spec.partition(":")
    seed, model, limit = options.seed, options.model, options.limit
    timing = {"think_time": options.think_time, "arrival_rate": options.arrival_rate}
    sizes = {
        name: value
        for name, value in (("user_tokens", options.user_tokens), ("reply_tokens", options.reply_tokens))
        if value is not None
    }
    if kind == "system-prompt":
        requests = system_prompt(
            users=options.users,
            turns=options.turns,
            system_tokens=options.system_tokens,
            model=model,
            seed=seed,
            **sizes,
        )
        description = f"{options.users} users x {options.turns} turns, one system prompt"
        return [Workload(kind, kind, _finish(requests, options), description=description)]
    if kind == "multi-turn":
        requests = multi_turn(
            conversations=options.conversations,
            turns=options.turns,
            model=model,
            seed=seed,
            **sizes,
            **timing,
        )
        description = f"{options.conversations} conversations x {options.turns} turns"
        return [_timed(kind, kind, requests, options, description)]
    if kind == "agent-sessions":
        counts = [int(argument)] if argument else list(options.sessions)
        return [
            _timed(
                f"agent-sessions:{count}",
                kind,
                agent_sessions(
                    sessions=count,
                    turns=options.agent_turns,
                    scale=options.agent_scale,
                    model=model,
                    seed=seed,
                    **timing,
                ),
                options,
                f"{count} sessions x {options.agent_turns} turns, "
                f"~{round(AGENT_CONTEXT_TOKENS * options.agent_scale)} tokens at the end",
                sessions=count,
            )
            for count in counts
        ]
    if kind == "prefix-repetition":
        count = int(argument) if argument else 12
        requests = prefix_repetition(prefixes=count, model=model, seed=seed)
        description = (
            f"{count} prefixes x {PREFIX_REPETITION_PROMPTS_PER_PREFIX} prompts, "
            f"{PREFIX_REPETITION_CONCURRENCY} in flight"
        )
        name = f"prefix-repetition:{count}"
        return [
            Workload(
                name,
                kind,
                _finish(requests, options),
                description=description,
                max_concurrency=PREFIX_REPETITION_CONCURRENCY,
            )
        ]
    if kind == "mooncake":
        if not argument:
            raise ValueError("mooncake needs a trace path: --workload mooncake:PATH")
        path = Path(argument)
        requests = mooncake_trace(
            path,
            limit=limit,
            model=model,
            vocab_size=options.vocab_size,
            first_token_id=options.first_token_id,
        )
        name = f"mooncake:{path.stem.removeprefix('mooncake_').removesuffix('_trace')}"
        return [Workload(name, kind, _finish(requests, options), description=str(path))]
    raise ValueError(f"unknown workload {spec!r}; known: {', '.join(WORKLOAD_KINDS)}")
