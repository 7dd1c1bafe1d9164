"""Cache-aware routing: each request to the backend where it costs the fewest tokens of work.

For every eligible backend ``b`` the policy prices the request in prompt tokens
(:meth:`CacheAware.cost_of`):

    cost_b = (prompt - matched_b)      prefill it would do on b
           + weight * queued_b         work in flight on b, net of the part this request shares
           + capacity_b                thrash this placement adds on b, or relief it brings home
           + stay_b                    MOVE_MARGIN x the history a conversation would leave behind

and picks the cheapest backend within the load bound
(:func:`~kvroute.router.routing.policies.base.over_load_bound`; a session's first request
also skips backends more than ``NEW_SESSION_SLACK`` requests busier than the least busy,
over the load bound in conversations hosted, and those hosting more conversations than the
fewest unless they hold more of its prompt; a cold prompt outside sessions, only backends
whose free cache is within ``COLD_ROOM_SLACK`` of its length of the most),
ties to the backend whose index fills the smallest share of its cache, then by rotation.
``weight`` is ``load_weight``, divided by ``1 + mean in-flight requests per candidate`` when
a backend holds at least half the prompt as the request's own history. ``queued_b`` is
``BackendView.in_flight_work_tokens``, plus the engine's own waiting requests beyond this
router's, each counted as an average request. ``capacity_b`` comes from the conversation
ledger's thrash model (``kvroute.router.routing.ledger``).

Knobs: ``load_weight`` (0.5) and ``overload_factor`` (2.0) in ``Settings``, the backends'
cache sizes (``capacity_tokens``, configured or scraped), and :data:`MOVE_MARGIN`,
:data:`NEW_SESSION_SLACK` and :data:`REQUESTS_FLOOR` below. Why each term is there, how
the knobs were chosen and the measurements behind them: ``docs/cost-model.md``.

Reasons (``x-kvroute-reason``, :func:`reason_for`): ``prefix_match`` (the chosen backend
holds the longest match), ``cold_spread`` (no backend holds any of the prompt),
``least_cost`` (load outweighed a longer match elsewhere), ``capacity`` (the capacity term
changed the choice), ``overload`` (the cheapest backend was over the load bound).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Self

from kvroute.router.routing.ledger import Conversation, WorkingSets
from kvroute.router.routing.policies.base import (
    BackendView,
    CandidateCost,
    Decision,
    Explanation,
    Policy,
    PolicyContext,
    RouteRequest,
    over_load_bound,
)

#: Weight of the newest request in the running mean of request work (for engine queues).
_WORK_EWMA_WEIGHT = 0.05
#: A conversation that has a home pays, on any other backend, this many times the history
#: it would re-prefill there on top of the prefill itself: it moves only when that pays.
MOVE_MARGIN = 2.0
#: A session's first request goes only to a backend at most this many requests busier than
#: the least busy one.
NEW_SESSION_SLACK = 1
#: The load bound's floor in requests in flight: against idle peers a backend takes up to
#: ``overload_factor x REQUESTS_FLOOR`` requests (8 at the default factor) before it is over.
#: A few queued requests cost less than the cold prefill a diversion causes, which the
#: queue term prices in tokens; the bound is for the many cheap requests tokens undercount.
REQUESTS_FLOOR = 4.0
#: A prompt no backend holds any of, outside sessions, goes only to a backend with at most
#: this share of the prompt's length less free cache than the roomiest (within the load
#: bound): its first placement is where its repeats will look for it, and the load of the
#: moment passes. Full caches all have the same (no) room, so then the costs decide.
COLD_ROOM_SLACK = 0.5
#: The ledger's thrash estimate counts in full on a backend once this share of its recent
#: answers showed evictions the index did not foresee; with fewer, in proportion; with none
#: (its engine held every prediction), not at all. Unknown rates count in full.
EVICTION_RATE_FULL = 0.2


#: No conversations counted: the hosted map of a request that does not start a session.
_NO_HOSTED: Mapping[str, int] = MappingProxyType({})


@dataclass(slots=True)
class Pricing:
    """What prices every candidate alike for one request: worked out once per request."""

    prompt: int
    matched: Mapping[str, int]
    computing: Mapping[str, int]
    index_tokens: Mapping[str, int]
    index_capacity_tokens: Mapping[str, int]
    eviction_rates: Mapping[str, float]
    conversation: Conversation | None
    #: The longest match any candidate holds.
    best_match: int
    #: ``load_weight`` as applied: divided when a backend holds the request's own history.
    load_weight: float
    #: Where the conversation lives (counted in that backend's working set), and what
    #: leaving it saves there (<= 0).
    home: str | None
    relief: int
    #: What the backend the conversation last went to holds of this prompt (None: no such backend).
    anchor_match: int | None
    #: A session's first request: it places the whole session, by load first.
    starts_session: bool
    candidates: int
    total_in_flight: int
    least_in_flight: int
    #: For a session's first request: the shortest match any candidate holds, the
    #: conversations each candidate hosts (read once per request), their sum and minimum.
    least_match: int = 0
    hosted: Mapping[str, int] = field(default_factory=dict)
    total_hosted: int = 0
    fewest_hosted: int = 0


@dataclass(slots=True)
class BackendCost:
    """One backend's price for a request, term by term (the module docstring's formula)."""

    backend: BackendView
    matched_tokens: int
    #: Work queued there in tokens, net of what this request shares with it.
    queued_tokens: float
    #: Prefill plus weighted queue: the price without the cache terms.
    plain: float
    #: Thrash the placement adds there, plus (away from home) the relief it brings home.
    capacity: int
    stay: float
    cost: float
    #: Share of its cache the index holds (the tie-break: emptier first).
    fill: float
    over_bound: bool


class CacheAware(Policy):
    """The lowest cost in tokens: uncached prefill + weighted queued work + cache thrash, within a load bound."""

    needs_prefix_match = True

    def __init__(self, working_sets: WorkingSets, *, load_weight: float = 0.5, overload_factor: float = 2.0) -> None:
        self._working_sets = working_sets
        self._load_weight = load_weight
        self._overload_factor = overload_factor
        self._turn = 0
        self._mean_work = 0.0

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        settings = context.settings
        return cls(context.working_sets, load_weight=settings.load_weight, overload_factor=settings.overload_factor)

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        count = len(candidates)
        start = self._turn % count
        self._turn += 1
        pricing = self.pricing(request, candidates)
        # In rotated order, so equal costs and fills go to a rotating start, never index 0.
        cost_of = self.cost_of
        costs = [cost_of(backend, pricing) for backend in candidates[start:]]
        if start:
            costs += [cost_of(backend, pricing) for backend in candidates[:start]]
        eligible = roomiest(costs, pricing) if pricing.best_match == 0 and not pricing.starts_session else costs
        chosen, reason = reason_for(eligible, pricing.best_match)
        self._mean_work += _WORK_EWMA_WEIGHT * (request.work_tokens(chosen.matched_tokens) - self._mean_work)
        if not self.explain:
            return Decision(chosen.backend.url, reason, chosen.matched_tokens)
        terms = tuple(_explained(cost, pricing) for cost in costs)
        return Decision(
            chosen.backend.url, reason, chosen.matched_tokens, Explanation(terms, pricing.load_weight, pricing.home)
        )

    def pricing(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Pricing:
        """The request's side of the formula: its history, home, weight and the fleet's load."""
        prompt = request.prompt_tokens or 0
        matched = request.matched_tokens
        conversation = request.conversation
        home = None
        relief = 0
        if conversation is not None and conversation.counted:
            home = conversation.backend
            for backend in candidates:
                if backend.url == home:
                    relief = self._working_sets.relief(conversation, backend.capacity_tokens)
                    relief = int(relief * thrash_weight(request.eviction_rates, home))
                    break
        count = len(candidates)
        total_in_flight = best_match = 0
        least_in_flight = candidates[0].in_flight if candidates else 0
        for backend in candidates:  # (one pass: this runs for every request)
            in_flight = backend.in_flight
            total_in_flight += in_flight
            if in_flight < least_in_flight:
                least_in_flight = in_flight
            held = matched.get(backend.url, 0)
            if held > best_match:
                best_match = held
        # Its own history: what the backend it last went to holds of this prompt.
        anchor = conversation.backend if conversation is not None and conversation.turns >= 1 else None
        anchor_match = matched.get(anchor, 0) if anchor is not None else None
        starts_session = conversation is not None and conversation.turns == 0 and request.session_key is not None
        # A new session's match is a shared prefix, never its history. Without a session key
        # the ledger may not know a conversation that returns after its idle time, so a
        # backend holding most of the prompt is taken for its history.
        history = 0 if starts_session or _lost_history(conversation, best_match) else best_match
        load_weight = self._load_weight
        if history and 2 * history >= prompt:
            load_weight /= 1.0 + total_in_flight / count
        pricing = Pricing(
            prompt=prompt,
            matched=matched,
            computing=request.computing_tokens,
            index_tokens=request.index_tokens,
            index_capacity_tokens=request.index_capacity_tokens,
            eviction_rates=request.eviction_rates,
            conversation=conversation,
            best_match=best_match,
            load_weight=load_weight,
            home=home,
            relief=relief,
            anchor_match=anchor_match,
            starts_session=starts_session,
            candidates=count,
            total_in_flight=total_in_flight,
            least_in_flight=least_in_flight,
            hosted=_NO_HOSTED,
        )
        if starts_session:
            pricing.least_match = min(matched.get(backend.url, 0) for backend in candidates)
            hosted = pricing.hosted = {backend.url: self._working_sets.hosted(backend.url) for backend in candidates}
            pricing.total_hosted = sum(hosted.values())
            pricing.fewest_hosted = min(hosted.values(), default=0)
        return pricing

    def cost_of(self, backend: BackendView, pricing: Pricing) -> BackendCost:
        """What sending the request to ``backend`` costs, term by term."""
        url = backend.url
        capacity_tokens = backend.capacity_tokens
        matched = pricing.matched.get(url, 0)
        queued = self._queued_tokens(backend)
        shared = pricing.computing.get(url, 0)
        if shared:
            queued = max(0.0, queued - shared)
        plain = pricing.prompt - matched + pricing.load_weight * queued
        cost = plain
        capacity = 0
        conversation = pricing.conversation
        if conversation is not None and capacity_tokens:
            thrash = self._working_sets.placement_cost(conversation, pricing.prompt, url, capacity_tokens)
            if thrash:
                capacity = int(thrash * thrash_weight(pricing.eviction_rates, url))
                cost += capacity
        if pricing.home is not None and url != pricing.home:
            capacity += pricing.relief
            cost += pricing.relief
        anchor_match = pricing.anchor_match
        stay = MOVE_MARGIN * max(0, anchor_match - matched) if anchor_match is not None else 0.0
        cost += stay
        held = pricing.index_tokens.get(url, 0)
        fill = held / capacity_tokens if capacity_tokens else float(held)
        over = over_load_bound(
            backend.in_flight, pricing.total_in_flight, pricing.candidates, self._overload_factor, REQUESTS_FLOOR
        )
        if pricing.starts_session and self._refuses_new_session(backend, matched, pricing):
            over = True
        return BackendCost(backend, matched, queued, plain, capacity, stay, cost, fill, over)

    def _refuses_new_session(self, backend: BackendView, matched: int, pricing: Pricing) -> bool:
        """Whether ``backend`` is too busy to start a session, which brings all its future
        turns: more than NEW_SESSION_SLACK requests busier than the least busy; over the
        load bound counted in the conversations it hosts; or, unless it holds more of the
        prompt than another backend (a prefix the session would share there), hosting more
        conversations than the fewest any backend hosts."""
        if backend.in_flight > pricing.least_in_flight + NEW_SESSION_SLACK:
            return True
        hosted = pricing.hosted[backend.url]
        if over_load_bound(hosted, pricing.total_hosted, pricing.candidates, self._overload_factor):
            return True
        return matched <= pricing.least_match and hosted > pricing.fewest_hosted

    def _queued_tokens(self, backend: BackendView) -> float:
        queued = float(backend.in_flight_work_tokens)
        waiting = backend.engine_waiting
        if waiting is not None and waiting > backend.in_flight:
            queued += (waiting - backend.in_flight) * self._mean_work
        return queued


def _lost_history(conversation: Conversation | None, best_match: int) -> bool:
    """Whether a continuing conversation finds no more than the prefix it began sharing with
    others on any candidate: every cache has evicted its own history."""
    if conversation is None or conversation.turns == 0:
        return False
    return best_match <= conversation.shared_tokens


def thrash_weight(eviction_rates: Mapping[str, float], backend: str) -> float:
    """How much the ledger's thrash estimate counts on ``backend`` (0..1).

    The estimate assumes conversations cycle through an LRU cache in lockstep; with think
    times, sessions that end and arrivals spread out, an engine whose working set the ledger
    puts over its capacity often evicts only blocks nobody asks for again. Its answers say
    which: evictions the index did not foresee show as cached-token shortfalls."""
    rate = eviction_rates.get(backend)
    if rate is None:
        return 1.0
    return min(1.0, rate / EVICTION_RATE_FULL)


def roomiest(costs: Sequence[BackendCost], pricing: Pricing) -> Sequence[BackendCost]:
    """For a cold prompt: the backends within the load bound whose free cache (the capacity
    the index models there, less what it holds) is at most :data:`COLD_ROOM_SLACK` of the
    prompt short of the most any has; all of ``costs`` when none is within the bound or a
    cache size is unknown. The modelled capacity, not the configured one: a backend whose
    engine evicts earlier holds less in its index without having more room."""
    within = [cost for cost in costs if not cost.over_bound]
    capacities = pricing.index_capacity_tokens
    if not within or not all(capacities.get(cost.backend.url) for cost in within):
        return costs
    room = [capacities[cost.backend.url] - pricing.index_tokens.get(cost.backend.url, 0) for cost in within]
    enough = max(room) - COLD_ROOM_SLACK * pricing.prompt
    return [cost for cost, free in zip(within, room, strict=True) if free >= enough]


def reason_for(costs: Sequence[BackendCost], best_match: int) -> tuple[BackendCost, str]:
    """The choice among ``costs`` (in rotated order) and its reason.

    The cheapest within the load bound, or, when every backend is over it, the cheapest of
    all. ``best_match``: the longest match any candidate holds.
    """
    cheapest = _cheapest(costs)
    # Usually no backend is over the bound and no cache term is set: then one pass decides.
    within = [cost for cost in costs if not cost.over_bound] if any(c.over_bound for c in costs) else costs
    if within:
        chosen = cheapest if within is costs else _cheapest(within)
        if chosen is not cheapest:
            return chosen, "overload"
        for cost in within:
            if cost.cost != cost.plain:
                if chosen is not _cheapest(within, plain=True):
                    return chosen, "capacity"
                break
    else:
        chosen = cheapest
    if best_match == 0:
        return chosen, "cold_spread"
    return chosen, "prefix_match" if chosen.matched_tokens == best_match else "least_cost"


def _cheapest(costs: Sequence[BackendCost], *, plain: bool = False) -> BackendCost:
    """The lowest cost (or plain cost), then the emptiest cache, then the first in order."""
    best = costs[0]
    best_price = best.plain if plain else best.cost
    for cost in costs[1:]:
        price = cost.plain if plain else cost.cost
        if price < best_price or (price == best_price and cost.fill < best.fill):
            best, best_price = cost, price
    return best


def _explained(cost: BackendCost, pricing: Pricing) -> CandidateCost:
    """One candidate's terms for the decision record (rounded: a log line, not a ledger)."""
    return CandidateCost(
        backend=cost.backend.url,
        matched_tokens=cost.matched_tokens,
        prefill=pricing.prompt - cost.matched_tokens,
        queued_tokens=round(cost.queued_tokens, 1),
        queue=round(pricing.load_weight * cost.queued_tokens, 1),
        capacity=round(cost.capacity, 1),
        stay=round(cost.stay, 1),
        cost=round(cost.cost, 1),
        in_flight=cost.backend.in_flight,
        over_bound=cost.over_bound,
    )
