"""Explained decisions: the decision log line and ``GET /admin/decisions`` carry the request,
its conversation, every candidate's cost terms and the reason (real router, sim engines,
the ``openai`` SDK and httpx)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.routing_engine import RoutingEngine
from tests.servers import wait_until

TOKEN = "decisions-admin-token-0123456789"
SYSTEM = " ".join(f"rule {n}: keep the answer short and exact." for n in range(60))
TERMS = {
    "backend",
    "matched_tokens",
    "prefill",
    "queued_tokens",
    "queue",
    "capacity",
    "stay",
    "cost",
    "in_flight",
    "over_bound",
}


def converse(router: Any, session: str, turns: int) -> list[Any]:
    client = router.client()
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    responses = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"{session} asks question {turn}"})
        raw = client.chat.completions.with_raw_response.create(
            model="sim", messages=history, max_tokens=4, extra_headers={"x-session-id": session}
        )
        responses.append(raw)
        history.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})
    return responses


def recent(router: Any, last: int) -> list[dict[str, Any]]:
    answer = httpx.get(router.url + f"/admin/decisions?last={last}", headers={"Authorization": f"Bearer {TOKEN}"})
    answer.raise_for_status()
    return answer.json()["decisions"]


def test_admin_decisions_explain_each_request_by_its_cost_terms(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(3)
    router = router_server(sims, policy="cache_aware", admin_token=TOKEN)
    responses = converse(router, "alice", 3)
    wait_until(lambda: len(recent(router, 10)) == 3)
    decisions = recent(router, 10)
    for raw, decision in zip(responses, decisions, strict=True):
        usage = raw.parse().usage
        assert decision["request_id"] == raw.headers["x-request-id"]
        assert (decision["session_key"], decision["conversation"]) == ("alice", "session:alice")
        assert decision["backend"] == raw.headers["x-kvroute-backend"]
        assert decision["reason"] == raw.headers["x-kvroute-reason"]
        assert decision["observed_cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        candidates = decision["candidates"]
        assert {c["backend"] for c in candidates} == {sim.url for sim in sims}
        assert all(set(c) == TERMS for c in candidates)
        for candidate in candidates:  # the terms add up, in prompt tokens
            assert candidate["prefill"] == usage.prompt_tokens - candidate["matched_tokens"]
            total = candidate["prefill"] + candidate["queue"] + candidate["capacity"] + candidate["stay"]
            assert candidate["cost"] == pytest.approx(total, abs=0.2)
        chosen = next(c for c in candidates if c["backend"] == decision["backend"])
        assert chosen["cost"] == min(c["cost"] for c in candidates if not c["over_bound"])
    first, later = decisions[0], decisions[-1]
    assert (first["reason"], first["home"]) == ("cold_spread", None)
    assert later["home"] == first["backend"] and later["reason"] == "prefix_match"
    assert later["predicted_cached_tokens"] > 0
    # No KV events: the router's model made the prediction; each candidate's eviction rate
    # (the engines held every prediction) is there once an answer checked one.
    assert later["modelled_cached_tokens"] == later["predicted_cached_tokens"]
    assert later["eviction_rates"] == {later["backend"]: 0.0}
    assert [d["request_id"] for d in recent(router, 1)] == [later["request_id"]]


def test_admin_decisions_need_the_token_and_a_count(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1), policy="cache_aware", admin_token=TOKEN)
    assert httpx.get(router.url + "/admin/decisions").status_code == 401
    bad = httpx.get(router.url + "/admin/decisions?last=x", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bad.status_code == 400
    assert recent(router, 0) == []


def test_the_decision_log_line_carries_the_same_record(
    sim_engines: Any, router_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sims = sim_engines(2)
    router = router_server(sims, policy="sticky", decision_log=True)
    with caplog.at_level("INFO", logger="kvroute.decisions"):
        responses = converse(router, "bob", 2)
        wait_until(lambda: len([r for r in caplog.records if r.name == "kvroute.decisions"]) >= 2)
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvroute.decisions"]
    assert [line["request_id"] for line in lines] == [raw.headers["x-request-id"] for raw in responses]
    assert all(line["session_key"] == "bob" and line["reason"] == "sticky" for line in lines)
    assert "candidates" not in lines[0]  # sticky prices nothing: its reason is the explanation


def test_decisions_are_not_explained_when_nobody_reads_them() -> None:
    """The hot path builds no candidate terms without the log or the ring."""
    engine = RoutingEngine(Settings(policy="cache_aware"))
    body = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    plan = engine.route("/v1/chat/completions", body, {}, [Backend("http://b0"), Backend("http://b1")])
    assert plan.decision.explanation is None and not engine.decisions.active
    logged = RoutingEngine(Settings(policy="cache_aware", decision_log=True))
    plan = logged.route("/v1/chat/completions", body, {}, [Backend("http://b0"), Backend("http://b1")])
    assert plan.decision.explanation is not None and len(plan.decision.explanation.candidates) == 2
