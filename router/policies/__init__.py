"""Routing policies. ``make_policy`` builds one by its ``--policy`` name."""

from __future__ import annotations

from router.policies.base import BackendView, Decision, Policy, RouteRequest
from router.policies.simple import LeastLoad, PowerOfTwo, Random, RoundRobin

__all__ = [
    "BackendView",
    "Decision",
    "Policy",
    "RouteRequest",
    "RoundRobin",
    "Random",
    "LeastLoad",
    "PowerOfTwo",
]
