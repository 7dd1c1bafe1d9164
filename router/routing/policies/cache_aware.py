"""Cache-aware routing: send each request where it costs the fewest tokens of work.

For every eligible backend ``b`` the policy prices the request in prompt tokens:

    cost_b = (prompt - matched_b)               prefill it would do on b
           + weight * queued_b                  work already waiting on b
           + capacity_b                          prefill this placement makes other turns redo
           + stay_b                              margin a conversation's move must pay

and picks the cheapest backend that is not overloaded. One currency for all three terms is
what lets a 20K-token match beat a short queue and a long queue beat a 200-token match,
without a threshold that switches between "cache mode" and "load mode" (the SGLang
router's rule, which throws affinity away whenever load is a little uneven).

``matched_b``
    Leading prompt tokens the router's prefix index believes ``b`` holds (whole blocks).
    After each decision the routing engine inserts the request's blocks for the chosen
    backend, so a burst of siblings co-locates before the first one completes.

``queued_b``
    The work this router has in flight on ``b``: for each request routed there and not
    yet finished, its predicted *uncached* prompt tokens plus its expected output tokens
    (``BackendView.in_flight_work_tokens``; a cached prefix is no work,
    so counting whole prompts would make a replica that serves long cached histories look
    busy and chase conversations away from their caches). Plus, when the engine's
    ``/metrics`` were scraped, the requests waiting in the engine beyond those this router
    knows of (``engine_waiting - in_flight``: other clients or router replicas), each
    counted as one average request of this router. Minus the part of this request's match
    that requests in flight on ``b`` are still computing: a sibling sent behind a request
    that is prefilling their shared prefix shares that work instead of waiting for it (it
    would compute the same prefix anywhere else), so a burst of siblings co-locates.

``weight``
    Tokens of prefill one token of queued work costs: ``load_weight``, divided by
    ``1 + busy`` (``busy``: the mean in-flight requests per candidate) when some backend
    holds at least half the prompt: the request's own history -- unless the request is a
    new session's first, whose match is a shared prefix (tools, a system prompt) however
    long, never its history (without a session key the ledger cannot tell a new
    conversation from one that returns after its idle time, so the rule keeps to
    session keys; on the Mooncake trace, which has none, applying it to every "new"
    conversation of the ledger cost 0.002-0.008 of hit rate offline). With a 2.3K-token
    tool list in a 2.5K-token first turn, 16 agent sessions starting together piled onto
    two of four replicas at reduced weight and had to move, history and all, a turn
    later (offline replay of ``kvroute bench``'s defaults: 0.756 of prompt tokens cached
    against round robin's 0.796). Leaving its home trades a delay that only this request suffers
    for prefill that the fleet carries: on average ``busy`` requests wait behind each
    backend's work, later ones queue behind the re-prefilled history, and its second copy
    takes cache space from others. So the deeper the fleet's queues, the less a token of
    queue weighs against a history: under deep queues, whose lengths differ by several
    long prompts by pure chance, a conversation leaves its home only for a backend that is
    busy *relative to the others*; on an idle fleet nothing changes. When no backend holds
    most of the prompt (a cold prompt, or one that shares only a system prompt or tool
    list) the weight stays whole: a new conversation's placement decides where its later
    turns go, so spreading new conversations by load is worth more than a short shared
    prefix (with the division there too, 8 agent sessions piled onto two replicas and 16
    leaned onto two: 93 % of the unbounded-cache hit rate instead of 98-99 %). Without the division,
    on the Mooncake conversation trace (13.7K-token prompts, most of them cold, 4 replicas
    of 1M tokens) the policy traded returning conversations' 5-30K-token histories for a
    queue one or two cold prompts shorter, more often the busier the fleet: offline
    replays of its first 2,000 requests through this policy (FCFS prefill at 30K tokens/s
    per replica, LRU caches) kept 0.178, 0.160 and 0.159 of prompt tokens cached at 1x, 2x
    and 3x slower prefill (deeper queues); with it 0.182 and 0.179 at 1x and 3x, TTFT p50
    equal or lower; one unbounded cache keeps 0.294. vllm-router, which leaves the best
    match only when loads differ by more than 64 requests and 1.5x, kept 0.185 on the
    real fleet.

``stay_b``
    Hysteresis: a conversation with a home pays, on any other backend, ``MOVE_MARGIN``
    (2) times the history it would re-prefill there, on top of that prefill itself. The
    re-prefill is not the only price of a move: the moved history's second copy takes
    cache from others, and under desynchronised arrivals (think time) queues differ by a
    request or two by pure chance, so without a margin conversations drifted between
    replicas at scattered turns and lost their histories each time (agent sessions with
    think time and multi-turn chats: 0.781 and 0.540 of prompt tokens cached against
    0.791 and 0.568 for session pinning; with the margin 0.795 and 0.567). It still
    leaves an overloaded home, and the capacity term still moves it when relief pays.

``capacity_b``
    What the placement does to the replicas' caches. :class:`WorkingSets` records where
    each conversation (a session key, or a chain of prompts each extending the last)
    lives and how many tokens of its own it keeps cached (from its second request on, so
    one-off requests never count). A backend whose conversations need more than its
    cache holds (``D > C``) thrashes: LRU with tail-first eviction over conversations
    taking turns takes up to the overflow ``O = D - C`` from each of its ``n``
    conversations every round, ``loss(D, n) = min(D, n * O)`` tokens re-prefilled per
    round (exact for equal sizes). ``capacity_b`` is the change of that loss if the
    request's conversation continues on ``b``, plus, when it would leave its home, the
    home's relief: the conversations that joined the home first and fit are its
    residents, the later ones its overflow; each overflow conversation is credited an
    equal share of the home's loss (the home recovers only once all of them are gone), a
    resident what its own departure changes. So new conversations go where there is
    room; the overflow of a thrashing backend leaves first and its residents stay; and
    conversations that fit nowhere gather on a backend that thrashes anyway (one more
    there costs only its own tokens) instead of making every replica thrash -- the
    lockstep case where every peer router keeps 0.33-0.43 of prompt tokens cached against
    0.80 for one big cache. The horizon is one round: a conversation moves when one
    round of relief pays for its re-prefill, which keeps placements from flapping.
    Capacity is ``BackendView.capacity_tokens`` (configured, or scraped from
    ``vllm:cache_config_info``); unknown capacity means no capacity term.

Overload. A backend is skipped (unless every candidate is) when
``in_flight_b + 1 > overload_factor * (mean in_flight of the other candidates + 2)``:
counted in requests, because a long cached prefix can make hundreds of cheap requests
look like little work in tokens while they share one replica's batch. The ``+ 2`` keeps
a few requests on an otherwise idle fleet from counting as overload (with the default
factor 2, a backend is over the bound from 4 requests against idle peers, 12 against
peers with 4 each). When the load falls back under the bound the cost decides again, so
affinity returns by itself.

New sessions. A session's first request (a session key the ledger has not seen) places
the whole session: it goes only to a backend at most ``NEW_SESSION_SLACK`` (1) requests
busier than the least busy one, so a burst of sessions sharing a system prompt spreads by
load instead of queueing behind the replica computing that prefix (a request sent behind
a sibling that computes its prefix is priced as sharing that work, which is right for a
one-off sibling and wrong for a session that will come back for eight turns). Staggered
sessions on an idle fleet still gather where the shared prefix is.

Ties (equal cost: typically a cold prompt on an idle fleet) go to the backend whose index
holds the smallest share of its cache, then to a rotating start, so cold prefixes spread
and never pile onto replica 0.

Knobs (``Settings``), and how their defaults were chosen:

``load_weight`` (0.5)
    Tokens of prefill one token of queued work costs (``weight`` above). Measured,
    before the division by ``1 + busy``, with
    ``benchmarks/compare_policies.py`` (4 sim replicas of 48K tokens; two or three runs
    per value on a busy 2-core machine): where the working set fits the fleet, 0.5 and
    1.0 both reach 96-99 % of the unbounded-cache hit rate (0.25 once fell to 88 % on 8
    agent sessions, piling them on two replicas early). With 16 and 24 agent sessions
    (1.6x and 2.4x the fleet's cache) 0.5 keeps more cached, 0.64-0.65 and 0.39-0.42
    against 0.55-0.58 and 0.33-0.34 for 1.0 (round robin and sticky: 0.47 and 0.36-0.37),
    by packing the overflow onto fewer replicas within the load bound; the price was a
    TTFT p99 1.4-2.3x as long in those oversubscribed runs (at 20x simulated speed, where
    the router's and the sims' own CPU time is a large part of TTFT). Raise it towards 1.0
    when tail latency matters more than cache hits.
``overload_factor`` (2.0)
    How much busier than the others a backend may be before it is skipped: the bound
    that caps how unevenly affinity and capacity packing may load the replicas.
``default_capacity_tokens`` / per-backend ``capacity_tokens``
    The KV cache sizes, when the engines' ``/metrics`` do not say.

Reasons (``x-kvroute-reason``): ``prefix_match`` (the chosen backend holds the longest
match), ``cold_spread`` (no backend holds any of the prompt), ``least_cost`` (load
outweighed a longer match elsewhere), ``capacity`` (the capacity term changed the
choice), ``overload`` (the cheapest backend was over the load bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

from kvroute.router.routing.ledger import WorkingSets
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


class CacheAware(Policy):
    """The lowest cost in tokens: uncached prefill + weighted queued work + cache thrash, within a load bound."""

    needs_prefix_match = True

    def __init__(
        self,
        working_sets: WorkingSets,
        *,
        load_weight: float = 0.5,
        overload_factor: float = 2.0,
    ) -> None:
        self._working_sets = working_sets
        self._load_weight = load_weight
        self._overload_factor = overload_factor
        self._turn = 0
        self._mean_work = 0.0

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        settings = context.settings
        return cls(
            context.working_sets,
            load_weight=settings.load_weight,
            overload_factor=settings.overload_factor,
        )

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        prompt = request.prompt_tokens or 0
        matched = request.matched_tokens
        conversation, computing, held = request.conversation, request.computing_tokens, request.index_tokens
        working_sets = self._working_sets
        count = len(candidates)
        start = self._turn % count
        self._turn += 1

        relief = 0
        home = None
        if conversation is not None and conversation.counted:
            home = conversation.backend
            for backend in candidates:
                if backend.url == home:
                    relief = working_sets.relief(conversation, backend.capacity_tokens)
                    break

        total_in_flight = sum(backend.in_flight for backend in candidates)
        best_match = max((matched.get(backend.url, 0) for backend in candidates), default=0)
        overload_factor = self._overload_factor
        load_weight = self._load_weight
        # Its own history: what the backend it last went to holds of this prompt.
        anchor = conversation.backend if conversation is not None and conversation.turns >= 1 else None
        anchor_match = matched.get(anchor, 0) if anchor is not None else 0
        # A session's first request places the whole session: by load first, prefix second.
        starts = conversation is not None and conversation.turns == 0 and request.session_key is not None
        # A new session's match is a shared prefix, never its history. Without a session key
        # the ledger may not know a conversation that returns after its idle time, so a
        # backend holding most of the prompt is taken for its history.
        history = 0 if starts else best_match
        if history and 2 * history >= prompt:  # the request's own history lives there
            load_weight /= 1.0 + total_in_flight / count
        least_in_flight = min(backend.in_flight for backend in candidates)
        best_any: tuple[float, float, int] | None = None
        best_fit: tuple[float, float, int] | None = None
        best_plain: tuple[float, float, int] | None = None
        chosen_any = chosen_fit = chosen_plain = candidates[start]
        terms: list[CandidateCost] | None = [] if self.explain else None
        for offset in range(count):
            backend = candidates[(start + offset) % count]
            url = backend.url
            capacity = backend.capacity_tokens
            queued = max(0.0, self._queued_tokens(backend) - computing.get(url, 0))
            plain = prompt - matched.get(url, 0) + load_weight * queued
            cost = plain
            if conversation is not None and capacity:
                cost += working_sets.placement_cost(conversation, prompt, url, capacity)
            if home is not None and url != home:
                cost += relief
            stay = MOVE_MARGIN * max(0, anchor_match - matched.get(url, 0)) if anchor is not None else 0.0
            cost += stay
            fill = held.get(url, 0) / capacity if capacity else float(held.get(url, 0))
            key = (cost, fill, offset)
            if best_any is None or key < best_any:
                best_any, chosen_any = key, backend
            over = over_load_bound(backend.in_flight, total_in_flight, count, overload_factor)
            if starts and backend.in_flight > least_in_flight + NEW_SESSION_SLACK:
                over = True
            if terms is not None:
                terms.append(_terms(backend, matched.get(url, 0), prompt, queued, load_weight, plain, stay, cost, over))
            if over:
                continue
            if best_fit is None or key < best_fit:
                best_fit, chosen_fit = key, backend
            plain_key = (plain, fill, offset)
            if best_plain is None or plain_key < best_plain:
                best_plain, chosen_plain = plain_key, backend

        chosen = chosen_fit if best_fit is not None else chosen_any
        chosen_match = matched.get(chosen.url, 0)
        if chosen is not chosen_any:
            reason = "overload"
        elif best_fit is not None and chosen is not chosen_plain:
            reason = "capacity"
        elif best_match == 0:
            reason = "cold_spread"
        elif chosen_match == best_match:
            reason = "prefix_match"
        else:
            reason = "least_cost"
        work = request.work_tokens(chosen_match)
        self._mean_work += _WORK_EWMA_WEIGHT * (work - self._mean_work)
        explanation = None if terms is None else Explanation(tuple(terms), load_weight, home)
        return Decision(chosen.url, reason, chosen_match, explanation)

    def _queued_tokens(self, backend: BackendView) -> float:
        queued = float(backend.in_flight_work_tokens)
        waiting = backend.engine_waiting
        if waiting is not None and waiting > backend.in_flight:
            queued += (waiting - backend.in_flight) * self._mean_work
        return queued


def _terms(
    backend: BackendView,
    matched: int,
    prompt: int,
    queued: float,
    weight: float,
    plain: float,
    stay: float,
    cost: float,
    over: bool,
) -> CandidateCost:
    """One candidate's cost terms for the explanation (rounded: a log line, not a ledger)."""
    return CandidateCost(
        backend=backend.url,
        matched_tokens=matched,
        prefill=prompt - matched,
        queued_tokens=round(queued, 1),
        queue=round(weight * queued, 1),
        capacity=round(cost - plain - stay, 1),
        stay=round(stay, 1),
        cost=round(cost, 1),
        in_flight=backend.in_flight,
        over_bound=over,
    )
