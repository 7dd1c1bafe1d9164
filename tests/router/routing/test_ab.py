"""A/B traffic splits: stable, proportional assignment of sessions to policies."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.router.routing.policies import TrafficSplit
from kvroute.router.routing.policies.ab import stable_fraction


def test_split_follows_the_weights() -> None:
    split = TrafficSplit({"cache_aware": 80, "round_robin": 20})
    shares = Counter(split.assign(f"session-{n}") for n in range(20_000))
    assert set(shares) == {"cache_aware", "round_robin"}
    assert abs(shares["cache_aware"] / 20_000 - 0.8) < 0.02


def test_assignment_is_stable_across_instances() -> None:
    first = TrafficSplit({"cache_aware": 50, "sticky": 30, "round_robin": 20})
    second = TrafficSplit({"cache_aware": 50, "sticky": 30, "round_robin": 20})
    for n in range(500):
        key = f"user-{n}"
        assert first.assign(key) == second.assign(key) == first.assign(key)


def test_stable_fraction_is_fixed_for_a_key() -> None:
    # A literal value: assignment must not depend on PYTHONHASHSEED, the process or the host.
    assert stable_fraction("session:alice") == pytest.approx(0.1483513633294589, abs=1e-15)
    assert 0.0 <= stable_fraction("x") < 1.0
    values = [stable_fraction(f"k{n}") for n in range(1000)]
    assert 0.45 < sum(values) / len(values) < 0.55


def test_zero_weight_arm_gets_nothing() -> None:
    split = TrafficSplit({"cache_aware": 1, "round_robin": 0})
    assert split.labels == ["cache_aware"]
    assert {split.assign(f"s{n}") for n in range(200)} == {"cache_aware"}


def test_a_split_needs_a_positive_weight() -> None:
    with pytest.raises(ValueError):
        TrafficSplit({"cache_aware": 0})
