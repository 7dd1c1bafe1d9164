"""The routing engine: request body -> routing decision, and feedback afterwards.

The proxy calls :meth:`RoutingEngine.route` once per attempt with the eligible backends,
and :meth:`RoutingEngine.observe` once per attempt when it finished, with the engine's
``usage.prompt_tokens_details.cached_tokens`` (None when the engine reported none).
Synchronous and free of I/O. It owns the policies, and -- when a policy that reads
prefixes is configured -- the tokenizers, the prefix index and the conversation ledger.

One request, when prefixes are tracked:

1. **prepare**: tokenize the body as the engine will (the model's chat template,
   incremental) and hash its full blocks, salted with the model name (which also names a
   LoRA adapter) and the body's ``cache_salt``. Pure CPU and thread-safe: a proxy may run
   :meth:`RoutingEngine.prepare` in a worker thread for huge prompts and pass the result.
2. **match**: one walk of the prefix index gives every backend's cached prefix. Engines
   always compute a prompt's last token, so a prediction is capped at the whole blocks
   before it, as vLLM reports ``cached_tokens``.
3. **choose**: the request's policy (``--policy``, or its A/B arm, or the
   ``x-kvroute-policy`` header when ``allow_policy_header``) picks a backend. A request
   that cannot be tokenized (``/v1/embeddings``, a malformed chat) goes to the least
   loaded backend with reason ``fallback``.
4. **learn**: the request's blocks are inserted for the chosen backend right away, so
   siblings arriving before it completes co-locate with it, and its conversation is
   recorded in the ledger of working sets. A caller on an event loop may ask for a huge
   prompt's blocks in slices (``sliced=True``, :class:`PendingInsert`): the proxy inserts
   them a slice per loop turn before the request goes upstream.

Feedback: after a response the engine holds every full block of the prompt (it has just
computed them), so the index holds them too. When the engine reports fewer cached tokens
than the router predicted from blocks that *completed* requests put in the index, the
router's model of that engine's cache was too optimistic (a smaller cache than configured,
running requests' blocks, other clients): :class:`kvroute.router.routing.cache_model.CacheModel` lowers
the capacity the index models for that backend, and the prompt's blocks are touched again
rather than deleted. Blocks that requests still in flight inserted are excluded from that
test: a sibling routed behind a request that is still prefilling the shared prefix misses
by design, and that is no evidence of drift. Backends whose matches come from KV events
(precise mode) are left to their events.

Block size: ``models[name].block_size``, else ``--block-size``, else the engines' own
(scraped from ``vllm:cache_config_info``), else 16. Capacity per backend:
``BackendView.capacity_tokens`` (configured or scraped); unknown capacity bounds the
index at :data:`UNKNOWN_CAPACITY_TOKENS` per backend so memory stays bounded.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from kvroute.router.config import Settings
from kvroute.router.engines import endpoint_for
from kvroute.router.engines.openai import RESPONSES, continued_response
from kvroute.router.fleet.engine_stats import EngineStats
from kvroute.router.routing import request_info, sliced_insert
from kvroute.router.routing.cache_model import CacheModel
from kvroute.router.routing.computing import ComputingBlocks, FirstNew
from kvroute.router.routing.decisions import RING_SIZE, DecisionRecorder
from kvroute.router.routing.kv_events import KVEventsState
from kvroute.router.routing.ledger import Conversation, WorkingSets
from kvroute.router.routing.peer_evidence import Answers
from kvroute.router.routing.peer_exchange import Placement
from kvroute.router.routing.policies import (
    POLICIES,
    BackendView,
    Decision,
    LeastLoad,
    Policy,
    PolicyContext,
    RouteRequest,
    TrafficSplit,
    make_policy,
)
from kvroute.router.routing.policies.simple import load_of
from kvroute.router.routing.precise_index import PreciseHashes, PreciseIndex
from kvroute.router.routing.sliced_insert import PendingInsert, insert_blocks
from kvroute.router.routing.stored_responses import StoredResponses
from kvroute.tokenizer_index import PrefixIndex, RequestTokenizer
from kvroute.tokenizer_index.hashing import block_hashes, request_salt
from kvroute.tokenizer_index.hf_files import load_chat_template

log = logging.getLogger("kvroute.routing")

DEFAULT_BLOCK_SIZE = 16
#: Index bound per backend whose cache size nobody told us (2M tokens: ~130K blocks of 16).
UNKNOWN_CAPACITY_TOKENS = 1 << 21
#: Request header that forces a policy when ``allow_policy_header`` is on.
POLICY_HEADER = "x-kvroute-policy"
FALLBACK_REASON = "fallback"
#: A Responses request continuing an answer, sent to the backend that stored it.
STORED_RESPONSE_REASON = "stored_response"
#: A stored response's own call (``GET /v1/responses/{id}``...) where this router does not
#: know which backend stored it: the least loaded first, the others after its 404.
SEARCH_REASON = "search"
#: The policy label of a stored response's own calls, and of continuations sent to the
#: backend that stored the response: no policy chooses them.
STORED_RESPONSE_POLICY = "stored_response"


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A request's prompt as the prefix index sees it."""

    tokens: int
    #: Chained hashes of its full blocks (uint64), salted by model and ``cache_salt``.
    hashes: np.ndarray
    block_size: int
    #: The same prompt hashed for the precise index (``--kv-events``), else None.
    precise: PreciseHashes | None = None
    _hash_list: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def hash_list(self) -> list[int]:
        """The hashes as Python ints, converted on first use and kept.

        Only the conversation ledger's walk along a prompt chain reads them all (as dict
        keys); a request with a session key never converts them, and a retry reuses them.
        The conversion is not free: ~1 us for 25 blocks, ~250 us for a 100K-token prompt.
        """
        hashes = self._hash_list
        if hashes is None:
            hashes = self.hashes.tolist()
            object.__setattr__(self, "_hash_list", hashes)  # a cache: frozen for everything else
        return hashes

    @property
    def cacheable_tokens(self) -> int:
        """The most an engine reports cached: whole blocks, never the one holding the last
        token (an engine computes it even when all of the prompt is cached)."""
        return (self.tokens - 1) // self.block_size * self.block_size

    def convert_hashes(self) -> None:
        """Convert the hashes to :attr:`hash_list` now, :data:`INSERT_SLICE_BLOCKS` at a time.

        For a huge prompt prepared in a worker thread: each slice is one call that holds the
        GIL ~0.3 ms, where converting 62K hashes at once on the event loop holds it ~2 ms.
        """
        if self._hash_list is not None:
            return
        hashes: list[int] = []
        step = sliced_insert.INSERT_SLICE_BLOCKS
        for start in range(0, len(self.hashes), step):
            hashes += self.hashes[start : start + step].tolist()
        object.__setattr__(self, "_hash_list", hashes)

    def hash_at(self, position: int) -> int:
        """One block's hash as a Python int, without converting the others.

        The routing engine reads single blocks (the first one a request adds, the last one,
        those in-flight requests started computing): a handful per request.
        """
        hashes = self._hash_list
        return hashes[position] if hashes is not None else self.hashes.item(position)  # type: ignore[no-any-return]


@dataclass(slots=True)
class RoutePlan:
    """One routing decision with what the proxy needs to report and learn from it."""

    decision: Decision
    policy: str
    request: RouteRequest
    prompt: PreparedPrompt | None = None
    #: The part of the prediction that completed requests put in the index.
    confirmed_cached_tokens: int = 0
    #: The same, as the router's own model of the backend's cache (the approximate index)
    #: predicted it: on a backend whose KV events predict exactly, the engine's report
    #: checks this model (its capacity, its eviction rate) instead.
    modelled_cached_tokens: int = 0
    serial: int = 0
    #: Set by ``route(sliced=True)`` for a prompt of more than INSERT_SLICE_BLOCKS blocks
    #: until :meth:`RoutingEngine.learn_slice` has inserted the rest: into the index, and
    #: into the precise index's speculative layer where KV events are on.
    pending_inserts: tuple[PendingInsert, ...] = ()

    @property
    def backend(self) -> str:
        return self.decision.backend

    @property
    def reason(self) -> str:
        return self.decision.reason

    @property
    def predicted_cached_tokens(self) -> int:
        return self.decision.matched_tokens

    @property
    def work_tokens(self) -> int:
        """The load this attempt puts on its backend: uncached prompt plus expected output
        tokens. The proxy counts it in ``Backend.in_flight_work_tokens`` while the attempt runs."""
        return self.request.work_tokens(self.predicted_cached_tokens)


@dataclass(slots=True)
class FeedbackStats:
    """Totals of :meth:`RoutingEngine.observe`, for tests and the decision log."""

    observed: int = 0
    predicted_tokens: int = 0
    observed_tokens: int = 0
    #: Requests where the engine had fewer tokens than completed requests had put in the index.
    drifts: int = 0
    #: Drifts that lowered a backend's modelled capacity.
    capacity_corrections: int = 0


@dataclass(frozen=True, slots=True)
class CacheModelState:
    """One backend's cache model, for ``kvroute_cache_model_*``."""

    #: The share of its configured cache the model counts on (None: no capacity configured).
    capacity_ratio: float | None
    #: The recent share of answers that showed an eviction (None before the first).
    eviction_rate: float | None
    answers_held: int
    answers_evicted: int


@dataclass(frozen=True, slots=True)
class ConversationMemoState:
    """One of the tokenizers' conversation memos (rendered texts, or ids), summed over the
    tokenizers, for ``kvroute_conversation_memo_*``."""

    bytes: int
    max_bytes: int
    entries: int
    #: Long chats that looked for their conversation's last turn, and those that found it.
    lookups: int
    continued: int


@dataclass(frozen=True, slots=True)
class RoutingIndexStats:
    """Size of the routing engine's indexes (every block size, and the precise index), for
    ``kvroute_index_blocks{backend}`` and ``kvroute_index_bytes``."""

    blocks: dict[str, int] = field(default_factory=dict)
    bytes: int = 0


def _tokenize(tokenizer: RequestTokenizer, endpoint: str, body: Mapping[str, Any]) -> np.ndarray | None:
    """The prompt token ids the engine will compute (int64), or None when this router cannot
    tell: the endpoint's engine module knows how its prompt is written (kvroute.router.engines)."""
    proxied = endpoint_for(endpoint)
    read = proxied.prompt if proxied is not None else None
    return read(tokenizer, body) if read is not None else None


class RoutingEngine:
    """Chooses a backend per request and learns from the engines' answers; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        precise: PreciseIndex | None = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        # Precise mode: matches come from the engines' KV events where a stream is live.
        self._precise = precise
        self._working_sets = WorkingSets(clock=clock)
        self._split = TrafficSplit(settings.ab) if settings.ab else None
        self._default_label = self._split.labels[0] if self._split else settings.policy
        self._policies: dict[str, Policy] = {}
        self._fallback = LeastLoad()
        self._stored_responses = StoredResponses(settings.stored_responses)
        # By (tokenizer source, chat template, default template keywords as JSON).
        self._tokenizers: dict[tuple[str | None, str | None, str | None], RequestTokenizer] = {}
        self._model_tokenizers: dict[str | None, RequestTokenizer] = {}  # see _tokenizer_for
        self._tracking = False
        # Explained decisions for --decision-log and, with the admin API, GET /admin/decisions.
        self.decisions = DecisionRecorder(log=settings.decision_log, ring_size=RING_SIZE if settings.admin_token else 0)
        for label in self._split.labels if self._split else [settings.policy]:
            self._policy(label)
        # Prefix tracking state.
        self._engine_block_sizes: dict[str, int] = {}
        self._indexes: dict[int, PrefixIndex] = {}
        self._capacities: dict[tuple[int, str], int] = {}
        # Per block size, what its index's capacities were last applied from: the cache
        # model's version and the candidates' configured sizes (most requests change neither).
        self._applied: dict[int, tuple[int, list[tuple[str, int | None]]]] = {}
        # Per backend its configured capacity (tokens) and the share of it the index models.
        self._configured_tokens: dict[str, int] = {}
        self.cache_model = CacheModel()
        self._placement_listener: Callable[[Placement], None] | None = None
        self._answer_listener: Callable[[str, bool], None] | None = None
        self._stored_listener: Callable[[str, str], None] | None = None
        # Blocks requests in flight (this router's, its peers') are still computing.
        self._computing = ComputingBlocks(clock)
        self._serials = itertools.count(1)
        self.feedback = FeedbackStats()

    # --- introspection -----------------------------------------------------------------
    @property
    def tracks_prefixes(self) -> bool:
        """Whether requests are tokenized and matched (some policy in use reads prefixes)."""
        return self._tracking

    @property
    def working_sets(self) -> WorkingSets:
        """The conversation ledger (read-only use: tests, debugging)."""
        return self._working_sets

    def index_tokens(self, url: str) -> int:
        """Tokens the prefix index believes ``url`` holds."""
        return self._index_tokens_of((url,))[url]

    def _index_tokens_of(self, urls: Sequence[str]) -> dict[str, int]:
        """:meth:`index_tokens` of each of ``urls``, every index asked once."""
        tokens = dict.fromkeys(urls, 0)
        for size, index in self._indexes.items():
            for url, blocks in zip(urls, index.blocks_of(urls), strict=True):
                tokens[url] += blocks * size
        precise = self._precise
        if precise is not None:
            for url in urls:
                if precise.state(url) is not KVEventsState.APPROXIMATE:
                    tokens[url] = precise.tokens(url)
        return tokens

    def index_stats(self) -> RoutingIndexStats:
        """Blocks per backend and the index's memory, over every block size in use."""
        blocks: dict[str, int] = {}
        total_bytes = 0
        for index in self._indexes.values():
            stats = index.stats()
            for url, count in stats.blocks.items():
                blocks[url] = blocks.get(url, 0) + count
            total_bytes += stats.bytes
        if self._precise is not None:
            for url, state in self._precise.states().items():
                if state is not KVEventsState.APPROXIMATE:
                    blocks[url] = self._precise.blocks(url)
            total_bytes += self._precise.nbytes
        return RoutingIndexStats(blocks=blocks, bytes=total_bytes)

    def cache_model_states(self) -> dict[str, CacheModelState]:
        """Per backend what the model of its cache has learnt from the engine's answers."""
        answers = self.cache_model.answers()
        states = {}
        for url in self._configured_tokens.keys() | answers.keys():
            counts = answers.get(url)
            states[url] = CacheModelState(
                capacity_ratio=self.cache_model.scale(url) if url in self._configured_tokens else None,
                eviction_rate=self.cache_model.eviction_rate(url),
                answers_held=counts.held if counts else 0,
                answers_evicted=counts.evicted if counts else 0,
            )
        return states

    def chat_render_counts(self) -> dict[str, int]:
        """Chats rendered through a fast path, over every tokenizer. Long ones, through the
        render memo: ``lookups``, ``reused`` (rendered from a remembered turn),
        ``mismatches`` (such a render that differed from the whole render when checked: its
        template then renders whole). Short plain ones: ``skeleton`` (filled into their
        shape's skeleton), ``skeleton_mismatches`` (as ``mismatches``)."""
        counts = dict.fromkeys(("lookups", "reused", "mismatches", "skeleton", "skeleton_mismatches"), 0)
        for tokenizer in list(self._tokenizers.values()):
            stats = tokenizer.render_memo_stats()
            counts["lookups"] += stats.lookups
            counts["reused"] += stats.reused
            counts["mismatches"] += stats.mismatches
            skeletons = tokenizer.skeleton_stats()
            counts["skeleton"] += skeletons.filled
            counts["skeleton_mismatches"] += skeletons.mismatches
        return counts

    def conversation_memo_states(self) -> dict[str, ConversationMemoState]:
        """The conversation memos over every tokenizer: ``render`` (rendered texts) and
        ``ids`` (token ids), what they hold and how often a turn continued a remembered one."""
        tokenizers = list(self._tokenizers.values())
        states = {}
        for memo, stats_of in (("render", RequestTokenizer.render_memo_stats), ("ids", RequestTokenizer.memo_stats)):
            stats = [stats_of(tokenizer) for tokenizer in tokenizers]
            states[memo] = ConversationMemoState(
                bytes=sum(each.bytes for each in stats),
                max_bytes=sum(each.max_bytes for each in stats),
                entries=sum(each.entries for each in stats),
                lookups=sum(each.lookups for each in stats),
                continued=sum(each.reused for each in stats),
            )
        return states

    def tokenizer_unit_counts(self) -> dict[str, int]:
        """Units of prompt text by how their ids were found, over every tokenizer
        (:meth:`~kvroute.tokenizer_index.RequestTokenizer.unit_counts`)."""
        counts = dict.fromkeys(RequestTokenizer.UNIT_SOURCES, 0)
        for tokenizer in list(self._tokenizers.values()):
            for source, count in tokenizer.unit_counts().items():
                counts[source] += count
        return counts

    def tokenizer_new_word_counts(self) -> dict[str, int]:
        """Words new text brought that the word caches lacked, by who tokenized them, over
        every tokenizer (:meth:`~kvroute.tokenizer_index.RequestTokenizer.new_word_counts`)."""
        counts = dict.fromkeys(RequestTokenizer.NEW_WORD_SOURCES, 0)
        for tokenizer in list(self._tokenizers.values()):
            for source, count in tokenizer.new_word_counts().items():
                counts[source] += count
        return counts

    # --- the hot path ------------------------------------------------------------------
    def prepare(self, endpoint: str, body: Mapping[str, Any]) -> PreparedPrompt | None:
        """Tokenize and hash a request's prompt; None when it cannot be (thread-safe)."""
        model = body.get("model")
        if not self._settings.trust_request_chat_template and request_info.brings_chat_template(body):
            return None  # the engines refuse it (vLLM without --trust-request-chat-template)
        tokenizer = self._tokenizer_for(model if isinstance(model, str) else None)
        try:
            tokens = _tokenize(tokenizer, endpoint, body)
        except Exception as exc:
            log.debug("cannot tokenize a %s request: %r", endpoint, exc)
            return None
        if tokens is None or not len(tokens):
            return None
        size = self._block_size(model if isinstance(model, str) else None)
        cache_salt = body.get("cache_salt")
        hashes = block_hashes(tokens, size, request_salt(model, cache_salt))
        precise = None
        if self._precise is not None:
            precise = self._precise.prepare(
                tokens,
                model=model if isinstance(model, str) else None,
                cache_salt=cache_salt if isinstance(cache_salt, str) else None,
            )
        prompt = PreparedPrompt(tokens=len(tokens), hashes=hashes, block_size=size, precise=precise)
        if len(hashes) > sliced_insert.INSERT_SLICE_BLOCKS:
            prompt.convert_hashes()  # here, in the caller's thread: the ledger may walk them
        return prompt

    def route(
        self,
        endpoint: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        candidates: Sequence[BackendView],
        *,
        prepared: PreparedPrompt | None = None,
        parsed: request_info.ParsedRequest | None = None,
        sliced: bool = False,
    ) -> RoutePlan:
        """Pick a backend among ``candidates`` (non-empty) for this parsed request body.

        ``prepared`` (from :meth:`prepare`, e.g. run in a thread) and ``parsed`` (the
        proxy's parse of ``body``: its model, session key and output budget) may be passed
        when the caller already has them; else they are worked out here. ``sliced``: of a
        prompt of more than :data:`INSERT_SLICE_BLOCKS` blocks insert only the last slice
        here and leave the rest to :meth:`learn_slice` (``plan.pending_inserts``).
        """
        if parsed is not None:
            model = parsed.model
            session_key = parsed.session_key
            expected_output_tokens = parsed.expected_output_tokens
            continues = parsed.continues
        else:
            named = body.get("model")
            model = named if isinstance(named, str) else None
            session_key = request_info.session_key_of(body, headers, self._settings.session_header)
            expected_output_tokens = request_info.expected_output_tokens_of(body)
            continues = continued_response(endpoint, body)
        request = RouteRequest(
            endpoint=endpoint,
            model=model,
            session_key=session_key,
            expected_output_tokens=expected_output_tokens,
        )
        serial = next(self._serials)
        if prepared is None and self._tracking:
            prepared = self.prepare(endpoint, body)
        raw_matches: Mapping[str, int] = {}
        modelled_matches: Mapping[str, int] = {}
        index: PrefixIndex | None = None
        if prepared is not None:
            size = prepared.block_size
            index = self._index_for(size, candidates)
            modelled_matches = raw_matches = index.match_hashes(prepared.hashes)
            if prepared.precise is not None and self._precise is not None:
                raw_matches = self._precise.match(prepared.precise, modelled_matches)
            cacheable = prepared.cacheable_tokens
            request.prompt_tokens = prepared.tokens
            request.matched_tokens = {url: min(tokens, cacheable) for url, tokens in raw_matches.items()}
            request.computing_tokens = self._computing.tokens(request.matched_tokens, size, prepared.hash_at)
            request.index_tokens = self._index_tokens_of([backend.url for backend in candidates])
            if not any(raw_matches.values()):  # only a cold prompt's placement reads them
                request.index_capacity_tokens = self._index_capacities(candidates)
            request.eviction_rates = self._eviction_rates(candidates)
            shared = max(raw_matches.values(), default=0)
            # A session key names the conversation; without one the ledger follows the
            # prompt chain, the one reader of every hash as an int.
            chain = prepared.hash_list if session_key is None else ()
            request.conversation = self._working_sets.find(session_key, chain, shared)

        stored = self._stored_candidate(continues, candidates) if continues is not None else None
        if stored is not None:
            # No policy chose it: counted apart, so no policy's predicted hit rate or A/B
            # arm reads the continuations it did not place (no prediction: 0 matched).
            label = STORED_RESPONSE_POLICY
            decision = Decision(stored, STORED_RESPONSE_REASON)
        else:
            label = self._label(headers, session_key, request.conversation, body)
            policy = self._policy(label)
            if policy.needs_prefix_match and prepared is None:
                chosen = self._fallback.choose(request, candidates)
                decision = Decision(chosen.backend, FALLBACK_REASON, chosen.matched_tokens)
            else:
                decision = policy.choose(request, candidates)
        plan = RoutePlan(decision=decision, policy=label, request=request, prompt=prepared, serial=serial)
        if prepared is not None and index is not None:
            matched = raw_matches.get(decision.backend, 0)
            self._learn(plan, index, matched, modelled_matches.get(decision.backend, 0), sliced=sliced)
            if prepared.precise is not None and self._precise is not None:
                speculative = self._precise.speculate(decision.backend, prepared.precise, sliced=sliced)
                if speculative is not None:
                    plan.pending_inserts += (speculative,)
        return plan

    def learn_slice(self, plan: RoutePlan) -> bool:
        """Insert the next slice of ``plan``'s pending blocks, towards the prompt's head, one
        index after the other; True while more are left. Nothing into an index its backend
        left."""
        pending = plan.pending_inserts
        if not pending:
            return False
        if pending[0].insert_next():
            return True
        plan.pending_inserts = pending = pending[1:]
        return bool(pending)

    def observe(
        self,
        plan: RoutePlan,
        cached_tokens: int | None,
        *,
        answered: bool = True,
        sliced: bool = False,
        response_id: str | None = None,
    ) -> tuple[PendingInsert, ...]:
        """Feedback after an attempt: the engine's ``cached_tokens`` (None when not reported);
        ``answered``: the engine answered (it computed the prompt), not an error. ``sliced``:
        of a long prompt's blocks, inserted again here, only the last slice goes in at once;
        the rest is returned, to insert with ``insert_next``. ``response_id``: the Responses
        API's id the engine gave its answer, which continuations are routed back by (also
        when the answer did not end well: a background response lives on when its client
        leaves)."""
        self._computing.settle(plan.serial)
        if response_id is not None:
            self.remember_response(response_id, plan.backend)
        prompt = plan.prompt
        pending: tuple[PendingInsert, ...] = ()
        if answered and prompt is not None and prompt.precise is not None and self._precise is not None:
            held = self._precise.answered(plan.backend, prompt.precise, sliced=sliced)
            if held is not None:
                pending += (held,)
        corrected = self._check_model(plan, cached_tokens, sliced=sliced)
        return pending if corrected is None else (*pending, corrected)

    def _check_model(self, plan: RoutePlan, cached_tokens: int | None, *, sliced: bool) -> PendingInsert | None:
        """Compare the engine's ``cached_tokens`` with the router's model of its cache, and
        correct the model where the engine held less."""
        prompt = plan.prompt
        if cached_tokens is None or prompt is None:
            return None
        feedback = self.feedback
        feedback.observed += 1
        feedback.predicted_tokens += plan.predicted_cached_tokens
        feedback.observed_tokens += cached_tokens
        size = prompt.block_size
        backend = plan.backend
        # The engine checks the router's own model of its cache, also where KV events made
        # the prediction exact: the model's evictions weigh the capacity term on every backend.
        modelled = plan.modelled_cached_tokens
        drifted = modelled - cached_tokens >= size
        if modelled >= size:
            self.cache_model.answered(backend, evicted=drifted)
            if self._answer_listener is not None:
                self._answer_listener(backend, drifted)
        if not drifted:
            return None
        feedback.drifts += 1
        index = self._indexes.get(size)
        if index is None:
            return None
        # The engine computed the whole prompt: it holds every full block now, head most recent.
        pending = insert_blocks(index, backend, prompt.hashes, sliced=sliced)
        configured = self._configured_tokens.get(backend)
        if configured is None:
            return pending  # an unknown capacity has nothing to correct
        missing = modelled - cached_tokens
        self.cache_model.shortfall(backend, configured, self.index_tokens(backend), missing)
        feedback.capacity_corrections += 1
        self._apply_capacity(index, size, backend, configured)
        return pending

    def on_placement(self, listener: Callable[[Placement], None] | None) -> None:
        """Call ``listener`` with every placement that added blocks (the peer exchange's feed)."""
        self._placement_listener = listener

    def apply_placement(self, placement: Placement, *, sliced: bool = False) -> PendingInsert | None:
        """A peer router placed these blocks: hold them, and the conversation's turn in the
        ledger, as if this router had placed them. ``sliced``: of more than
        :data:`INSERT_SLICE_BLOCKS` blocks insert the last slice, and return the rest.

        The caller keeps backends that are not this router's out (the exchange's filter);
        the backend's capacity is applied when it is next a candidate.
        """
        index = self._index_for(placement.block_size, ())
        hashes = placement.hashes
        if not len(hashes):
            return None
        matched = index.match_hashes(hashes)
        shared = max(matched.values(), default=0)
        first_new = matched.get(placement.backend, 0) // placement.block_size
        if first_new < len(hashes):  # the peer's request is computing them from there on
            self._computing.placed_by_peer(placement.backend, (first_new, int(hashes[first_new])))
        # Also where KV events say what the engine holds: this index is then the model of the
        # cache whose misses the engines' answers count (peer_evidence), and it misses the
        # peers' traffic's evictions unless it sees that traffic.
        pending = insert_blocks(index, placement.backend, hashes, sliced=sliced)
        chain = hashes.tolist() if placement.session_key is None else ()
        conversation = self._working_sets.find(placement.session_key, chain, shared)
        if conversation is not None:
            self._working_sets.record(
                conversation, placement.backend, placement.prompt_tokens, int(hashes[-1]), chain, placement.block_size
            )
        return pending

    def computing_blocks(self) -> dict[str, list[FirstNew]]:
        """Per backend, the first block each of this router's requests in flight there is
        computing (what its load reports tell the peers)."""
        return self._computing.own()

    def apply_peer_computing(self, backend: str, entries: Sequence[FirstNew]) -> None:
        """The peers' requests in flight on ``backend`` compute from these blocks on (every
        entry their latest load reports list, replacing the previous ones)."""
        self._computing.reported_by_peers(backend, entries)

    def on_answer(self, listener: Callable[[str, bool], None] | None) -> None:
        """Call ``listener(backend, evicted)`` for each engine answer that checked the
        router's model of that backend's cache (the peer exchange sends them on)."""
        self._answer_listener = listener

    def apply_answers(self, backend: str, answers: Answers) -> None:
        """A peer router's answers about ``backend``: counted in its eviction rate."""
        for evicted in answers.in_order():
            self.cache_model.peer_answered(backend, evicted)

    def _stored_candidate(self, response_id: str | None, candidates: Sequence[BackendView]) -> str | None:
        """The candidate that stored ``response_id``, if remembered."""
        stored = self._stored_responses.backend_of(response_id)
        return stored if stored is not None and any(backend.url == stored for backend in candidates) else None

    def route_stored(self, response_id: str, candidates: Sequence[BackendView]) -> RoutePlan:
        """Pick a backend among ``candidates`` (non-empty) for a call on the stored response
        ``response_id`` itself (read, cancel, delete): the one that stored it when known,
        else the least loaded, to be searched from (:data:`SEARCH_REASON`)."""
        stored = self._stored_candidate(response_id, candidates)
        if stored is not None:
            decision = Decision(stored, STORED_RESPONSE_REASON)
        else:
            decision = Decision(min(candidates, key=load_of).url, SEARCH_REASON)
        request = RouteRequest(endpoint=RESPONSES.path)
        return RoutePlan(decision=decision, policy=STORED_RESPONSE_POLICY, request=request)

    def remember_response(self, response_id: str, backend: str) -> None:
        """``backend`` answered ``response_id`` (or a call on that stored response): it holds
        it. Peers hear of it once (a client polling a response would repeat it every poll)."""
        learned = self._stored_responses.remember(response_id, backend)
        if learned and self._stored_listener is not None:
            self._stored_listener(response_id, backend)

    @property
    def stored_responses_count(self) -> int:
        """How many Responses answer ids are remembered with the backend storing each."""
        return len(self._stored_responses)

    def on_response_stored(self, listener: Callable[[str, str], None] | None) -> None:
        """Call ``listener(response_id, backend)`` with every stored response this router
        learned where it is (the peer exchange sends them on)."""
        self._stored_listener = listener

    def apply_stored_response(self, response_id: str, backend: str) -> None:
        """A peer router learned that ``backend`` stores ``response_id``."""
        self._stored_responses.remember(response_id, backend)

    def forget_backend(self, url: str) -> None:
        """A backend left the pool: drop its index entries, ledger entries and policy state."""
        for index in self._indexes.values():
            index.remove_backend(url)
        for key in [key for key in self._capacities if key[1] == url]:
            del self._capacities[key]
        self._applied.clear()
        self._configured_tokens.pop(url, None)
        self.cache_model.forget(url)
        self._computing.forget(url)
        self._engine_block_sizes.pop(url, None)
        self._working_sets.forget_backend(url)
        for policy in self._policies.values():
            policy.forget_backend(url)
        self._fallback.forget_backend(url)
        self._stored_responses.forget_backend(url)

    def update_engine_stats(self, url: str, stats: EngineStats) -> None:
        """Listener for :mod:`kvroute.router.fleet.engine_stats`: learns each engine's block size."""
        if stats.block_size:
            self._engine_block_sizes[url] = stats.block_size
            if self._precise is not None:
                self._precise.expect_block_size(url, stats.block_size)

    # --- internals -----------------------------------------------------------------------
    def _policy(self, label: str) -> Policy:
        policy = self._policies.get(label)
        if policy is None:
            context = PolicyContext(self._settings, self._working_sets)
            policy = self._policies[label] = make_policy(label, context)
            policy.explain = self.decisions.active
            if policy.needs_prefix_match and not self._tracking:
                self._load_tokenizers()
                self._tracking = True
        return policy

    def _label(
        self,
        headers: Mapping[str, str],
        session_key: str | None,
        conversation: Conversation | None,
        body: Mapping[str, Any],
    ) -> str:
        if self._settings.allow_policy_header:
            forced = headers.get(POLICY_HEADER)
            if forced is not None and forced in POLICIES:
                return forced
        if self._split is None:
            return self._default_label
        if session_key is not None:
            key = "session:" + session_key
        elif conversation is not None:
            key = conversation.key
        else:
            key = hashlib.blake2b(orjson.dumps(body, option=orjson.OPT_SORT_KEYS), digest_size=8).hexdigest()
        return self._split.assign(key)

    def _load_tokenizers(self) -> None:
        """Load every configured tokenizer now, so a bad path fails at start, not per request."""
        self._tokenizer_for(None)
        for name in self._settings.models:
            self._tokenizer_for(name)

    def _tokenizer_for(self, model: str | None) -> RequestTokenizer:
        # Per configured model (any other model is the fleet-wide entry, None): a lookup per
        # request, and no entry per name a client makes up.
        name = model if model is not None and model in self._settings.models else None
        tokenizer = self._model_tokenizers.get(name)
        if tokenizer is None:
            tokenizer = self._model_tokenizers[name] = self._load_tokenizer(name)
        return tokenizer

    def _load_tokenizer(self, model: str | None) -> RequestTokenizer:
        """The tokenizer of a configured model (None: the fleet's), shared by every model
        with the same tokenizer, chat template and default template keywords."""
        settings = self._settings
        configured = settings.models.get(model) if model is not None else None
        source = configured.tokenizer if configured and configured.tokenizer else settings.tokenizer
        template = configured.chat_template if configured and configured.chat_template else settings.chat_template
        kwargs = (
            configured.default_chat_template_kwargs
            if configured and configured.default_chat_template_kwargs is not None
            else settings.default_chat_template_kwargs
        )
        key = (source, template, orjson.dumps(kwargs, option=orjson.OPT_SORT_KEYS).decode() if kwargs else None)
        tokenizer = self._tokenizers.get(key)
        if tokenizer is None:
            options: dict[str, Any] = {
                "chat_template": load_chat_template(template) if template else None,
                "default_chat_template_kwargs": kwargs,
                # (half for the rendered texts, half for the ids)
                "memo_bytes": settings.conversation_memo_mb * 2**19,
                "render_memo_bytes": settings.conversation_memo_mb * 2**19,
            }
            loaded = (
                RequestTokenizer.default(**options)
                if source is None
                else RequestTokenizer.from_pretrained(source, **options)
            )
            if template:
                loaded.chat_template()  # compiled now: a broken template stops the start, not each request
            tokenizer = self._tokenizers.setdefault(key, loaded)
            if tokenizer is loaded:  # what this model's requests will cost, said once
                log.info("tokenizer %s: %s", source or "kvroute's default", loaded.fast_paths().summary())
        return tokenizer

    def _block_size(self, model: str | None) -> int:
        configured = self._settings.models.get(model) if model is not None else None
        if configured is not None and configured.block_size:
            return configured.block_size
        if self._settings.block_size:
            return self._settings.block_size
        if self._precise is not None and self._precise.engine_block_size:
            return self._precise.engine_block_size  # what the engines' KV events announced
        for size in self._engine_block_sizes.values():
            return size
        return DEFAULT_BLOCK_SIZE

    def _index_for(self, block_size: int, candidates: Sequence[BackendView]) -> PrefixIndex:
        """The index of this block size, with every candidate's capacity applied."""
        index = self._indexes.get(block_size)
        if index is None:
            index = self._indexes[block_size] = PrefixIndex(
                block_size=block_size,
                capacity_blocks=UNKNOWN_CAPACITY_TOKENS // block_size,
                ttl_s=self._settings.index_ttl_s,
            )
        applied = (self.cache_model.version, [(backend.url, backend.capacity_tokens) for backend in candidates])
        if self._applied.get(block_size) == applied:
            return index
        self._applied[block_size] = applied
        configured = self._configured_tokens
        for backend in candidates:
            capacity = backend.capacity_tokens
            if capacity:
                configured[backend.url] = capacity
            else:
                configured.pop(backend.url, None)
            self._apply_capacity(index, block_size, backend.url, capacity)
        return index

    def _apply_capacity(self, index: PrefixIndex, block_size: int, url: str, configured: int | None) -> None:
        """Bound ``url`` in ``index`` to the share of its configured cache the model counts on."""
        tokens = self.cache_model.capacity(url, configured) if configured else UNKNOWN_CAPACITY_TOKENS
        blocks = max(1, tokens // block_size)
        key = (block_size, url)
        if self._capacities.get(key) != blocks:
            index.set_capacity(url, blocks)
            self._capacities[key] = blocks

    def _learn(self, plan: RoutePlan, index: PrefixIndex, matched: int, modelled: int, *, sliced: bool) -> None:
        """Insert the request's blocks for its backend (a long prompt's in slices when
        ``sliced``); track the blocks it computes.

        ``matched``: the tokens of the prompt the backend holds, as predicted; ``modelled``:
        as the approximate index alone predicted them (the same unless KV events answered).
        """
        backend = plan.backend
        prompt = plan.prompt
        assert prompt is not None
        blocks = len(prompt.hashes)
        matched_blocks = matched // prompt.block_size
        # The prediction counts as confirmed up to the first block a request still in flight put there.
        request = plan.request
        still_computing = request.computing_tokens.get(backend, 0)
        plan.confirmed_cached_tokens = plan.predicted_cached_tokens - still_computing
        plan.modelled_cached_tokens = (
            plan.confirmed_cached_tokens
            if modelled == matched
            else max(0, min(modelled, prompt.cacheable_tokens) - still_computing)
        )
        if blocks > matched_blocks:
            self._computing.start(plan.serial, backend, (matched_blocks, prompt.hash_at(matched_blocks)))
        if blocks:
            pending = insert_blocks(index, backend, prompt.hashes, sliced=sliced)
            if pending is not None:
                plan.pending_inserts = (pending,)
            if blocks > matched_blocks and self._placement_listener is not None:
                self._placement_listener(
                    Placement(backend, prompt.block_size, prompt.hashes, prompt.tokens, request.session_key)
                )
        conversation = request.conversation
        if conversation is not None:
            leaf = prompt.hash_at(-1) if blocks else None
            chain = prompt.hash_list if request.session_key is None else ()  # as route() found it by
            self._working_sets.record(conversation, backend, prompt.tokens, leaf, chain, prompt.block_size)

    def _index_capacities(self, candidates: Sequence[BackendView]) -> dict[str, int]:
        """Per candidate with a known cache size, the tokens its index is bounded to."""
        capacities: dict[str, int] = {}
        for backend in candidates:
            configured = self._configured_tokens.get(backend.url)
            if configured:
                capacities[backend.url] = self.cache_model.capacity(backend.url, configured)
        return capacities

    def _eviction_rates(self, candidates: Sequence[BackendView]) -> dict[str, float]:
        """Per candidate whose answers checked the model of its cache, its recent eviction rate."""
        rates: dict[str, float] = {}
        for backend in candidates:
            url = backend.url
            rate = self.cache_model.eviction_rate(url)
            if rate is not None:
                rates[url] = rate
        return rates
