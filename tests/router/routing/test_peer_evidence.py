"""Eviction evidence between routers: its wire format and what a message may say."""

from __future__ import annotations

import pytest

from kvroute.router.routing.peer_evidence import Answers, decode_evidence, encode_evidence


def test_answers_survive_the_wire() -> None:
    answers = {"http://a": Answers(5, 2), "http://b:8000": Answers(1, 0)}
    assert decode_evidence(encode_evidence(answers)) == answers
    assert decode_evidence(encode_evidence({})) == {}


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1, 2]",
        b'{"": [1, 0]}',
        b'{"http://a": [1]}',
        b'{"http://a": [1, 2]}',  # more evictions than answers
        b'{"http://a": [-1, 0]}',
        b'{"http://a": [1.0, 0]}',
        b'{"http://a": [true, false]}',
        b'{"http://a": {"checked": 1}}',
    ],
)
def test_malformed_evidence_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_evidence(data)


@pytest.mark.parametrize(("checked", "evicted"), [(0, 0), (1, 1), (3, 0), (4, 1), (5, 2), (10, 10)])
def test_answers_in_order_spread_their_evictions(checked: int, evicted: int) -> None:
    order = Answers(checked, evicted).in_order()
    assert len(order) == checked and sum(order) == evicted
    # Evenly: no prefix holds more than its share of the evictions, rounded up.
    assert all(sum(order[:end]) <= -(-end * evicted // checked) for end in range(1, checked + 1))
