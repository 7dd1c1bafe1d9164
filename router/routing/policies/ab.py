"""A/B traffic splits: which policy routes a request, by a stable hash of its session.

``--ab "cache_aware=80,round_robin=20"`` sends 80 % of sessions through cache_aware and
20 % through round robin. The assignment hashes the session (or, for a request without
one, the key the routing engine derives from the request itself) with BLAKE2b, so it is
the same for every request of a session, in every router replica and across restarts --
a session never flips between policies mid-conversation, and the two groups stay
comparable. The label travels with the decision (``RoutePlan.policy``) into every metric.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping

_SCALE = 1 << 64


def stable_fraction(key: str) -> float:
    """A uniform number in [0, 1) determined by ``key`` alone (the same in every process)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"kvroute-ab").digest()
    return int.from_bytes(digest, "big") / _SCALE


class TrafficSplit:
    """Maps assignment keys to policy labels in proportion to their weights."""

    def __init__(self, weights: Mapping[str, int]) -> None:
        positive = {name: weight for name, weight in weights.items() if weight > 0}
        if not positive:
            raise ValueError("an A/B split needs at least one policy with a weight above 0")
        total = sum(positive.values())
        self.weights: dict[str, int] = dict(positive)
        self.labels: list[str] = list(positive)
        # Upper bounds of each label's slice of [0, 1).
        self._bounds: list[float] = []
        running = 0
        for weight in positive.values():
            running += weight
            self._bounds.append(running / total)

    def assign(self, key: str) -> str:
        """The policy label for this session / request key."""
        index = bisect.bisect_right(self._bounds, stable_fraction(key))
        return self.labels[min(index, len(self.labels) - 1)]
