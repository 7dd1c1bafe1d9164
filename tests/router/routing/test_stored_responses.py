"""StoredResponses, and the routing engine sending a Responses continuation back home."""

from __future__ import annotations

import pytest

from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.routing_engine import RoutingEngine
from kvroute.router.routing.stored_responses import StoredResponses

RESPONSES = "/v1/responses"


def test_the_most_recent_answers_are_remembered() -> None:
    stored = StoredResponses(capacity=2)
    assert stored.remember("resp_1", "http://b0")
    stored.remember("resp_2", "http://b1")
    assert not stored.remember("resp_1", "http://b0")  # seen again: now the most recent, no news
    stored.remember("resp_3", "http://b1")
    assert (stored.backend_of("resp_1"), stored.backend_of("resp_2"), stored.backend_of("resp_3")) == (
        "http://b0",
        None,
        "http://b1",
    )
    assert stored.backend_of(None) is None and stored.backend_of(7) is None
    stored.forget_backend("http://b1")
    assert len(stored) == 1


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "sticky"])
def test_a_continuation_goes_to_the_backend_that_answered(policy: str) -> None:
    """vLLM keeps a stored response in the memory of the replica that answered: a request
    continuing it must go there, whatever the policy would choose."""
    engine = RoutingEngine(Settings(policy=policy))
    backends = [Backend(f"http://b{i}") for i in range(3)]
    first = engine.route(RESPONSES, {"model": "m", "input": "hi"}, {}, backends)
    engine.observe(first, 0, response_id="resp_1")
    continuation = {"model": "m", "input": "and?", "previous_response_id": "resp_1"}
    for _ in range(4):
        plan = engine.route(RESPONSES, continuation, {}, backends)
        assert (plan.backend, plan.reason) == (first.backend, "stored_response")
        # No policy chose it: its series are not the policy's, whose predicted hit rate
        # would read its unpredicted (0) cached tokens as the policy's miss.
        assert plan.policy == "stored_response" and plan.predicted_cached_tokens == 0
    assert first.policy == policy
    # Not when that backend is no candidate (down, draining), nor for an unknown id.
    others = [backend for backend in backends if backend.url != first.backend]
    assert engine.route(RESPONSES, continuation, {}, others).reason != "stored_response"
    unknown = {**continuation, "previous_response_id": "resp_9"}
    assert engine.route(RESPONSES, unknown, {}, backends).reason != "stored_response"
    # An answer whose client left (a background response runs on) still named its id.
    left = engine.route(RESPONSES, {"model": "m", "input": "x"}, {}, backends)
    engine.observe(left, None, answered=False, response_id="resp_2")
    resumed = engine.route(RESPONSES, {**continuation, "previous_response_id": "resp_2"}, {}, backends)
    assert (resumed.backend, resumed.reason) == (left.backend, "stored_response")
    # A backend that leaves takes its answers with it.
    engine.forget_backend(first.backend)
    assert engine.route(RESPONSES, continuation, {}, backends).reason != "stored_response"
