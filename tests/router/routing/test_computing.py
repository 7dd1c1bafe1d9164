"""Blocks that requests in flight are still computing: this router's, its peers' placements
and what its peers' load reports list."""

from __future__ import annotations

from kvroute.router.routing.computing import PEER_PLACEMENT_S, UNOBSERVED_TTL_S, ComputingBlocks

BLOCK = 16
PROMPT = [101, 102, 103, 104, 105, 106]  # one prompt's block hashes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tokens(computing: ComputingBlocks, matched: dict[str, int], prompt: list[int] = PROMPT) -> dict[str, int]:
    return computing.tokens(matched, BLOCK, prompt.__getitem__)


def test_a_match_is_computed_from_the_first_block_a_request_in_flight_added() -> None:
    computing = ComputingBlocks(Clock())
    computing.start(1, "http://a", (2, 103))
    assert tokens(computing, {"http://a": 6 * BLOCK, "http://b": 6 * BLOCK}) == {"http://a": 4 * BLOCK}
    assert tokens(computing, {"http://a": 2 * BLOCK}) == {}  # the match ends before it
    # Another prompt, which has a different block at that position, is not behind it.
    assert tokens(computing, {"http://a": 6 * BLOCK}, [101, 102, 999, 104, 105, 106]) == {}
    computing.start(2, "http://a", (1, 102))  # the earliest of several counts
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {"http://a": 5 * BLOCK}
    assert computing.own() == {"http://a": [(2, 103), (1, 102)]}
    computing.settle(2)
    computing.settle(1)
    computing.settle(7)  # unknown: nothing
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {} and computing.own() == {}


def test_an_attempt_never_reported_back_stops_counting_after_the_ttl() -> None:
    clock = Clock()
    computing = ComputingBlocks(clock)
    computing.start(1, "http://a", (0, 101))
    clock.now += UNOBSERVED_TTL_S + 1
    computing.start(2, "http://b", (0, 101))  # expiry runs as attempts start
    assert computing.own() == {"http://b": [(0, 101)]}


def test_a_peers_placement_counts_until_its_report_can_list_it() -> None:
    clock = Clock()
    computing = ComputingBlocks(clock)
    computing.placed_by_peer("http://a", (3, 104))
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {"http://a": 3 * BLOCK}
    assert computing.own() == {}  # not this router's: its reports do not list it
    clock.now += PEER_PLACEMENT_S + 0.01
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {}


def test_the_peers_reports_replace_what_they_listed_before() -> None:
    computing = ComputingBlocks(Clock())
    computing.reported_by_peers("http://a", ((4, 105), (1, 102)))
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {"http://a": 5 * BLOCK}
    computing.reported_by_peers("http://a", ((4, 105),))
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {"http://a": 2 * BLOCK}
    computing.reported_by_peers("http://a", ())
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {}


def test_a_backend_that_left_is_forgotten_everywhere() -> None:
    computing = ComputingBlocks(Clock())
    computing.start(1, "http://a", (0, 101))
    computing.start(2, "http://b", (0, 101))
    computing.placed_by_peer("http://a", (0, 101))
    computing.reported_by_peers("http://a", ((0, 101),))
    computing.forget("http://a")
    assert tokens(computing, {"http://a": 6 * BLOCK}) == {}
    assert computing.own() == {"http://b": [(0, 101)]}
    computing.settle(1)  # already forgotten: nothing
