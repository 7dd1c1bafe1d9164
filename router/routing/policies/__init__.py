"""Routing policies; :mod:`.registry` lists them by their ``--policy`` names."""

from __future__ import annotations

from kvroute.router.routing.policies.ab import TrafficSplit
from kvroute.router.routing.policies.base import BackendView, Decision, Policy, PolicyContext, RouteRequest
from kvroute.router.routing.policies.cache_aware import CacheAware
from kvroute.router.routing.policies.registry import LOAD_ONLY_POLICIES, POLICIES, make_policy
from kvroute.router.routing.policies.simple import LeastLoad, PowerOfTwo, Random, RoundRobin
from kvroute.router.routing.policies.sticky import Sticky

__all__ = [
    "LOAD_ONLY_POLICIES",
    "POLICIES",
    "BackendView",
    "CacheAware",
    "Decision",
    "LeastLoad",
    "Policy",
    "PolicyContext",
    "PowerOfTwo",
    "Random",
    "RoundRobin",
    "RouteRequest",
    "Sticky",
    "TrafficSplit",
    "make_policy",
]
