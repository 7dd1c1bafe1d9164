"""The router's Prometheus metrics: one registry, never the process-global default.

Per-request series (requests, latency and TTFT histograms, prompt / predicted / observed
cached tokens, routing decisions) are plain Python counters updated by the proxy through
:meth:`RouterMetrics.record_request` and :meth:`RouterMetrics.record_decision`, and turned
into metric families only when ``/metrics`` is scraped. That keeps the hot path at a few
dict lookups and integer additions per request (prometheus-client's own ``inc`` and
``observe`` take a lock and validate their arguments each time, which cost more than the
rest of the bookkeeping together). Everything runs on the event loop thread, scrapes
included, so no locking is needed.

Per-backend gauges (in-flight requests and their work in tokens, health, the engine's
queue and hit ratio) are read from the live :class:`~kvroute.router.fleet.backends.Backend` objects at scrape time: they cannot
drift from the router's own counters and vanish with the backend.

Gauges other parts of the router set directly (``index_blocks``, ``index_bytes``,
``kv_events_state``) are plain ``Gauge`` objects. :meth:`RouterMetrics.forget_backend`
drops every series of a removed backend, so removing backends leaks nothing.

Process and runtime gauges show what a soak test watches for leaks: the process's memory,
CPU and open file descriptors (``kvroute_process_*``), the event loop's task count
(``kvroute_asyncio_tasks``), admission control's running and queued requests, and the
requests turned away (``kvroute_rejected_requests_total{reason}``), all read at scrape time
from a :class:`RuntimeStats` snapshot.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.decisions import AttemptOutcome
from kvroute.router.routing.routing_engine import CacheModelState, ConversationMemoState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
KV_EVENT_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


class _Histogram:
    """Bucket counts of one label set (non-cumulative; the last slot is +Inf)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            buckets.append((floatToGoString(bound), running))
        return buckets


class _PairStats:
    """What one (backend, policy) pair accumulates."""

    __slots__ = ("duration", "observed_cached", "predicted_cached", "prompt_tokens", "ttft")

    def __init__(self) -> None:
        self.duration = _Histogram(DURATION_BUCKETS)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.prompt_tokens = 0
        self.predicted_cached = 0
        self.observed_cached = 0


class _RequestCollector:
    """Exports the per-request counters and histograms at scrape time."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        yield from self._families({}, {}, {})

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        yield from self._families(metrics.requests, metrics.pairs, metrics.decisions)

    @staticmethod
    def _families(
        requests: dict[tuple[str, str, str, str], int],
        pairs: dict[tuple[str, str], _PairStats],
        decisions: dict[tuple[str, str], int],
    ) -> Iterator[Metric]:
        pair_labels = ["backend", "policy"]
        requests_family = CounterMetricFamily(
            "kvroute_requests",
            "Proxied requests by backend, policy, endpoint and final status "
            "(499: the client went away; 502: no answer, or a stream broken after its headers were sent).",
            labels=["backend", "policy", "endpoint", "status"],
        )
        duration = HistogramMetricFamily(
            "kvroute_request_duration_seconds",
            "Time from receiving a request to its last byte relayed.",
            labels=pair_labels,
        )
        ttft = HistogramMetricFamily(
            "kvroute_time_to_first_token_seconds",
            "Time from receiving a streamed request to its first chunk.",
            labels=pair_labels,
        )
        prompt = CounterMetricFamily(
            "kvroute_prompt_tokens", "Prompt tokens the engines reported (usage.prompt_tokens).", labels=pair_labels
        )
        predicted = CounterMetricFamily(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the router predicted to be cached where it sent them.",
            labels=pair_labels,
        )
        observed = CounterMetricFamily(
            "kvroute_observed_cached_tokens",
            "Cached prompt tokens the engines reported (usage.prompt_tokens_details.cached_tokens).",
            labels=pair_labels,
        )
        decisions_family = CounterMetricFamily(
            "kvroute_routing_decisions", "Routing decisions by policy and reason.", labels=["policy", "reason"]
        )
        for request_key, count in requests.items():
            requests_family.add_metric(request_key, count)
        for pair, stats in pairs.items():
            duration.add_metric(pair, stats.duration.cumulative(), stats.duration.total)
            if any(stats.ttft.counts):
                ttft.add_metric(pair, stats.ttft.cumulative(), stats.ttft.total)
            prompt.add_metric(pair, stats.prompt_tokens)
            predicted.add_metric(pair, stats.predicted_cached)
            observed.add_metric(pair, stats.observed_cached)
        for decision, count in decisions.items():
            decisions_family.add_metric(decision, count)
        yield from (requests_family, duration, ttft, prompt, predicted, observed, decisions_family)


class _BackendStateCollector:
    """Exports gauges straight from the backends' own fields at scrape time."""

    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        self._backends = backends

    def describe(self) -> Iterator[Metric]:
        yield from self._families(())

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._backends())

    @staticmethod
    def _families(backends: Iterable[Backend]) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "kvroute_backend_in_flight_requests",
            "Requests this router has in flight per backend.",
            labels=["backend"],
        )
        work = GaugeMetricFamily(
            "kvroute_backend_in_flight_work_tokens",
            "The load this router has in flight per backend, in tokens: each request's uncached"
            " prompt tokens (as predicted) plus its expected output tokens. What the policies weigh,"
            " with what peer routers report (--peers).",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "kvroute_backend_healthy", "1 when the backend passes health checks, else 0.", labels=["backend"]
        )
        waiting = GaugeMetricFamily(
            "kvroute_engine_requests_waiting",
            "The engine's own waiting queue, scraped from its /metrics.",
            labels=["backend"],
        )
        hit_ratio = GaugeMetricFamily(
            "kvroute_engine_prefix_cache_hit_ratio",
            "The engine's prefix cache hit ratio (hits / queries in tokens) since the previous scrape.",
            labels=["backend"],
        )
        breaker = GaugeMetricFamily(
            "kvroute_backend_breaker_state",
            "The backend's circuit breaker (0 closed, 1 open: ejected, 2 half-open: one probe request).",
            labels=["backend"],
        )
        trips = CounterMetricFamily(
            "kvroute_backend_breaker_trips", "Times the backend's circuit breaker opened.", labels=["backend"]
        )
        engine = GaugeMetricFamily(
            "kvroute_backend_engine",
            "1 per backend, labelled with its engine API (vllm, sglang, generic)"
            " and how it is known (configured, detected, auto: not yet detected).",
            labels=["backend", "engine", "source"],
        )
        for backend in backends:
            engine.add_metric([backend.url, backend.engine.name, backend.engine_source], 1.0)
            in_flight.add_metric([backend.url], backend.own_in_flight)
            work.add_metric([backend.url], backend.own_in_flight_work_tokens)
            healthy.add_metric([backend.url], 1.0 if backend.healthy else 0.0)
            breaker.add_metric([backend.url], int(backend.breaker.state))
            trips.add_metric([backend.url], backend.breaker.trips)
            if backend.engine_waiting is not None:
                waiting.add_metric([backend.url], backend.engine_waiting)
            if backend.engine_prefix_cache_hit_ratio is not None:
                hit_ratio.add_metric([backend.url], backend.engine_prefix_cache_hit_ratio)
        yield from (in_flight, work, healthy, waiting, hit_ratio, breaker, trips, engine)


@dataclass(frozen=True, slots=True)
class RuntimeStats:
    """What admission control and the client gate report at scrape time."""

    #: Requests holding a global concurrency slot (0 without a global limit).
    active_requests: int
    queued_requests: int
    #: Requests turned away, by reason (queue_full, queue_timeout, unauthorized, rate_limited).
    rejected: Mapping[str, int]
    #: Clients with a rate-limit bucket.
    rate_limited_clients: int


class _RuntimeCollector:
    """The event loop's task count and the admission/gate numbers, read at scrape time."""

    def __init__(self, runtime: Callable[[], RuntimeStats]) -> None:
        self._runtime = runtime

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None, 0)

    def collect(self) -> Iterator[Metric]:
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped outside the event loop (a test rendering directly)
            tasks = 0
        yield from self._families(self._runtime(), tasks)

    @staticmethod
    def _families(stats: RuntimeStats | None, tasks: int) -> Iterator[Metric]:
        tasks_family = GaugeMetricFamily("kvroute_asyncio_tasks", "Tasks alive on the router's event loop.")
        active = GaugeMetricFamily(
            "kvroute_admission_active_requests", "Requests holding a slot of the global concurrency limit."
        )
        queued = GaugeMetricFamily(
            "kvroute_admission_queued_requests", "Requests waiting for a turn in the admission queue."
        )
        rejected = CounterMetricFamily(
            "kvroute_rejected_requests",
            "Requests turned away before reaching a backend, by reason.",
            labels=["reason"],
        )
        clients = GaugeMetricFamily("kvroute_rate_limit_clients", "Clients with a rate-limit bucket.")
        if stats is not None:
            tasks_family.add_metric([], tasks)
            active.add_metric([], stats.active_requests)
            queued.add_metric([], stats.queued_requests)
            for reason, count in stats.rejected.items():
                rejected.add_metric([reason], count)
            clients.add_metric([], stats.rate_limited_clients)
        yield from (tasks_family, active, queued, rejected, clients)


class _EventCounters:
    """One counter family by one label (``event`` unless named), read from a mapping at scrape time."""

    def __init__(
        self, name: str, documentation: str, counts: Callable[[], Mapping[str, int]], *, label: str = "event"
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._counts = counts
        self._label = label

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for event, count in self._counts().items():
            family.add_metric([event], count)
        yield family


class _ConversationMemoCollector:
    """``kvroute_conversation_memo_{bytes,max_bytes,entries}{memo}`` and
    ``kvroute_conversation_memo_turns_total{memo,event}``, read at scrape time."""

    def __init__(self, states: Callable[[], Mapping[str, ConversationMemoState]]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "kvroute_conversation_memo_bytes",
            "Bytes the conversation memo holds (memo: render, long chats' rendered texts; ids, their "
            "token ids), over every tokenizer.",
            labels=["memo"],
        )
        bound = GaugeMetricFamily(
            "kvroute_conversation_memo_max_bytes",
            "The conversation memo's bound (--conversation-memo-mb, half per memo), over every tokenizer.",
            labels=["memo"],
        )
        entries = GaugeMetricFamily(
            "kvroute_conversation_memo_entries",
            "Turns the conversation memo holds (about one per long conversation it keeps).",
            labels=["memo"],
        )
        turns = CounterMetricFamily(
            "kvroute_conversation_memo_turns",
            "Long chats by event: lookups, looked for their conversation's last turn; continued, "
            "found it, and rendered or tokenized only what follows it. Few continued while the "
            "memo is full: it holds fewer conversations than are active (raise --conversation-memo-mb).",
            labels=["memo", "event"],
        )
        for memo, state in self._states().items():
            held.add_metric([memo], state.bytes)
            bound.add_metric([memo], state.max_bytes)
            entries.add_metric([memo], state.entries)
            turns.add_metric([memo, "lookups"], state.lookups)
            turns.add_metric([memo, "continued"], state.continued)
        yield from (held, bound, entries, turns)


class _KVEventCollector:
    """Precise mode's streams, read at scrape time: ``kvroute_kv_events_total{backend,event}``
    and ``kvroute_kv_events_lag_seconds{backend}`` (how long after an answer the event that
    confirmed its prompt's last block came, for the answers that came first)."""

    def __init__(self, counts: Callable[[], Mapping[str, Mapping[str, int]]], lags: Mapping[str, _Histogram]) -> None:
        self._counts = counts
        self._lags = lags

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvroute_kv_events",
            "KV-event stream counters per backend, by event: messages and events applied, gaps "
            "and the batches replayed for them, unrecoverable_gaps, restarts (engine restarts "
            "seen), disconnects, replay_failures, apply_errors, other_rank_batches (a data-parallel "
            "rank's endpoint sending another rank's batches, not applied), and what the decoder skipped "
            "(malformed_messages, malformed_events, unknown_events); answers_before_events: engine answers "
            "that came before the events of all their prompt's blocks (held speculatively again; also "
            "counts prompts whose blocks no event can confirm, such as those after an image).",
            labels=["backend", "event"],
        )
        for backend, events in self._counts().items():
            for event, count in events.items():
                family.add_metric([backend, event], count)
        yield family
        lag = HistogramMetricFamily(
            "kvroute_kv_events_lag_seconds",
            "Precise mode: from an engine's answer to the KV event that stored its prompt's last block, "
            "for answers that came before it (answers_before_events). Past --speculative-ttl-s, a "
            "conversation's next turn sent at once can miss its history.",
            labels=["backend"],
        )
        for backend, lags in self._lags.items():
            lag.add_metric([backend], lags.cumulative(), lags.total)
        yield lag


class _CacheModelCollector:
    """``kvroute_cache_model_*{backend}``: what each backend's cache model learnt from answers."""

    def __init__(self, states: Callable[[], Mapping[str, CacheModelState]]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        ratio = GaugeMetricFamily(
            "kvroute_cache_model_capacity_ratio",
            "Share of the backend's configured KV cache the router's model counts on: below 1 "
            "after the engine answered with less cached than the model predicted (it evicted "
            "earlier than modelled), creeping back with each answer that held all of it.",
            labels=["backend"],
        )
        rate = GaugeMetricFamily(
            "kvroute_cache_model_eviction_rate",
            "Recent share (about the last ten) of the engine's answers that showed an eviction "
            "the router's model did not foresee, peer routers' answers included; it weighs the "
            "capacity term of cache_aware.",
            labels=["backend"],
        )
        answers = CounterMetricFamily(
            "kvroute_cache_model_answers",
            "This router's answers that checked its model's prediction, by result (held: the "
            "engine held all of it; evicted: less).",
            labels=["backend", "result"],
        )
        for url, state in self._states().items():
            if state.capacity_ratio is not None:
                ratio.add_metric([url], state.capacity_ratio)
            if state.eviction_rate is not None:
                rate.add_metric([url], state.eviction_rate)
            answers.add_metric([url, "held"], state.answers_held)
            answers.add_metric([url, "evicted"], state.answers_evicted)
        yield ratio
        yield rate
        yield answers


class RouterMetrics:
    """Every metric of the router, in its own :class:`CollectorRegistry`."""

    def __init__(
        self, backends: Callable[[], Iterable[Backend]], runtime: Callable[[], RuntimeStats] | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        #: (backend, policy, endpoint, status) -> requests.
        self.requests: dict[tuple[str, str, str, str], int] = {}
        #: (backend, policy) -> latency histograms and token counters.
        self.pairs: dict[tuple[str, str], _PairStats] = {}
        #: (policy, reason) -> decisions.
        self.decisions: dict[tuple[str, str], int] = {}
        #: backend -> how long after answers their KV events came (precise mode).
        self.kv_event_lags: dict[str, _Histogram] = {}
        self.index_blocks = Gauge(
            "kvroute_index_blocks",
            "Blocks the router's prefix index holds per backend.",
            ["backend"],
            registry=self.registry,
        )
        self.index_bytes = Gauge(
            "kvroute_index_bytes", "Memory of the router's prefix index in bytes.", registry=self.registry
        )
        self.stored_responses = Gauge(
            "kvroute_stored_responses",
            "Responses API answer ids remembered with the backend storing each (--stored-responses at most).",
            registry=self.registry,
        )
        self.kv_events_state = Gauge(
            "kvroute_kv_events_state",
            "KV event subscription per backend "
            "(0 approximate, 1 precise, 2 recovering a gap, 3 partial: history before joining lost).",
            ["backend"],
            registry=self.registry,
        )
        self.registry.register(_RequestCollector(self))
        self.registry.register(_BackendStateCollector(backends))
        # kvroute_process_resident_memory_bytes, _open_fds, _cpu_seconds_total, ... (Linux).
        ProcessCollector(namespace="kvroute", registry=self.registry)
        if runtime is not None:
            self.registry.register(_RuntimeCollector(runtime))

    def watch_peer_exchange(
        self,
        placements: Callable[[], Mapping[str, int]],
        load_reports: Callable[[], Mapping[str, int]],
        handshakes: Callable[[], Mapping[str, int]],
        evidence: Callable[[], Mapping[str, int]] = dict,
        stored_responses: Callable[[], Mapping[str, int]] = dict,
    ) -> None:
        """Export the exchange's counters (``--peer-bind`` / ``--peers``): placements, load
        reports, handshakes, eviction evidence, stored responses."""
        self.registry.register(
            _EventCounters(
                "kvroute_peer_placements",
                "Placements exchanged with peer routers, by event "
                "(published, received, dropped_budget: over --peer-max-bytes-per-s, "
                "dropped_slow: a unix:// peer too far behind, malformed).",
                placements,
            )
        )
        self.registry.register(
            _EventCounters(
                "kvroute_peer_load_reports",
                "Reports of requests in flight exchanged with peer routers, by event "
                "(published, received, dropped_budget: over --peer-max-bytes-per-s, "
                "expired: a peer with requests in flight whose reports stopped, malformed).",
                load_reports,
            )
        )
        self.registry.register(
            _EventCounters(
                "kvroute_peer_handshakes",
                "ZMQ handshakes with peer routers, by result (succeeded; failed_no_detail: the "
                "peer dropped it, e.g. another --peer-secret-file; failed_protocol: e.g. one side "
                "without it; failed_auth: the peer refused this router's key; refused: subscribers "
                "this router refused for holding another key; accepted: succeeded with "
                "--peer-accepted-secret-file's key: while a rotation rolls, it grows; once no "
                "router's does, the old secret can go).",
                handshakes,
                label="result",
            )
        )
        self.registry.register(
            _EventCounters(
                "kvroute_peer_evidence",
                "Messages of eviction evidence (how often engines evicted what each router's "
                "model held, which weighs the capacity term) exchanged with peer routers, by event "
                "(published, received, dropped_budget: over --peer-max-bytes-per-s, malformed).",
                evidence,
            )
        )
        self.registry.register(
            _EventCounters(
                "kvroute_peer_stored_responses",
                "Messages of stored Responses answers (which backend holds which response id, so a "
                "continuation reaching another router needs no search) exchanged with peer routers, "
                "by event (published, received, dropped_budget: over --peer-max-bytes-per-s, malformed).",
                stored_responses,
            )
        )

    def watch_chat_renders(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export the render fast paths' counters: how many long chats rendered only their
        new messages, how many short ones filled a skeleton, and whether any such render
        ever differed from the whole render."""
        self.registry.register(
            _EventCounters(
                "kvroute_chat_renders",
                "Chats rendered through a fast path, by event. Chats of 16 messages or more, "
                "through the render memo: lookups; reused: only the new messages rendered after "
                "a remembered turn; mismatches: such a render that differed from the whole "
                "render when checked, every 128th: its chat template then renders whole, and "
                "the log says so. Shorter chats of plain text messages: skeleton: filled into "
                "their shape's skeleton, without the template engine; skeleton_mismatches: as "
                "mismatches.",
                counts,
            )
        )

    def watch_tokenizer_units(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export how the tokenizers found the ids of prompt text: which fast path served it."""
        self.registry.register(
            _EventCounters(
                "kvroute_tokenizer_units",
                "Units of prompt text (pieces between special tokens, long ones in chunks) by "
                "how their ids were found (source: cached, the piece cache; words, new text "
                "word by word in Python; words_compiled, in compiled code; library, the "
                "tokenizers library: text word splitting does not handle, or all of it once "
                "a periodic check turned word splitting off).",
                counts,
                label="source",
            )
        )

    def watch_tokenizer_new_words(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export who tokenized the words new text brought that the word caches lacked."""
        self.registry.register(
            _EventCounters(
                "kvroute_tokenizer_new_words",
                "Words of new prompt text that the word caches lacked, by who tokenized them "
                "(by: bpe, the byte-level BPE in compiled code; library, the tokenizers library: "
                "words of more than 64 bytes, a short text's one new word, or a model the compiled "
                "BPE does not run).",
                counts,
                label="by",
            )
        )

    def watch_conversation_memo(self, states: Callable[[], Mapping[str, ConversationMemoState]]) -> None:
        """Export what the conversation memos hold and how often a long chat's turn continued
        a remembered one: a memo full and rarely continued wants more ``--conversation-memo-mb``."""
        self.registry.register(_ConversationMemoCollector(states))

    def watch_cache_model(self, states: Callable[[], Mapping[str, CacheModelState]]) -> None:
        """Export each backend's cache model: the share of its cache counted on, its eviction
        rate, the answers that checked it."""
        self.registry.register(_CacheModelCollector(states))

    def watch_kv_events(self, counts: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        """Export each KV-event stream's counters (``--kv-events``), per backend and event,
        and the lag of events behind answers (:meth:`record_kv_event_lag`)."""
        self.registry.register(_KVEventCollector(counts, self.kv_event_lags))

    def record_kv_event_lag(self, backend: str, seconds: float) -> None:
        """An engine's KV event stored an answered prompt's last block ``seconds`` after the answer."""
        lags = self.kv_event_lags.get(backend)
        if lags is None:
            lags = self.kv_event_lags[backend] = _Histogram(KV_EVENT_LAG_BUCKETS)
        lags.observe(seconds)

    # --- hot path ----------------------------------------------------------------------
    def record_request(self, outcome: AttemptOutcome) -> None:
        """Count one finished attempt. Token counters move only when the engine reported its
        prompt and cached tokens, so predicted and observed hit rates are ratios over the
        same requests."""
        key = (outcome.backend, outcome.policy, outcome.endpoint, outcome.status)
        requests = self.requests
        requests[key] = requests.get(key, 0) + 1
        pair_key = (outcome.backend, outcome.policy)
        pair = self.pairs.get(pair_key)
        if pair is None:
            pair = self.pairs[pair_key] = _PairStats()
        pair.duration.observe(outcome.duration_s)
        if outcome.ttft_s is not None:
            pair.ttft.observe(outcome.ttft_s)
        prompt_tokens, cached_tokens = outcome.prompt_tokens, outcome.cached_tokens
        if prompt_tokens is not None and cached_tokens is not None:
            pair.prompt_tokens += prompt_tokens
            pair.predicted_cached += min(outcome.predicted_cached_tokens, prompt_tokens)
            pair.observed_cached += cached_tokens

    def record_decision(self, policy: str, reason: str) -> None:
        """Count one routing decision."""
        key = (policy, reason)
        decisions = self.decisions
        decisions[key] = decisions.get(key, 0) + 1

    # --- lifecycle ---------------------------------------------------------------------
    def forget_backend(self, url: str) -> None:
        """Drop every series labelled with this backend."""
        for request_key in [key for key in self.requests if key[0] == url]:
            del self.requests[request_key]
        for pair in [key for key in self.pairs if key[0] == url]:
            del self.pairs[pair]
        self.kv_event_lags.pop(url, None)
        for gauge in (self.index_blocks, self.kv_events_state):
            try:
                gauge.remove(url)
            except KeyError:
                pass  # never set for this backend

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
