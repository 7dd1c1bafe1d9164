"""Fixed placements of sessions on replicas: what placement alone can reach on LRU engines.

``bound_fleet`` (:mod:`~kvroute.benchmarks.bounds`) bounds every router, but it pools the
fleet's cache and evicts by Belady's rule, keeping the head of many histories at once. The
engines a router fronts evict least-recently-used, and a router decides only where each
request goes. Past the fleet's capacity the two part: on agent sessions taking turns, LRU
evicts exactly the history that comes next on every replica whose sessions overflow it.
What placement can do there is choose which sessions share a replica.

``kvroute bench --engine virtual --placement-search`` replays every workload with a session
id on each request under each fixed placement below (in virtual time, on the same replicas
as the policies) and reports the one with the highest hit rate as the ``best_placement``
row, and on stderr every placement's figures and the frontier: those no other beats on
both hit rate and TTFT p99. It is reachable by a router that knew the workload in advance:
a reference for the policies, not an upper bound (a placement that changes over time may
do better).

The candidates, sessions numbered by their first request:

``rotate``
    Session ``i`` on replica ``i mod R``: round robin over sessions.
``K on N + rest on T``
    The first ``K x N`` sessions, ``K`` on each of ``N`` replicas (they fit, or overflow
    little), the rest rotated over the other ``T = R - N``, which thrash. For every
    ``N`` from ``R - 1`` down to 1 and every ``K`` up to ``ceil(S / N)``, where no rest
    is left (``K on N``: the other replicas idle, as a router that groups every session
    on the replica holding their shared prompt leaves them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvroute.benchmarks.results import TargetResult
from kvroute.benchmarks.workloads import WorkloadRequest


@dataclass(frozen=True, slots=True)
class Placement:
    """Every session's replica (by number), and a label saying how it was built."""

    label: str
    replica_of: dict[str, int]


def sessions_in_order(requests: Sequence[WorkloadRequest]) -> list[str]:
    """Session ids by their first request; raises when a request carries none."""
    seen: dict[str, None] = {}
    for request in requests:
        if request.session_id is None:
            raise ValueError("a fixed placement needs a session id on every request")
        seen.setdefault(request.session_id, None)
    return list(seen)


def rotation(sessions: Sequence[str], replicas: int) -> Placement:
    """Session ``i`` on replica ``i mod replicas``."""
    return Placement("rotate", {session: number % replicas for number, session in enumerate(sessions)})


def residents_and_overflow(sessions: Sequence[str], replicas: int, per_replica: int, overflow: int) -> Placement:
    """``per_replica`` sessions on each of the first ``replicas - overflow`` replicas, in
    order; the remaining sessions (if any) rotated over the last ``overflow`` replicas."""
    kept = replicas - overflow
    if not 0 < overflow < replicas or per_replica < 1:
        raise ValueError(f"need 0 < overflow < {replicas} and per_replica >= 1")
    residents = per_replica * kept
    replica_of = {
        session: number // per_replica if number < residents else kept + (number - residents) % overflow
        for number, session in enumerate(sessions)
    }
    rest = f" + rest on {overflow}" if residents < len(sessions) else ""
    return Placement(f"{per_replica} on {kept}{rest}", replica_of)


def candidates(sessions: Sequence[str], replicas: int) -> Iterator[Placement]:
    """The rotation, then for every number of resident replicas ``N`` below ``replicas``
    every ``K`` up to the one that holds all sessions on those ``N`` (the rest idle)."""
    yield rotation(sessions, replicas)
    for kept in range(replicas - 1, 0, -1):
        for per_replica in range(1, -(-len(sessions) // kept) + 1):
            yield residents_and_overflow(sessions, replicas, per_replica, replicas - kept)


def best(results: Sequence[tuple[Placement, TargetResult]]) -> tuple[Placement, TargetResult]:
    """The highest observed hit rate; on a tie the lower TTFT p99, then the earlier one."""

    def rank(item: tuple[int, tuple[Placement, TargetResult]]) -> tuple[float, float, int]:
        order, (_, result) = item
        p99 = result.ttft_p99_s if result.ttft_p99_s is not None else float("inf")
        return (-(result.hit_rate_observed or 0.0), p99, order)

    if not results:
        raise ValueError("no placement was run")
    return min(enumerate(results), key=rank)[1]


def frontier(results: Sequence[tuple[Placement, TargetResult]]) -> list[tuple[Placement, TargetResult]]:
    """The placements no other beats on both hit rate and TTFT p99, by rising p99: the
    price in tail latency of each step up in hit rate."""

    def p99(result: TargetResult) -> float:
        return result.ttft_p99_s if result.ttft_p99_s is not None else float("inf")

    kept: list[tuple[Placement, TargetResult]] = []
    for placement, result in sorted(results, key=lambda item: (p99(item[1]), -(item[1].hit_rate_observed or 0.0))):
        if not kept or (result.hit_rate_observed or 0.0) > (kept[-1][1].hit_rate_observed or 0.0):
            kept.append((placement, result))
    return kept
