"""The policy registry and the load-only policies, on real ``Backend`` objects."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.router.config import POLICY_NAMES, Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.policies import (
    CacheAware,
    LeastLoad,
    PowerOfTwo,
    Random,
    RoundRobin,
    RouteRequest,
    Sticky,
    WorkingSets,
    make_policy,
)


def backends(count: int) -> list[Backend]:
    return [Backend(f"http://b{i}") for i in range(count)]


def ask() -> RouteRequest:
    return RouteRequest(endpoint="/v1/chat/completions")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_configurable_policy_can_be_built(name: str) -> None:
    policy = make_policy(name, Settings(), WorkingSets())
    assert policy.name == name
    decision = policy.choose(ask(), backends(3))
    assert decision.backend.startswith("http://b") and decision.reason


def test_registry_passes_the_knobs_and_wraps_sticky_around_cache_aware() -> None:
    settings = Settings(load_weight=0.5, overload_factor=3.0)
    sticky = make_policy("sticky", settings, WorkingSets())
    assert isinstance(sticky, Sticky) and sticky.needs_prefix_match
    cache_aware = make_policy("cache_aware", settings, WorkingSets())
    assert isinstance(cache_aware, CacheAware) and cache_aware.needs_prefix_match
    assert not make_policy("round_robin", settings, WorkingSets()).needs_prefix_match


def test_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="nope"):
        make_policy("nope", Settings(), WorkingSets())


def test_round_robin_cycles() -> None:
    fleet = backends(3)
    policy = RoundRobin()
    assert [policy.choose(ask(), fleet).backend for _ in range(6)] == [b.url for b in fleet] * 2


def test_least_load_picks_the_idlest_and_rotates_ties() -> None:
    fleet = backends(3)
    policy = LeastLoad()
    assert Counter(policy.choose(ask(), fleet).backend for _ in range(9)) == {b.url: 3 for b in fleet}
    fleet[0].in_flight = fleet[2].in_flight = 2
    assert {policy.choose(ask(), fleet).backend for _ in range(5)} == {"http://b1"}


def test_random_and_power_of_two_cover_the_fleet() -> None:
    fleet = backends(4)
    rng_policy = Random(seed=7)
    assert {rng_policy.choose(ask(), fleet).backend for _ in range(200)} == {b.url for b in fleet}
    fleet[3].in_flight = 100
    two = PowerOfTwo(seed=3)
    picks = Counter(two.choose(ask(), fleet).backend for _ in range(300))
    assert picks["http://b3"] == 0  # always the less loaded of the pair
