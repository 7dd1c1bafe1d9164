"""Routing policies. :func:`make_policy` builds one by its ``--policy`` name."""

from __future__ import annotations

from collections.abc import Callable

from kvroute.router.config import Settings
from kvroute.router.routing.policies.ab import TrafficSplit
from kvroute.router.routing.policies.base import BackendView, Decision, Policy, RouteRequest
from kvroute.router.routing.policies.cache_aware import (
    CacheAware,
    CacheRequest,
    Conversation,
    WorkingSets,
)
from kvroute.router.routing.policies.simple import LeastLoad, PowerOfTwo, Random, RoundRobin
from kvroute.router.routing.policies.sticky import Sticky

__all__ = [
    "LOAD_ONLY_POLICIES",
    "BackendView",
    "CacheAware",
    "CacheRequest",
    "Conversation",
    "Decision",
    "LeastLoad",
    "Policy",
    "PowerOfTwo",
    "Random",
    "RoundRobin",
    "RouteRequest",
    "Sticky",
    "TrafficSplit",
    "WorkingSets",
    "make_policy",
]

#: Policies that look at load only; they need neither the tokenizer nor the prefix index.
LOAD_ONLY_POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "random": Random,
    "least_load": LeastLoad,
    "power_of_two": PowerOfTwo,
}


def make_policy(
    name: str,
    settings: Settings,
    working_sets: WorkingSets,
    index_tokens: Callable[[str], int] | None = None,
    queued_work: Callable[[BackendView], float] | None = None,
) -> Policy:
    """A new policy instance by its ``--policy`` name.

    ``working_sets`` is the routing engine's shared conversation ledger,
    ``index_tokens(url)`` the tokens its prefix index holds per backend and
    ``queued_work(backend)`` the work in flight there; only the cache-aware policies
    (``cache_aware``, and ``sticky`` for requests without a session key) use them.
    """
    if name in LOAD_ONLY_POLICIES:
        return LOAD_ONLY_POLICIES[name]()
    if name in ("cache_aware", "sticky"):
        cache_aware = CacheAware(
            working_sets,
            load_weight=settings.load_weight,
            overload_factor=settings.overload_factor,
            index_tokens=index_tokens,
            queued_work=queued_work,
        )
        if name == "cache_aware":
            return cache_aware
        return Sticky(cache_aware, overload_factor=settings.overload_factor)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join([*LOAD_ONLY_POLICIES, 'sticky', 'cache_aware'])}")
