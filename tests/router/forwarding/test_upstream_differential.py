"""kvroute's response parser against h11, on generated engine responses (11,000 per run).

The cases come from :mod:`kvroute.benchmarks.upstream_cases` (valid and malformed framing, chunk
extensions, trailers, interim 1xx, pipelined garbage, truncation, byte flips, each cut at
random byte boundaries); :func:`~kvroute.benchmarks.upstream_cases.check` states the agreement
required. The subject is the parser, so its ``data_received`` is driven directly over a
stand-in transport; the socket tests in ``test_upstream.py`` cover the wiring.
``benchmarks/fuzz_upstream.py`` runs 10^6 of the seeded cases.

Two tests share the generator: every choice drawn by hypothesis (1,000 cases, a failure
shrinks to a small one), and 10,000 cases each from a seed hypothesis picks (a fast
``random.Random`` makes the choices; a failure names its seed, which replays with
``python3 -m kvroute.benchmarks.fuzz_upstream --start SEED --cases 1``).
"""

from __future__ import annotations

from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.benchmarks.upstream_cases import (
    Case,
    RandomDraw,
    check,
    draw_case,
    kvroute_verdict,
)

_SETTINGS = {"deadline": None, "derandomize": True, "database": None, "suppress_health_check": list(HealthCheck)}


@cache
def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@cache
def _binary(size: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=size, max_size=size)


class HypothesisDraw:
    """The generator's choices, drawn by hypothesis."""

    def __init__(self, data: st.DataObject) -> None:
        self._data = data

    def integer(self, low: int, high: int) -> int:
        return self._data.draw(_integers(low, high))

    def octets(self, size: int) -> bytes:
        return self._data.draw(_binary(size))


def _require_agreement(case: Case) -> None:
    problem = check(case)
    assert problem is None, f"{problem}\nraw={case.raw!r}\ncuts={case.cuts} tags={case.tags}"


@settings(max_examples=1_000, **_SETTINGS)
@given(st.data())
def test_agreement_on_cases_hypothesis_draws(data: st.DataObject) -> None:
    _require_agreement(draw_case(HypothesisDraw(data)))


@settings(max_examples=10_000, **_SETTINGS)
@given(st.integers(0, 2**32 - 1))
def test_agreement_on_seeded_cases(seed: int) -> None:
    _require_agreement(draw_case(RandomDraw(seed)))


def test_the_issue_findings_are_rejected_however_cut() -> None:
    head = b"HTTP/1.1 200 OK\r\n"
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n"
    for raw in (
        chunked + b"-3\r\nabc\r\n0\r\n\r\n",
        chunked + b"3\r\nabcXY0\r\n\r\n",
        head + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        head + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        head + b"Transfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    ):
        assert not kvroute_verdict(Case(raw, ())).accepted
        assert not kvroute_verdict(Case(raw, tuple(range(1, len(raw))))).accepted
