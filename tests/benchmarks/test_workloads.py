"""Workload generators: reproducible, shaped as described, prefix-stable across turns."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from kvroute.benchmarks import workloads
from kvroute.benchmarks.workloads import WorkloadOptions, make_workloads


def _bodies(options: WorkloadOptions, spec: str) -> list[list[dict]]:
    return [[r.body for r in w.requests] for w in make_workloads(spec, options)]


@pytest.mark.parametrize("spec", ["system-prompt", "multi-turn", "agent-sessions:4", "prefix-repetition:3"])
def test_same_seed_same_requests_other_seed_other_requests(spec: str) -> None:
    options = WorkloadOptions(seed=7, agent_scale=0.05)
    first = make_workloads(spec, options)
    again = make_workloads(spec, options)
    assert [r for w in first for r in w.requests] == [r for w in again for r in w.requests]
    other = _bodies(WorkloadOptions(seed=8, agent_scale=0.05), spec)
    assert _bodies(options, spec) != other


def _by_session(requests: list[workloads.WorkloadRequest]) -> dict[str, list]:
    sessions: dict[str, list] = defaultdict(list)
    for request in requests:
        sessions[request.session_id].append(request)
    return sessions


@pytest.mark.parametrize("spec", ["system-prompt", "multi-turn", "agent-sessions:3"])
def test_each_turn_extends_the_previous_turns_messages(spec: str) -> None:
    (workload,) = make_workloads(spec, WorkloadOptions(agent_scale=0.05))
    for turns in _by_session(workload.requests).values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for previous, current in itertools.pairwise(turns):
            old, new = previous.body["messages"], current.body["messages"]
            assert new[: len(old)] == old and len(new) > len(old)
            assert current.arrival_s > previous.arrival_s


def test_system_prompt_users_share_only_the_system_prompt() -> None:
    (workload,) = make_workloads("system-prompt", WorkloadOptions(users=5, turns=3))
    assert len(workload.requests) == 15
    firsts = [turns[0].body["messages"] for turns in _by_session(workload.requests).values()]
    assert len(firsts) == 5
    assert len({messages[0]["content"] for messages in firsts}) == 1
    assert len({messages[1]["content"] for messages in firsts}) == 5
    system_words = len(firsts[0][0]["content"].split())
    assert abs(system_words * workloads.TOKENS_PER_WORD - 4000) < 10


def test_agent_sessions_take_turns_in_lockstep_and_grow() -> None:
    options = WorkloadOptions(agent_turns=4, agent_scale=0.1)
    sweep = make_workloads("agent-sessions", options)
    assert [w.sessions for w in sweep] == [4, 8, 16, 32]
    workload = sweep[1]
    order = [r.session_id for r in workload.requests]
    assert order[:16] == [f"agent-{i}" for i in range(8)] * 2
    last = workload.requests[-1].body
    words = sum(len(m["content"].split()) for m in last["messages"])
    expected_tokens = workloads.AGENT_CONTEXT_TOKENS * 0.1
    assert 0.8 * expected_tokens < words * workloads.TOKENS_PER_WORD < 1.2 * expected_tokens
    assert last["max_tokens"] == 40
    assert {m["role"] for m in last["messages"]} == {"system", "user", "assistant", "tool"}
    assert [tool["function"]["name"] for tool in last["tools"]] == ["run_command", "read_file", "search_code"]
    messages = last["messages"]
    for call_message, result in itertools.pairwise(messages):
        if result["role"] == "tool":  # OpenAI shape: each result answers the call before it
            (call,) = call_message["tool_calls"]
            assert result["tool_call_id"] == call["id"]
            assert call["function"]["name"] in {"run_command", "read_file", "search_code"}


def test_limit_keeps_the_earliest_requests() -> None:
    (full,) = make_workloads("multi-turn", WorkloadOptions())
    (cut,) = make_workloads("multi-turn", WorkloadOptions(limit=10))
    assert cut.requests == full.requests[:10]
    arrivals = [r.arrival_s for r in full.requests]
    assert arrivals == sorted(arrivals)


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="system-prompt"):
        make_workloads("nope", WorkloadOptions())
    with pytest.raises(ValueError, match="trace path"):
        make_workloads("mooncake", WorkloadOptions())


@pytest.mark.parametrize("spec", ["system-prompt", "multi-turn", "agent-sessions:3"])
def test_turns_are_token_exact_prefixes_and_sized_in_tokens(spec: str) -> None:
    from kvroute.tokenizer_index import RequestTokenizer

    tokenizer = RequestTokenizer.default()
    (workload,) = make_workloads(spec, WorkloadOptions(agent_scale=0.05, system_tokens=2000))
    previous: dict[str | None, list[int]] = {}
    for request in workload.requests:
        tokens = tokenizer.encode_chat(request.body["messages"], tools=request.body.get("tools"))
        earlier = previous.get(request.session_id)
        if earlier is not None:
            assert tokens[: len(earlier)] == earlier
        previous[request.session_id] = tokens
    if spec == "system-prompt":
        system = tokenizer.encode_chat(workload.requests[0].body["messages"][:1])
        assert 1800 < len(system) < 2200
    if spec.startswith("agent-sessions"):
        assert 0.8 * 4400 < len(tokens) < 1.2 * 4400


def test_max_output_tokens_caps_every_request() -> None:
    (capped,) = make_workloads("agent-sessions:2", WorkloadOptions(max_output_tokens=7))
    (plain,) = make_workloads("agent-sessions:2", WorkloadOptions())
    assert {r.max_tokens for r in capped.requests} == {7}
    assert [r.body["messages"] for r in capped.requests] == [r.body["messages"] for r in plain.requests]


def _sessions_messages(workload: workloads.Workload) -> dict[str, list]:
    return {key: [t.body["messages"] for t in turns] for key, turns in _by_session(workload.requests).items()}


@pytest.mark.parametrize("base", ["agent-sessions:6", "multi-turn"])
def test_timing_variants_send_the_same_turns_at_other_times(base: str) -> None:
    options = WorkloadOptions(agent_scale=0.05, seed=3)
    (plain,) = make_workloads(base, options)
    for variant in ("+think=0.3", "+rate=0.5", "+think=0.3+rate=2"):
        (timed,) = make_workloads(base + variant, options)
        assert timed.name == base + variant
        assert _sessions_messages(timed) == _sessions_messages(plain)
        assert [r.arrival_s for r in timed.requests] != [r.arrival_s for r in plain.requests]
        (again,) = make_workloads(base + variant, options)
        assert again.requests == timed.requests
    assert all(r.think_s == 0.0 for r in plain.requests)


def test_think_times_are_exponential_and_seeded_per_session() -> None:
    options = WorkloadOptions(agent_scale=0.02, agent_turns=8, think_time=0.3)
    (workload,) = make_workloads("agent-sessions:40", options)
    assert workload.name == "agent-sessions:40+think=0.3" and workload.think_time == 0.3
    draws = []
    for turns in _by_session(workload.requests).values():
        assert turns[0].think_s == 0.0  # a session's first turn waits for no answer
        start = turns[0].arrival_s
        for turn in turns[1:]:
            draws.append(turn.think_s)
            start += turn.think_s
            # the nominal arrival is the start plus the think times: a lower bound of the send
            assert turn.arrival_s == pytest.approx(start)
    assert len(draws) == 40 * 7 and min(draws) > 0
    assert 0.25 < float(np.mean(draws)) < 0.35  # mean of 280 exponential draws of mean 0.3
    assert 0.8 < float(np.std(draws)) / float(np.mean(draws)) < 1.2  # exponential: sd = mean
    (other_seed,) = make_workloads("agent-sessions:40", replace(options, seed=1))
    assert [r.think_s for r in other_seed.requests] != [r.think_s for r in workload.requests]


def test_open_arrivals_start_sessions_by_a_poisson_process_and_end_them() -> None:
    options = WorkloadOptions(agent_scale=0.02, agent_turns=3, arrival_rate=2.0)
    (workload,) = make_workloads("agent-sessions:200", options)
    sessions = _by_session(workload.requests)
    starts = sorted(turns[0].arrival_s for turns in sessions.values())
    gaps = np.diff([0.0, *starts])
    assert 0.42 < float(np.mean(gaps)) < 0.58  # 200 exponential gaps of mean 0.5 s
    assert all(len(turns) == 3 for turns in sessions.values())  # every session ends
    # sessions overlap in time but do not all run at once: early ones end before late ones
    ends = {key: turns[-1].arrival_s for key, turns in sessions.items()}
    first, last = sessions["agent-0"], sessions["agent-199"]
    assert ends["agent-0"] < last[0].arrival_s and first[0].arrival_s < starts[10]
    assert [r.arrival_s for r in workload.requests] == sorted(r.arrival_s for r in workload.requests)


def test_unknown_timing_variant_is_refused() -> None:
    with pytest.raises(ValueError, match="think=SECONDS"):
        make_workloads("agent-sessions:4+pause=2", WorkloadOptions())
    with pytest.raises(ValueError, match="needs a number"):
        make_workloads("multi-turn+think=soon", WorkloadOptions())


def test_prefix_repetition_is_shaped_like_vllms_dataset() -> None:
    """P documents, each with 16 different questions after it, shuffled, 8 in flight."""
    (workload,) = make_workloads("prefix-repetition:4", WorkloadOptions())
    assert workload.name == "prefix-repetition:4" and workload.max_concurrency == 8
    prompts = [request.body["prompt"] for request in workload.requests]
    assert len(prompts) == 4 * 16 and len(set(prompts)) == len(prompts)
    documents = defaultdict(list)
    for prompt in prompts:
        documents[" ".join(prompt.split()[:500])].append(prompt)
    assert sorted(len(group) for group in documents.values()) == [16] * 4
    order = [list(documents).index(" ".join(prompt.split()[:500])) for prompt in prompts]
    assert order != sorted(order)  # shuffled, not document by document
    request = workload.requests[0]
    assert request.endpoint == workloads.COMPLETIONS_ENDPOINT and request.session_id is None
    assert request.arrival_s == 0.0 and request.max_tokens == 8
    words = [len(prompt.split()) for prompt in prompts]
    assert min(words) * workloads.TOKENS_PER_WORD > 1024  # ~1,024 + ~64 tokens
