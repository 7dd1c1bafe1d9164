"""The routing engine: request body -> routing decision, and feedback afterwards.

The proxy calls :meth:`RoutingEngine.route` once per attempt with the eligible backends,
and :meth:`RoutingEngine.observe` once the engine reported how many prompt tokens it had
cached. Synchronous and free of I/O: it owns the policies and (when a cache-aware policy
is configured) the tokenizer and the prefix index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from router.config import Settings
from router.policies import LeastLoad, Policy, PowerOfTwo, Random, RoundRobin
from router.policies.base import BackendView, Decision, RouteRequest


@dataclass(slots=True)
class RoutePlan:
    """One routing decision with what the proxy needs to report and learn from it."""

    decision: Decision
    policy: str
    request: RouteRequest

    @property
    def backend(self) -> str:
        return self.decision.backend

    @property
    def reason(self) -> str:
        return self.decision.reason

    @property
    def predicted_cached_tokens(self) -> int:
        return self.decision.matched_tokens


def build_policy(name: str, settings: Settings) -> Policy:
    """A policy instance by its ``--policy`` name."""
    simple: dict[str, type[Policy]] = {
        "round_robin": RoundRobin,
        "random": Random,
        "least_load": LeastLoad,
        "power_of_two": PowerOfTwo,
    }
    if name in simple:
        return simple[name]()
    raise ValueError(f"policy {name!r} is not available yet")


class RoutingEngine:
    """Chooses a backend per request; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._policy = build_policy(settings.policy, settings)

    @property
    def policy_names(self) -> list[str]:
        """Every policy that may label a request (for metrics)."""
        return [self._policy.name]

    def route(
        self,
        endpoint: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        candidates: Sequence[BackendView],
    ) -> RoutePlan:
        """Pick a backend among ``candidates`` (non-empty) for this parsed request body."""
        request = RouteRequest(endpoint=endpoint, model=body.get("model"))
        decision = self._policy.choose(request, candidates)
        return RoutePlan(decision=decision, policy=self._policy.name, request=request)

    def observe(self, plan: RoutePlan, cached_tokens: int | None) -> None:
        """Feedback after the response: the engine's ``usage.prompt_tokens_details.cached_tokens``."""

    def forget_backend(self, url: str) -> None:
        """A backend left the pool: drop its index entries and policy state."""
        self._policy.forget_backend(url)
