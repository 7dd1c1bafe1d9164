"""The conversation ledger: which conversation lives where, and the thrash model it prices with."""

from __future__ import annotations

import pytest

from kvroute.router.routing.ledger import ANCHOR_DEPTHS, WorkingSets, anchor_positions, thrash_loss
from tests.router.routing.ledger_helpers import settle


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_thrash_loss_model() -> None:
    assert thrash_loss(10_000, 4, None) == 0
    assert thrash_loss(10_000, 4, 10_000) == 0
    assert thrash_loss(12_000, 4, 10_000) == 8_000  # each of 4 loses the 2K overflow
    assert thrash_loss(40_000, 4, 10_000) == 40_000  # all of it: everything is re-prefilled


def test_derived_conversation_is_found_by_its_previous_last_block() -> None:
    working_sets = WorkingSets()
    first = working_sets.find(None, [11, 12, 13], 0)
    assert first is not None
    working_sets.record(first, "http://b0", 48, 13)
    # The next turn's prompt extends the previous one.
    again = working_sets.find(None, [11, 12, 13, 14, 15], 48)
    assert again is first
    working_sets.record(again, "http://b0", 80, 15)
    assert (again.turns, again.counted, working_sets.demand("http://b0")) == (2, True, (80, 1))
    stranger = working_sets.find(None, [11, 12, 99], 32)
    assert stranger is not first and stranger is not None and stranger.shared_tokens == 32


def test_a_turn_that_rewrote_the_previous_tail_is_found_by_an_anchor() -> None:
    """The next turn lacks the previous prompt's last block (a template rewrote it, or a
    trace hashed in 512-token blocks replaced its partial last one) but holds an earlier one."""
    working_sets = WorkingSets()
    prompt = list(range(100, 200))  # 100 blocks; the first 4 shared with other conversations
    first = working_sets.find(None, prompt, 64)
    assert first is not None
    anchors = [prompt[position] for position in anchor_positions(len(prompt), 4)]
    assert anchors == [prompt[99 - depth] for depth in ANCHOR_DEPTHS]
    working_sets.record(first, "http://b0", 1600, prompt[-1], prompt, 16)
    assert first.anchors == tuple(anchors)
    rewritten = prompt[:90] + list(range(900, 950))  # its last 10 blocks differ
    assert working_sets.find(None, rewritten, 1440) is first
    trimmed = prompt[:30] + list(range(900, 950))  # parts before every anchor: a new one
    assert working_sets.find(None, trimmed, 480) is not first


def test_no_anchor_lies_in_a_prefix_shared_with_others() -> None:
    """Anchors inside the prefix a conversation began sharing (a system prompt) would link
    every conversation of that prompt: a short conversation has none there."""
    assert anchor_positions(20, 0) == [3]
    assert anchor_positions(20, 4) == []
    assert anchor_positions(100, 35) == [83, 35]
    working_sets = WorkingSets()
    system = list(range(50))
    alice = working_sets.find(None, [*system, 1000, 1001], 50 * 16)
    assert alice is not None
    working_sets.record(alice, "http://b0", 52 * 16, 1001, [*system, 1000, 1001], 16)
    assert alice.anchors == ()
    bob = working_sets.find(None, [*system, 2000, 2001], 50 * 16)
    assert bob is not alice


def test_a_prompt_holding_several_leaves_continues_the_latest_tracked_one() -> None:
    """A conversation that branched off another's turn holds both leaves: it continues the
    one whose leaf comes later, unless that conversation is no longer tracked."""
    clock = FakeClock()
    working_sets = WorkingSets(idle_s=100.0, clock=clock)
    early = working_sets.find(None, [21, 22], 0)
    assert early is not None
    working_sets.record(early, "http://b0", 32, 22)
    clock.now += 60.0
    late = working_sets.find(None, [31, 32, 33], 0)
    assert late is not None
    working_sets.record(late, "http://b1", 48, 33)
    prompt = [21, 22, 40, 31, 32, 33, 41]  # made-up hashes: positions are what counts
    assert working_sets.find(None, prompt, 0) is late
    assert working_sets.find(None, list(reversed(prompt)), 0) is early
    clock.now += 60.0  # early has been idle past the idle time; late has not
    assert working_sets.find(None, list(reversed(prompt)), 0) is late
    fresh = working_sets.find(None, [50, 51, 52] * 2000, 0)  # a long prompt holding no leaf
    assert fresh is not None and fresh not in (early, late) and fresh.key.startswith("prefix:")


def test_session_key_identifies_the_conversation_and_retries_are_not_turns() -> None:
    working_sets = WorkingSets()
    conversation = working_sets.find("s1", [1, 2], 0)
    assert conversation is not None
    working_sets.record(conversation, "http://b0", 32, 2)
    working_sets.record(conversation, "http://b1", 32, 2)  # the same request, retried elsewhere
    assert (conversation.turns, conversation.backend) == (1, "http://b1")
    assert working_sets.find("s1", [7], 0) is conversation


def test_conversation_private_size_excludes_the_shared_prefix() -> None:
    working_sets = WorkingSets()
    conversation = working_sets.find(None, [1, 2, 3], 2000)
    assert conversation is not None
    working_sets.record(conversation, "http://b0", 2500, 3)
    working_sets.record(conversation, "http://b0", 2600, 4)
    assert working_sets.demand("http://b0") == (600, 1)


def test_moving_conversation_moves_its_demand() -> None:
    working_sets = WorkingSets()
    conversation = settle(working_sets, "s", "http://b0", 1000)
    working_sets.record(conversation, "http://b1", 1100, None)
    assert working_sets.demand("http://b0") == (0, 0)
    assert working_sets.demand("http://b1") == (1100, 1)


def test_idle_conversations_expire() -> None:
    clock = FakeClock()
    working_sets = WorkingSets(idle_s=60.0, clock=clock)
    settle(working_sets, "old", "http://b0", 1000)
    clock.now += 30
    settle(working_sets, "young", "http://b0", 500)
    clock.now += 45
    working_sets.find("probe", [], 0)  # any lookup expires what is due
    assert working_sets.demand("http://b0") == (500, 1)
    assert len(working_sets) == 1


def test_ledger_is_bounded() -> None:
    working_sets = WorkingSets(max_conversations=100)
    for number in range(1000):
        settle(working_sets, f"s{number}", f"http://b{number % 4}", 100)
    assert len(working_sets) == 100
    assert sum(working_sets.demand(f"http://b{i}")[1] for i in range(4)) == 100


def test_forgetting_a_backend_releases_its_conversations() -> None:
    working_sets = WorkingSets()
    conversation = settle(working_sets, "s", "http://b0", 1000)
    working_sets.forget_backend("http://b0")
    assert working_sets.demand("http://b0") == (0, 0)
    assert conversation.backend is None
    working_sets.record(conversation, "http://b1", 1200, None)
    assert working_sets.demand("http://b1") == (1200, 1)


@pytest.mark.parametrize("count", [2, 3, 8])
def test_single_request_of_a_new_conversation_does_not_count(count: int) -> None:
    working_sets = WorkingSets()
    for number in range(count):
        conversation = working_sets.find(None, [number + 100], 0)
        assert conversation is not None
        working_sets.record(conversation, "http://b0", 5000, number + 100)
    assert working_sets.demand("http://b0") == (0, 0)


def test_hosted_counts_every_live_conversation_by_its_latest_backend() -> None:
    """First turns count too (unlike the working set), moves carry the count, expiry,
    eviction from the bounded ledger and a backend leaving release it."""
    clock = FakeClock()
    working_sets = WorkingSets(idle_s=60.0, max_conversations=3, clock=clock)
    first = working_sets.find("a", [], 0)
    assert first is not None
    working_sets.record(first, "http://b0", 100, None)
    assert working_sets.hosted("http://b0") == 1 and working_sets.demand("http://b0") == (0, 0)
    working_sets.record(first, "http://b0", 200, None)  # staying is not a second conversation
    settle(working_sets, "b", "http://b0", 300)
    assert working_sets.hosted("http://b0") == 2
    working_sets.record(first, "http://b1", 400, None)
    assert (working_sets.hosted("http://b0"), working_sets.hosted("http://b1")) == (1, 1)
    clock.now += 30
    settle(working_sets, "c", "http://b1", 100)
    settle(working_sets, "d", "http://b1", 100)  # the ledger holds 3: "b", the oldest, goes
    assert (working_sets.hosted("http://b0"), working_sets.hosted("http://b1")) == (0, 3)
    clock.now += 45
    working_sets.find("probe", [], 0)  # "a" expires
    assert working_sets.hosted("http://b1") == 2
    working_sets.forget_backend("http://b1")
    assert working_sets.hosted("http://b1") == 0
