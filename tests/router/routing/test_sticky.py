"""Sticky sessions: rendezvous hashing with bounded load, on real ``Backend`` objects."""

from __future__ import annotations

from collections import Counter

from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.ledger import WorkingSets
from kvroute.router.routing.policies import CacheAware, RouteRequest, Sticky
from kvroute.router.routing.policies.sticky import rendezvous_score


def backends(count: int) -> list[Backend]:
    return [Backend(f"http://b{i}") for i in range(count)]


def sticky(max_sessions: int = 1000) -> Sticky:
    return Sticky(CacheAware(WorkingSets()), overload_factor=2.0, max_sessions=max_sessions)


def ask(key: str | None) -> RouteRequest:
    return RouteRequest(endpoint="/v1/chat/completions", session_key=key, prompt_tokens=500)


def test_a_session_keeps_its_backend() -> None:
    fleet = backends(4)
    policy = sticky()
    decisions = [policy.choose(ask("alice"), fleet) for _ in range(20)]
    assert len({d.backend for d in decisions}) == 1
    assert {d.reason for d in decisions} == {"sticky"}


def test_first_placement_is_the_same_in_every_router_replica() -> None:
    fleet = backends(5)
    first, second = sticky(), sticky()
    for number in range(50):
        key = f"user-{number}"
        assert first.choose(ask(key), fleet).backend == second.choose(ask(key), fleet).backend
        best = max(fleet, key=lambda backend: rendezvous_score(key, backend.url))
        assert first.choose(ask(key), fleet).backend == best.url


def test_sessions_spread_over_the_fleet() -> None:
    fleet = backends(4)
    policy = sticky()
    shares = Counter(policy.choose(ask(f"s{number}"), fleet).backend for number in range(400))
    assert set(shares) == {b.url for b in fleet}
    assert min(shares.values()) > 60  # 100 expected each


def test_an_overloaded_backend_sheds_the_session_and_it_stays_moved() -> None:
    fleet = backends(3)
    policy = sticky()
    home = policy.choose(ask("bob"), fleet).backend
    crowded = next(b for b in fleet if b.url == home)
    crowded.in_flight = 10
    moved = policy.choose(ask("bob"), fleet)
    assert moved.backend != home and moved.reason == "overload"
    crowded.in_flight = 0
    assert policy.choose(ask("bob"), fleet).backend == moved.backend  # no flapping back


def test_only_sessions_of_a_removed_backend_move() -> None:
    fleet = backends(4)
    policy = sticky()
    before = {f"s{n}": policy.choose(ask(f"s{n}"), fleet).backend for n in range(200)}
    gone = fleet.pop(1)
    policy.forget_backend(gone.url)
    after = {key: policy.choose(ask(key), fleet).backend for key in before}
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key, url in before.items() if url == gone.url}
    assert gone.url not in after.values()


def test_a_new_backend_does_not_steal_existing_sessions() -> None:
    fleet = backends(3)
    policy = sticky()
    before = {f"s{n}": policy.choose(ask(f"s{n}"), fleet).backend for n in range(100)}
    fleet.append(Backend("http://b9"))
    assert {key: policy.choose(ask(key), fleet).backend for key in before} == before


def test_requests_without_a_session_key_are_routed_cache_aware() -> None:
    fleet = backends(2)
    policy = sticky()
    request = RouteRequest(endpoint="/v1/chat/completions", prompt_tokens=4000, matched_tokens={"http://b1": 3900})
    decision = policy.choose(request, fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "prefix_match")


def test_remembered_sessions_are_bounded() -> None:
    policy = sticky(max_sessions=50)
    fleet = backends(2)
    for number in range(500):
        policy.choose(ask(f"s{number}"), fleet)
    assert len(policy) == 50
