"""The router's Prometheus metrics: one registry, never the process-global default.

Two kinds of series live here:

* Per-request counters and histograms (requests, latency, TTFT, prompt / predicted /
  observed cached tokens, routing decisions), updated by the proxy through
  :meth:`RouterMetrics.record_request` and :meth:`RouterMetrics.record_decision`. Label
  children are cached in plain dicts, so the hot path costs one dict lookup per family
  instead of prometheus-client's ``labels()`` validation.
* Per-backend gauges read from the live :class:`~router.backends.Backend` objects at
  scrape time (in-flight requests, health, the engine's queue and hit ratio): they cannot
  drift from the router's own counters and vanish with the backend.

Gauges that other parts of the router set directly (``index_blocks``, ``index_bytes``,
``kv_events_state``) are plain ``Gauge`` objects here; :meth:`RouterMetrics.forget_backend`
drops every series of a removed backend, so removing backends leaks nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase

from router.backends import Backend

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class _PerBackendPolicy:
    """The label children one (backend, policy) pair updates on every request."""

    duration: Histogram
    ttft: Histogram
    prompt_tokens: Counter
    predicted_cached: Counter
    observed_cached: Counter


class _BackendStateCollector:
    """Exports gauges straight from the backends' own fields at scrape time."""

    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        self._backends = backends

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._backends())

    @staticmethod
    def _families(backends: Iterable[Backend] = ()) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "kvroute_backend_in_flight_requests", "Requests this router has in flight per backend.",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "kvroute_backend_healthy", "1 when the backend passes health checks, else 0.", labels=["backend"]
        )
        waiting = GaugeMetricFamily(
            "kvroute_engine_requests_waiting", "The engine's own waiting queue, scraped from its /metrics.",
            labels=["backend"],
        )
        hit_ratio = GaugeMetricFamily(
            "kvroute_engine_prefix_cache_hit_ratio",
            "The engine's prefix cache hit ratio (hits / queries in tokens) since the previous scrape.",
            labels=["backend"],
        )
        for backend in backends:
            in_flight.add_metric([backend.url], backend.in_flight)
            healthy.add_metric([backend.url], 1.0 if backend.healthy else 0.0)
            if backend.engine_waiting is not None:
                waiting.add_metric([backend.url], backend.engine_waiting)
            if backend.engine_prefix_cache_hit_ratio is not None:
                hit_ratio.add_metric([backend.url], backend.engine_prefix_cache_hit_ratio)
        yield from (in_flight, healthy, waiting, hit_ratio)


class RouterMetrics:
    """Every metric of the router, in its own :class:`CollectorRegistry`."""

    def __init__(self, backends: Callable[[], Iterable[Backend]]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "kvroute_requests", "Proxied requests by backend, policy, endpoint and final status "
            "(499: the client went away; 502: the stream broke after its headers were sent).",
            ["backend", "policy", "endpoint", "status"], registry=registry,
        )
        self.request_duration = Histogram(
            "kvroute_request_duration_seconds", "Time from receiving a request to its last byte sent.",
            ["backend", "policy"], buckets=DURATION_BUCKETS, registry=registry,
        )
        self.time_to_first_token = Histogram(
            "kvroute_time_to_first_token_seconds", "Time from receiving a streamed request to its first chunk.",
            ["backend", "policy"], buckets=TTFT_BUCKETS, registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens", "Prompt tokens the engines reported (usage.prompt_tokens).",
            ["backend", "policy"], registry=registry,
        )
        self.predicted_cached_tokens = Counter(
            "kvroute_predicted_cached_tokens", "Prompt tokens the router predicted to be cached where it sent them.",
            ["backend", "policy"], registry=registry,
        )
        self.observed_cached_tokens = Counter(
            "kvroute_observed_cached_tokens", "Cached prompt tokens the engines reported "
            "(usage.prompt_tokens_details.cached_tokens).",
            ["backend", "policy"], registry=registry,
        )
        self.routing_decisions = Counter(
            "kvroute_routing_decisions", "Routing decisions by policy and reason.",
            ["policy", "reason"], registry=registry,
        )
        self.index_blocks = Gauge(
            "kvroute_index_blocks", "Blocks the router's prefix index holds per backend.",
            ["backend"], registry=registry,
        )
        self.index_bytes = Gauge(
            "kvroute_index_bytes", "Memory of the router's prefix index in bytes.", registry=registry
        )
        self.kv_events_state = Gauge(
            "kvroute_kv_events_state", "KV event subscription per backend "
            "(0 off, 1 connected, 2 stale/silent, 3 replaying after a gap).",
            ["backend"], registry=registry,
        )
        registry.register(_BackendStateCollector(backends))
        self._request_children: dict[tuple[str, str, str, str], Counter] = {}
        self._pair_children: dict[tuple[str, str], _PerBackendPolicy] = {}
        self._decision_children: dict[tuple[str, str], Counter] = {}

    # --- hot path ----------------------------------------------------------------------
    def record_request(
        self,
        backend: str,
        policy: str,
        endpoint: str,
        status: str,
        duration_s: float,
        ttft_s: float | None,
        prompt_tokens: int | None,
        predicted_cached_tokens: int,
        observed_cached_tokens: int | None,
    ) -> None:
        """Count one finished attempt. Token counters move only when the engine reported usage,
        so predicted and observed hit rates are ratios over the same requests."""
        key = (backend, policy, endpoint, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(*key)
        counter.inc()
        pair = self._pair(backend, policy)
        pair.duration.observe(duration_s)
        if ttft_s is not None:
            pair.ttft.observe(ttft_s)
        if prompt_tokens is not None:
            pair.prompt_tokens.inc(prompt_tokens)
            pair.predicted_cached.inc(min(predicted_cached_tokens, prompt_tokens))
            if observed_cached_tokens:
                pair.observed_cached.inc(observed_cached_tokens)

    def record_decision(self, policy: str, reason: str) -> None:
        """Count one routing decision."""
        key = (policy, reason)
        counter = self._decision_children.get(key)
        if counter is None:
            counter = self._decision_children[key] = self.routing_decisions.labels(*key)
        counter.inc()

    def _pair(self, backend: str, policy: str) -> _PerBackendPolicy:
        key = (backend, policy)
        pair = self._pair_children.get(key)
        if pair is None:
            pair = self._pair_children[key] = _PerBackendPolicy(
                duration=self.request_duration.labels(backend, policy),
                ttft=self.time_to_first_token.labels(backend, policy),
                prompt_tokens=self.prompt_tokens.labels(backend, policy),
                predicted_cached=self.predicted_cached_tokens.labels(backend, policy),
                observed_cached=self.observed_cached_tokens.labels(backend, policy),
            )
        return pair

    # --- lifecycle ---------------------------------------------------------------------
    def forget_backend(self, url: str) -> None:
        """Drop every series labelled with this backend."""
        for key in [key for key in self._request_children if key[0] == url]:
            del self._request_children[key]
            self.requests.remove(*key)
        pair_families: tuple[MetricWrapperBase, ...] = (
            self.request_duration, self.time_to_first_token, self.prompt_tokens,
            self.predicted_cached_tokens, self.observed_cached_tokens,
        )
        for key in [key for key in self._pair_children if key[0] == url]:
            del self._pair_children[key]
            for family in pair_families:
                family.remove(*key)
        for gauge in (self.index_blocks, self.kv_events_state):
            try:
                gauge.remove(url)
            except KeyError:
                pass  # never set for this backend

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
