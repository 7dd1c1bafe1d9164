"""Which remembered conversation a full memo evicts (``return_order``), rule by rule."""

from __future__ import annotations

from kvroute.tokenizer_index.return_order import OVERDUE_GAPS, ReturnOrder


def test_with_no_gap_known_the_least_recently_used_goes() -> None:
    order = ReturnOrder()
    for key, now in ((1, 0.0), (2, 1.0), (3, 2.0)):
        order.used(key, now)
    order.used(1, 3.0)
    assert order.victim(4.0) == 2


def test_a_superseded_entry_goes_first() -> None:
    order = ReturnOrder()
    order.used(1, 0.0)
    order.used(2, 1.0)
    order.used(3, 5.0, after=1)  # 1's conversation came back after 5 s: 3 supersedes 1
    assert order.victim(6.0) == 1
    order.evict(1)
    assert len(order) == 2


def test_of_superseded_entries_the_one_superseded_longest_ago_goes_first() -> None:
    """A conversation's older turns go before the turn its newest superseded, which the
    newest's siblings (a regenerated answer) build on again, however often they do."""
    order = ReturnOrder()
    order.used(1, 0.0)
    order.used(2, 1.0, after=1)
    order.used(3, 2.0, after=2)  # the newest turn: 1 superseded first, then 2
    order.used(4, 3.0, after=2)  # a sibling of 3, built on 2 again
    assert order.victim(4.0) == 1
    order.evict(1)
    assert order.victim(4.0) == 2
    order.used(2, 5.0)  # used again: no longer superseded
    assert order.victim(6.0) != 2


def test_the_entry_expected_back_last_goes_and_an_overdue_one_before_it() -> None:
    order = ReturnOrder()
    order.used(10, 0.0)
    order.used(11, 20.0, after=10)  # conversation A: back every 20 s
    order.used(20, 18.0)
    order.used(21, 20.0, after=20)  # conversation B: back every 2 s
    order.evict(10)
    order.evict(20)
    order.used(30, 20.5)  # a new conversation: the typical gap (~19 s, a running mean)
    # Expected back: A at 40, B at 22, the new one at ~39.6: A is kept least.
    assert order.victim(21.0) == 11
    # B idle past OVERDUE_GAPS of its 2 s gap: it ended, it goes first.
    assert order.victim(20.0 + 2.0 * OVERDUE_GAPS + 0.5) == 21


def test_a_lookup_of_an_evicted_entry_teaches_the_gap() -> None:
    """Beyond the bound no entry may live to be built on: the keys of evicted entries tell
    how long their conversations took to come back."""
    order = ReturnOrder()
    order.used(1, 0.0)
    order.used(2, 1.0)
    order.evict(1)
    order.used(3, 2.0)
    assert order.victim(3.0) == 2  # no gap known yet: least recently used
    order.looked_up([99, 1], 4.0)  # a turn after 1's: its conversation came back after 4 s
    order.used(4, 4.0)
    # Expected back: 2 at 1 + 4, 3 at 2 + 4, 4 at 4 + 4: the newest is kept least.
    assert order.victim(4.0) == 4
