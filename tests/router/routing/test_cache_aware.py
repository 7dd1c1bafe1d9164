"""The cache-aware policy, on real ``Backend`` objects.

Backends here are the router's own :class:`kvroute.router.fleet.backends.Backend` (plain data: load
counters and capacity set directly), and requests carry the prefix matches the routing
engine would compute. The end-to-end behaviour through the proxy and sim engines is in
``tests/router/routing/test_routing.py``.
"""

from __future__ import annotations

from collections import Counter

from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.ledger import Conversation, WorkingSets
from kvroute.router.routing.policies import CacheAware, RouteRequest
from kvroute.router.routing.policies.cache_aware import EVICTION_RATE_FULL, thrash_weight
from tests.router.routing.ledger_helpers import settle


def backends(count: int, capacity: int | None = None) -> list[Backend]:
    return [Backend(f"http://b{i}", capacity_tokens=capacity) for i in range(count)]


def request(
    prompt: int, matched: dict[str, int] | None = None, conversation: Conversation | None = None, output: int = 16
) -> RouteRequest:
    return RouteRequest(
        endpoint="/v1/chat/completions",
        prompt_tokens=prompt,
        matched_tokens=matched or {},
        expected_output_tokens=output,
        conversation=conversation,
    )


def policy(working_sets: WorkingSets | None = None, **options: float) -> CacheAware:
    return CacheAware(working_sets if working_sets is not None else WorkingSets(), **options)


# --- the cost: match against load --------------------------------------------------------


def test_cold_prompts_spread_evenly_and_never_pile_on_the_first_replica() -> None:
    fleet = backends(4)
    cache_aware = policy()
    chosen = [cache_aware.choose(request(3000), fleet) for _ in range(12)]
    assert Counter(d.backend for d in chosen) == {b.url: 3 for b in fleet}
    assert {d.reason for d in chosen} == {"cold_spread"}


def test_cold_prompt_goes_to_the_least_loaded_backend() -> None:
    fleet = backends(3)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 1, 5000
    fleet[1].in_flight, fleet[1].in_flight_work_tokens = 1, 800
    fleet[2].in_flight, fleet[2].in_flight_work_tokens = 1, 2000
    decision = policy().choose(request(1000), fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "cold_spread")


def test_cold_tie_prefers_the_backend_with_the_emptiest_cache() -> None:
    fleet = backends(3, capacity=100_000)
    cold = request(1000)
    cold.index_tokens = {"http://b0": 50_000, "http://b1": 10_000, "http://b2": 90_000}
    cache_aware = policy()
    for _ in range(3):
        assert cache_aware.choose(cold, fleet).backend == "http://b1"


def test_a_cold_prompt_goes_where_its_repeats_will_find_room_not_where_the_queue_is_short() -> None:
    """A document's first request decides where its later ones look for it; the load of the
    moment passes. Within the load bound, only the roomiest caches (within half the prompt)
    are candidates; among them, the cost decides."""
    fleet = backends(2, capacity=8192)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 6, 6000  # busy, but its cache has room
    cold = request(1088)
    cold.index_capacity_tokens = {"http://b0": 8192, "http://b1": 8192}
    cold.index_tokens = {"http://b0": 5 * 1088, "http://b1": 6 * 1088}
    decision = policy().choose(cold, fleet)
    assert (decision.backend, decision.reason) == ("http://b0", "cold_spread")
    # Within half a prompt of each other the caches count as alike: the queue decides.
    cold.index_tokens = {"http://b0": 5 * 1088, "http://b1": 5 * 1088 + 500}
    assert policy().choose(cold, fleet).backend == "http://b1"


def test_a_roomy_cache_over_the_load_bound_takes_no_cold_prompt() -> None:
    fleet = backends(2, capacity=8192)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 9, 9000  # 9 against 0: over the bound (8)
    cold = request(1088)
    cold.index_capacity_tokens = {"http://b0": 8192, "http://b1": 8192}
    cold.index_tokens = {"http://b0": 0, "http://b1": 8192}
    assert policy().choose(cold, fleet).backend == "http://b1"


def test_a_cache_the_model_shrank_is_full_at_its_modelled_size_not_roomy() -> None:
    """An engine that evicts earlier than configured has its index held to the learnt share
    of its cache: full there, it has no more room than a full one of the configured size."""
    fleet = backends(2, capacity=8192)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 3, 3000
    cold = request(1088)
    cold.index_capacity_tokens = {"http://b0": 6144, "http://b1": 8192}  # b0's model: 3/4 of it
    cold.index_tokens = {"http://b0": 6144, "http://b1": 8160}
    assert policy().choose(cold, fleet).backend == "http://b1"  # both full: the queue decides


def test_full_caches_or_unknown_sizes_leave_a_cold_prompt_to_the_queue() -> None:
    for capacity, held in ((8192, {"http://b0": 8192, "http://b1": 8160}), (None, {"http://b0": 0, "http://b1": 9000})):
        fleet = backends(2, capacity=capacity)
        fleet[0].in_flight, fleet[0].in_flight_work_tokens = 3, 3000
        cold = request(1088)
        cold.index_capacity_tokens = {url: capacity for url in held} if capacity else {}
        cold.index_tokens = held
        assert policy().choose(cold, fleet).backend == "http://b1"


def test_a_new_sessions_cold_first_turn_keeps_its_own_rule() -> None:
    """Sessions balance by the conversations each backend hosts, not by cache room."""
    fleet = backends(2, capacity=8192)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 3, 3000
    first = request(1088, conversation=Conversation("session:new"))
    first.session_key = "new"
    first.index_tokens = {"http://b0": 0, "http://b1": 6000}
    assert policy().choose(first, fleet).backend == "http://b1"  # more than one request busier


def test_longest_match_wins_over_a_slight_imbalance() -> None:
    fleet = backends(2)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 2, 700
    decision = policy().choose(request(5000, {"http://b0": 4800}), fleet)
    assert (decision.backend, decision.reason, decision.matched_tokens) == ("http://b0", "prefix_match", 4800)


def test_queued_work_outweighing_the_match_sends_it_elsewhere() -> None:
    fleet = backends(2)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 1, 9000
    decision = policy().choose(request(2000, {"http://b0": 1500}), fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "least_cost")


def test_load_weight_scales_the_queue_against_the_match() -> None:
    fleet = backends(2)
    fleet[0].in_flight, fleet[0].in_flight_work_tokens = 1, 3000
    cheap_queue = policy(load_weight=0.25).choose(request(2000, {"http://b0": 1500}), fleet)
    dear_queue = policy(load_weight=1.0).choose(request(2000, {"http://b0": 1500}), fleet)
    assert (cheap_queue.backend, dear_queue.backend) == ("http://b0", "http://b1")


def _queue(backend: Backend, requests: int, tokens: int) -> None:
    backend.in_flight, backend.in_flight_work_tokens = requests, tokens


def test_deep_queues_keep_a_conversation_with_its_history() -> None:
    """The same 30K-token queue difference outweighs an 8K history on a light fleet, not a busy one."""
    returning = request(10_000, {"http://b0": 8000})
    light = backends(2)
    _queue(light[0], 1, 30_000)  # busy 0.5: weight 0.5 / 1.5, 10K of queue against 8K of history
    left = policy().choose(returning, light)
    assert (left.backend, left.reason) == ("http://b1", "least_cost")
    busy = backends(2)
    _queue(busy[0], 11, 30_000 + 100_000)  # ten more requests on each: busy 10.5
    _queue(busy[1], 10, 100_000)
    stayed = policy().choose(returning, busy)
    assert (stayed.backend, stayed.reason, stayed.matched_tokens) == ("http://b0", "prefix_match", 8000)


def test_a_shared_prefix_keeps_the_full_load_weight_on_a_busy_fleet() -> None:
    """A match of a minority of the prompt is a shared prefix, not the request's history."""
    fleet = backends(2)
    _queue(fleet[0], 11, 10_000 + 100_000)
    _queue(fleet[1], 10, 100_000)
    new_conversation = request(6000, {"http://b0": 2000})  # 0.5 * 10K of queue > 2K of prefix
    decision = policy().choose(new_conversation, fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "least_cost")
    holds_most = request(6000, {"http://b0": 3000})  # half the prompt: its history, weight / 11.5
    assert policy().choose(holds_most, fleet).backend == "http://b0"


def test_a_new_sessions_shared_prefix_is_not_its_history() -> None:
    """A session the ledger has not seen: even most of the prompt matched is a shared prefix
    (tools, system prompt), so the queue keeps its full weight."""
    fleet = backends(2)
    _queue(fleet[0], 11, 10_000 + 100_000)
    _queue(fleet[1], 10, 100_000)
    new = request(6000, {"http://b0": 4000}, Conversation("session:s", shared_tokens=4000))
    new.session_key = "s"
    decision = policy().choose(new, fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "least_cost")
    returning = request(6000, {"http://b0": 4000}, Conversation("session:t", backend="http://b0", turns=1))
    assert policy().choose(returning, fleet).backend == "http://b0"  # its own history: weight / 11.5


def test_a_conversation_whose_history_every_cache_evicted_keeps_the_full_load_weight() -> None:
    """A returning conversation that finds only the prefix it began sharing (its own history
    evicted everywhere) is placed anew: a busy home no longer looks cheap to it."""
    fleet = backends(2)
    _queue(fleet[0], 11, 10_000 + 100_000)
    _queue(fleet[1], 10, 100_000)
    cache_aware = policy()
    cache_aware.explain = True
    lost = Conversation("session:l", backend="http://b0", turns=5, shared_tokens=4000)
    both_shared = {"http://b0": 4000, "http://b1": 4000}
    decision = cache_aware.choose(request(6000, both_shared, lost), fleet)
    assert decision.explanation is not None and decision.explanation.load_weight == 0.5
    assert decision.backend == "http://b1"
    held = Conversation("session:h", backend="http://b0", turns=5, shared_tokens=2000)
    decision = cache_aware.choose(request(6000, {"http://b0": 4000, "http://b1": 2000}, held), fleet)
    assert decision.explanation is not None and decision.explanation.load_weight == 0.5 / 11.5
    assert decision.backend == "http://b0"


def test_a_burst_of_new_sessions_spreads_instead_of_queueing_behind_a_shared_prefix() -> None:
    """Sixteen agent sessions start at once, all sharing a 2K-token tool list: each session's
    first request places the whole session, so they spread by load (at most one request
    busier than the least busy backend) instead of piling behind the replica that is
    computing the shared prefix."""
    fleet = backends(4)
    cache_aware = policy()
    for number in range(16):
        holder = fleet[0].url if number else None  # the first one computes the tool list
        matched = {holder: 2000} if holder else {}
        new = request(2200, matched, Conversation(f"session:{number}", shared_tokens=2000 if holder else 0))
        new.session_key = str(number)
        url = cache_aware.choose(new, fleet).backend
        next(b for b in fleet if b.url == url).in_flight += 1
    loads = [b.in_flight for b in fleet]
    assert max(loads) - min(loads) <= 2  # 1 + NEW_SESSION_SLACK


def test_new_sessions_balance_by_conversations_where_no_backend_holds_more_of_them() -> None:
    """Agent sessions that start as others pause between turns: in-flight requests no longer
    count sessions, so where every backend holds their shared prefix alike, a new session
    goes to a backend hosting the fewest conversations, bringing its future turns there."""
    fleet = backends(4)
    working_sets = WorkingSets()
    cache_aware = policy(working_sets)
    for number, url in enumerate(["http://b0", "http://b0", "http://b1", "http://b2", "http://b3"]):
        working_sets.record(Conversation(f"session:old{number}"), url, 2200, None)
    fleet[1].in_flight = 1  # b0's two sessions are between turns: b1 looks busier
    new = request(2200, dict.fromkeys((b.url for b in fleet), 2000), Conversation("session:new", shared_tokens=2000))
    new.session_key = "new"
    assert cache_aware.choose(new, fleet).backend != "http://b0"
    # A prefix only b0 holds (a system prompt) still groups the session there.
    grouped = request(2200, {"http://b0": 2000}, Conversation("session:grouped", shared_tokens=2000))
    grouped.session_key = "grouped"
    assert cache_aware.choose(grouped, fleet).backend == "http://b0"


def test_a_prefix_held_in_one_place_does_not_gather_every_session_there() -> None:
    """Sessions sharing one tool list, paced so that none is in flight when the next starts:
    the replica holding the list is cheapest for each first turn, but past the load bound
    counted in conversations (4 + 1 > 2 x (0 + 2)) the next session computes the list
    elsewhere instead of joining a cache its histories will overflow."""
    fleet = backends(2)
    working_sets = WorkingSets()
    cache_aware = policy(working_sets)
    placed = []
    for number in range(6):
        new = request(2500, {"http://b0": 2272}, Conversation(f"session:{number}", shared_tokens=2272))
        new.session_key = str(number)
        url = cache_aware.choose(new, fleet).backend
        working_sets.record(new.conversation, url, 2500, None)
        placed.append(url)
    assert placed[:4] == ["http://b0"] * 4 and placed[4] == "http://b1"


def test_a_conversation_moves_only_when_the_move_pays_for_its_history_with_margin() -> None:
    """Leaving home costs the history re-prefilled plus MOVE_MARGIN times it: a queue
    advantage a little over the history keeps it home; three times the history moves it."""
    history = 4000
    home = Conversation("session:h", backend="http://b0", turns=3)
    for advantage, expected in ((1.5 * history, "http://b0"), (3.5 * history, "http://b1")):
        fleet = backends(2)
        _queue(fleet[0], 1, int(advantage / 0.5))  # load weight 0.5, divided by 1 + busy (0.5)
        fleet[0].in_flight_work_tokens = int(advantage * 1.5 / 0.5)
        returning = request(5000, {"http://b0": history}, home)
        assert policy().choose(returning, fleet).backend == expected


def test_cold_prompts_on_a_busy_fleet_still_go_to_the_least_loaded_backend() -> None:
    fleet = backends(3)
    _queue(fleet[0], 12, 120_000)
    _queue(fleet[1], 10, 100_000)
    _queue(fleet[2], 11, 110_000)
    assert policy().choose(request(5000), fleet).backend == "http://b1"


def test_the_engines_own_waiting_queue_counts_as_load() -> None:
    fleet = backends(2)
    cache_aware = policy()
    # Teach the policy the size of an average request, then show an engine queue of 10.
    for _ in range(50):
        cache_aware.choose(request(2000, output=0), backends(2))
    fleet[0].engine_waiting = 10
    decision = cache_aware.choose(request(3000, {"http://b0": 2000}), fleet)
    assert decision.backend == "http://b1"


def test_overload_diverts_and_affinity_returns_when_load_falls() -> None:
    fleet = backends(3)
    cache_aware = policy(overload_factor=2.0)
    asked = request(8000, {"http://b0": 7900})
    fleet[0].in_flight = 9  # 9 + 1 > 2 * (0 + 4): over the bound, however long the match
    diverted = cache_aware.choose(asked, fleet)
    assert diverted.backend != "http://b0" and diverted.reason == "overload"
    fleet[0].in_flight = 7  # 7 + 1 > 2 * (0 + 4) is false: a slight imbalance
    returned = cache_aware.choose(asked, fleet)
    assert (returned.backend, returned.reason) == ("http://b0", "prefix_match")


def test_a_client_with_8_in_flight_is_never_diverted_from_the_prefix_holder() -> None:
    """vLLM's prefix_repetition client at concurrency 8 on two replicas: the holder of a
    document with 6 of the 8 requests is not overloaded (6 + 1 > 2 x (1 + 4) is false);
    with a floor of 2 it was, and each diversion re-prefilled the document elsewhere."""
    fleet = backends(2)
    fleet[0].in_flight, fleet[1].in_flight = 6, 1
    decision = policy(overload_factor=2.0).choose(request(1088, {"http://b0": 1024}), fleet)
    assert (decision.backend, decision.reason) == ("http://b0", "prefix_match")


def test_when_every_backend_is_over_the_bound_the_cheapest_still_serves() -> None:
    fleet = backends(1)
    fleet[0].in_flight = 50
    assert policy().choose(request(100), fleet).backend == "http://b0"


# --- capacity-aware placement -----------------------------------------------------------


def test_new_conversation_goes_where_its_history_will_fit() -> None:
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    for key in ("a", "b", "c"):
        settle(working_sets, key, "http://b0", 3000)  # b0: 9K of 10K
    newcomer = working_sets.find("new", [], 0)
    decision = CacheAware(working_sets).choose(request(3000, conversation=newcomer), fleet)
    assert decision.backend == "http://b1"


def test_capacity_term_can_beat_a_shared_prefix_match() -> None:
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    for key in ("a", "b", "c"):
        settle(working_sets, key, "http://b0", 3000)
    newcomer = working_sets.find("new", [], 0)
    # b0 holds a 1000-token system prompt; continuing there would evict 3 x 2000 tokens a round.
    decision = CacheAware(working_sets).choose(request(3000, {"http://b0": 1000}, conversation=newcomer), fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "capacity")


def test_conversation_that_outgrew_its_backend_moves_once_relief_pays() -> None:
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    mover = settle(working_sets, "mover", "http://b0", 3000)
    for key in ("a", "b", "c"):
        settle(working_sets, key, "http://b0", 3000)  # b0: 12K of 10K, loses 8K a round
    assert working_sets.demand("http://b0") == (12_000, 4)
    # Its history is mostly gone from b0 already (LRU); staying would keep b0 thrashing.
    decision = CacheAware(working_sets).choose(request(3200, {"http://b0": 1000}, conversation=mover), fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "capacity")


def test_conversation_that_fits_stays_home_even_with_a_match_elsewhere() -> None:
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    home = settle(working_sets, "home", "http://b0", 3000)
    decision = CacheAware(working_sets).choose(
        request(3300, {"http://b0": 3000, "http://b1": 1000}, conversation=home), fleet
    )
    assert (decision.backend, decision.reason) == ("http://b0", "prefix_match")


def test_a_backend_whose_engine_evicts_nothing_unforeseen_keeps_its_conversations() -> None:
    """The ledger puts b0 over its cache, but b0's answers held every prediction (sessions
    that ended hold the blocks its LRU evicts): the thrash estimate counts for nothing there,
    so the conversation stays with its history. Once b0's answers show evictions, it moves."""
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    mover = settle(working_sets, "mover", "http://b0", 3000)
    for key in ("a", "b", "c"):
        settle(working_sets, key, "http://b0", 3000)
    quiet = request(3200, {"http://b0": 1000}, conversation=mover)
    quiet.eviction_rates = {"http://b0": 0.0, "http://b1": 0.0}
    assert CacheAware(working_sets).choose(quiet, fleet).backend == "http://b0"
    evicting = request(3200, {"http://b0": 1000}, conversation=mover)
    evicting.eviction_rates = {"http://b0": EVICTION_RATE_FULL, "http://b1": 0.0}
    decision = CacheAware(working_sets).choose(evicting, fleet)
    assert (decision.backend, decision.reason) == ("http://b1", "capacity")


def test_thrash_weight_grows_with_the_eviction_rate_and_trusts_the_model_without_evidence() -> None:
    assert thrash_weight({}, "http://b0") == 1.0
    assert thrash_weight({"http://b0": 0.0}, "http://b0") == 0.0
    assert thrash_weight({"http://b0": EVICTION_RATE_FULL / 2}, "http://b0") == 0.5
    assert thrash_weight({"http://b0": 0.9}, "http://b0") == 1.0


def test_conversations_that_fit_nowhere_gather_on_a_backend_that_thrashes_anyway() -> None:
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    for key in ("a", "b", "c"):
        settle(working_sets, key, "http://b0", 3000)  # b0 fits: 9K
    for key in ("d", "e", "f", "g", "h"):
        settle(working_sets, key, "http://b1", 3000)  # b1 thrashes: 15K
    newcomer = working_sets.find("new", [], 0)
    decision = CacheAware(working_sets).choose(request(3000, conversation=newcomer), fleet)
    assert decision.backend == "http://b1"


def test_overflow_conversations_are_credited_the_recovery_of_a_thrashing_backend() -> None:
    working_sets = WorkingSets()
    fleet = backends(2, capacity=10_000)
    joined = [settle(working_sets, key, "http://b0", 3000) for key in "abcdef"]  # 18K of 10K
    resident, overflow = joined[0], joined[-1]
    # b0 re-prefills all 18K a round until its 3 overflow conversations leave: a third each.
    assert working_sets.relief(overflow, 10_000) == -6000
    assert working_sets.relief(resident, 10_000) == -3000  # what its own departure changes
    # One departure alone does not stop the thrashing, yet the overflow leaves for room elsewhere.
    leaves = CacheAware(working_sets).choose(request(3200, {"http://b0": 2000}, conversation=overflow), fleet)
    assert (leaves.backend, leaves.reason) == ("http://b1", "capacity")
