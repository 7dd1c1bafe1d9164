"""CONTRIBUTING.md's example policy, added as a newcomer would add it: its code and its
registry line read from the markdown, registered, then routing real requests through a
router over sim engines."""

from __future__ import annotations

import re
import sys
import types
from typing import Any

import httpx
import pytest

from kvroute.router.routing.policies import registry
from kvroute.router.routing.policies.base import Policy
from tests.paths import REPO


def example_blocks() -> list[str]:
    """The Python blocks of CONTRIBUTING.md's "Adding a policy" section, in order."""
    text = (REPO / "CONTRIBUTING.md").read_text()
    section = text.split("## Adding a policy", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def registered_example(monkeypatch: pytest.MonkeyPatch) -> tuple[str, type[Policy]]:
    """Run the example's module, then resolve its catalog line through the real registry."""
    module_source, catalog_line = example_blocks()
    assert len(module_source.splitlines()) <= 30, "the example stays short enough to read at a glance"
    entry: dict[str, str] = eval("{" + catalog_line + "}")
    ((name, location),) = entry.items()
    module = types.ModuleType(location.partition(":")[0])
    exec(compile(module_source, "CONTRIBUTING.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)  # as if it were a file of the package
    policy = registry.load(location)
    assert name not in registry.POLICIES
    monkeypatch.setitem(registry.POLICIES, name, policy)
    return name, policy


def test_the_example_policy_routes_requests_through_a_router(
    sim_engines: Any, router_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, policy = registered_example(monkeypatch)
    assert name in registry.policy_table_markdown() and registry.summary(policy).startswith("The backend holding")
    engines = sim_engines(3)
    router = router_server(engines, policy="round_robin", allow_policy_header=True)
    forced = {"x-kvroute-policy": name}

    def ask(messages: list[dict[str, str]]) -> httpx.Headers:
        body = {"model": "sim", "messages": messages, "max_tokens": 2}
        response = httpx.post(router.v1 + "/chat/completions", json=body, headers=forced, timeout=30)
        response.raise_for_status()
        return response.headers

    # The first request it labels builds it, and turns prompt tracking on from the next one.
    assert ask([{"role": "user", "content": "hello"}])["x-kvroute-policy"] == name
    homes = {}
    for user in range(4):
        history = [{"role": "user", "content": f"user {user}: " + " ".join(["tell me more"] * 30)}]
        first = ask(history)
        assert (first["x-kvroute-policy"], first["x-kvroute-reason"]) == (name, "cold")
        history += [{"role": "assistant", "content": "sure"}, {"role": "user", "content": "and then?"}]
        again = ask(history)
        assert again["x-kvroute-reason"] == "prefix_match" and int(again["x-kvroute-matched-tokens"]) > 0
        assert again["x-kvroute-backend"] == first["x-kvroute-backend"]
        homes[user] = again["x-kvroute-backend"]
    assert set(homes.values()) <= {engine.url for engine in engines}
    decisions = router.metrics().value("kvroute_routing_decisions_total", policy=name, reason="prefix_match")
    assert decisions == 4
