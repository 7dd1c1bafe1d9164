"""Load-only policies: round robin, random, least load and power of two choices."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

from kvroute.router.routing.policies.base import BackendView, Decision, Policy, RouteRequest


class RoundRobin(Policy):
    """Each request to the next backend in turn, each path in a turn of its own."""

    def __init__(self) -> None:
        # Per path: one shared turn sends every call of a client that alternates two paths
        # (vLLM's scale-out render, then generate) to the same backend.
        self._counters: dict[str, Iterator[int]] = {}

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        counter = self._counters.get(request.endpoint)
        if counter is None:
            counter = self._counters[request.endpoint] = itertools.count()
        backend = candidates[next(counter) % len(candidates)]
        return Decision(backend.url, "round_robin", request.matched_tokens.get(backend.url, 0))


class Random(Policy):
    """A uniformly random backend."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        backend = self._rng.choice(candidates)
        return Decision(backend.url, "random", request.matched_tokens.get(backend.url, 0))


def load_of(backend: BackendView) -> tuple[int, int]:
    """Sort key for "least loaded": requests in flight, then their work in tokens."""
    return (backend.in_flight, backend.in_flight_work_tokens)


class LeastLoad(Policy):
    """The backend with the fewest requests in flight (ties: less work in tokens, then by rotation)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        start = next(self._counter) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        backend = min(rotated, key=load_of)
        return Decision(backend.url, "least_load", request.matched_tokens.get(backend.url, 0))


class PowerOfTwo(Policy):
    """The less loaded of two random backends."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        if len(candidates) == 1:
            backend = candidates[0]
        else:
            first, second = self._rng.sample(list(candidates), 2)
            backend = min((first, second), key=load_of)
        return Decision(backend.url, "power_of_two", request.matched_tokens.get(backend.url, 0))
