"""Workload generators: reproducible, shaped as described, prefix-stable across turns."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from benchmarks import workloads
from benchmarks.workloads import WorkloadOptions, make_workloads


def _bodies(options: WorkloadOptions, spec: str) -> list[list[dict]]:
    return [[r.body for r in w.requests] for w in make_workloads(spec, options)]


@pytest.mark.parametrize("spec", ["system-prompt", "multi-turn", "agent-sessions:4"])
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
    assert [tool["function"]["name"] for tool in last["tools"]] == [
        "run_command", "read_file", "search_code"
    ]
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
    from tokenizer_index import RequestTokenizer

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
    assert [r.body["messages"] for r in capped.requests] == [
        r.body["messages"] for r in plain.requests
    ]
