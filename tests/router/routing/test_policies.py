"""The policy registry, the policy base and the load-only policies, on real ``Backend`` objects."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.router.config import POLICY_NAMES, Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.ledger import WorkingSets
from kvroute.router.routing.policies import (
    LOAD_ONLY_POLICIES,
    POLICIES,
    CacheAware,
    LeastLoad,
    PolicyContext,
    PowerOfTwo,
    Random,
    RoundRobin,
    RouteRequest,
    Sticky,
    make_policy,
)
from kvroute.router.routing.policies.base import over_load_bound
from kvroute.router.routing.policies.registry import policy_table_markdown
from tests.paths import REPO


def backends(count: int) -> list[Backend]:
    return [Backend(f"http://b{i}") for i in range(count)]


def ask() -> RouteRequest:
    return RouteRequest(endpoint="/v1/chat/completions")


def context(settings: Settings | None = None) -> PolicyContext:
    return PolicyContext(settings or Settings(), WorkingSets())


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_configurable_policy_can_be_built(name: str) -> None:
    policy = make_policy(name, context())
    assert isinstance(policy, POLICIES[name])  # type: ignore[index]
    decision = policy.choose(ask(), backends(3))
    assert decision.backend.startswith("http://b") and decision.reason


def test_the_registry_names_what_config_accepts_in_its_order() -> None:
    """Config (a layer below the policies) spells the names out; the registry must match."""
    assert tuple(POLICIES) == POLICY_NAMES
    assert {"round_robin", "least_load", "random", "power_of_two"} == LOAD_ONLY_POLICIES


def test_registry_passes_the_knobs_and_wraps_sticky_around_cache_aware() -> None:
    knobs = context(Settings(load_weight=0.25, overload_factor=3.0))
    sticky = make_policy("sticky", knobs)
    assert isinstance(sticky, Sticky) and sticky.needs_prefix_match
    cache_aware = make_policy("cache_aware", knobs)
    assert isinstance(cache_aware, CacheAware) and cache_aware.needs_prefix_match
    assert (cache_aware._load_weight, cache_aware._overload_factor) == (0.25, 3.0)
    assert not make_policy("round_robin", knobs).needs_prefix_match


def test_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="nope"):
        make_policy("nope", context())


def test_readme_policy_table_is_the_registrys() -> None:
    """The README's table is ``python -m kvroute.router.routing.policies``'s output."""
    assert policy_table_markdown() in (REPO / "README.md").read_text()


def test_bounded_load_test() -> None:
    assert not over_load_bound(0, 0, 4, 2.0)
    assert not over_load_bound(3, 3, 4, 2.0)  # a few requests on an idle fleet: no overload
    assert over_load_bound(4, 4, 4, 2.0)  # 5 > 2 * 2
    assert not over_load_bound(11, 23, 4, 2.0)  # others average 4: 12 > 12 is false
    assert over_load_bound(12, 24, 4, 2.0)
    assert not over_load_bound(100, 100, 1, 2.0)  # a single backend is never "over"


def test_round_robin_cycles() -> None:
    fleet = backends(3)
    policy = RoundRobin()
    assert [policy.choose(ask(), fleet).backend for _ in range(6)] == [b.url for b in fleet] * 2


def test_round_robin_turns_each_path_apart() -> None:
    """A client alternating two paths (vLLM's scale-out render, then generate): each path's
    calls go round the backends, not every generation to the same one."""
    fleet = backends(2)
    policy = RoundRobin()
    chosen: dict[str, list[str]] = {"/v1/chat/completions/render": [], "/inference/v1/generate": []}
    for _ in range(4):
        for path, backends_chosen in chosen.items():
            backends_chosen.append(policy.choose(RouteRequest(endpoint=path), fleet).backend)
    assert all(Counter(urls) == {b.url: 2 for b in fleet} for urls in chosen.values()), chosen


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
