"""One ``/metrics`` for several worker processes: their expositions merged sample by sample.

With ``kvroute serve --workers N`` each worker keeps its own :class:`RouterMetrics` (plain
counters, built into families at scrape time, so prometheus-client's multiprocess mode does
not apply). The worker a scrape lands on fetches every sibling's own exposition and merges
them here: samples with the same name and labels are combined by their family's rule.

* ``sum``: what each worker counts of its own traffic or holds itself: counters and
  histograms (requests, tokens, decisions, latency buckets, breaker trips, rejections),
  the in-flight requests and work per backend (each worker exports its own connections'),
  and process resources (memory, CPU seconds, file descriptors, event-loop tasks).
* ``max``: state every worker observes of the same thing: a backend's health, breaker
  state and engine, the engine's own queue and hit ratio, the index's blocks per backend
  (the workers' indexes converge through the placement exchange, so their sum would count
  a block once per worker), the KV-event stream state, the fd limit.
* ``min``: ``kvroute_process_start_time_seconds`` (the oldest worker).

Every family the router exports has an explicit rule in :data:`RULES` (a test checks it);
an unknown family is summed when it is a counter or histogram and maxed otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Rule = Literal["sum", "max", "min"]

#: Family name (as the text parser names it: counters without ``_total``) -> how workers combine.
RULES: dict[str, Rule] = {
    # per-request counters and histograms
    "kvroute_requests": "sum",
    "kvroute_request_duration_seconds": "sum",
    "kvroute_time_to_first_token_seconds": "sum",
    "kvroute_prompt_tokens": "sum",
    "kvroute_predicted_cached_tokens": "sum",
    "kvroute_observed_cached_tokens": "sum",
    "kvroute_routing_decisions": "sum",
    "kvroute_rejected_requests": "sum",
    "kvroute_peer_placements": "sum",
    "kvroute_peer_load_reports": "sum",
    "kvroute_peer_evidence": "sum",
    "kvroute_peer_stored_responses": "sum",
    "kvroute_peer_handshakes": "sum",
    "kvroute_chat_renders": "sum",
    "kvroute_tokenizer_units": "sum",
    "kvroute_conversation_memo_turns": "sum",
    "kvroute_tokenizer_new_words": "sum",
    "kvroute_cache_model_answers": "sum",
    "kvroute_kv_events_lag_seconds": "sum",
    "kvroute_backend_breaker_trips": "sum",
    # each worker's own load and resources
    "kvroute_backend_in_flight_requests": "sum",
    "kvroute_backend_in_flight_work_tokens": "sum",
    "kvroute_admission_active_requests": "sum",
    "kvroute_admission_queued_requests": "sum",
    "kvroute_rate_limit_clients": "sum",
    "kvroute_asyncio_tasks": "sum",
    "kvroute_index_bytes": "sum",
    "kvroute_conversation_memo_bytes": "sum",  # each worker its own memo
    "kvroute_conversation_memo_max_bytes": "sum",
    "kvroute_conversation_memo_entries": "sum",
    "kvroute_process_virtual_memory_bytes": "sum",
    "kvroute_process_resident_memory_bytes": "sum",
    "kvroute_process_cpu_seconds": "sum",
    "kvroute_process_open_fds": "sum",
    # the same state seen by every worker
    "kvroute_stored_responses": "max",  # each worker learns its siblings' ids too
    "kvroute_backend_healthy": "max",
    "kvroute_backend_breaker_state": "max",
    "kvroute_backend_engine": "max",
    "kvroute_engine_requests_waiting": "max",
    "kvroute_engine_prefix_cache_hit_ratio": "max",
    "kvroute_index_blocks": "max",
    "kvroute_kv_events_state": "max",
    "kvroute_process_max_fds": "max",
    "kvroute_process_start_time_seconds": "min",
    # each worker's own model of the engine: the one that evicts earliest, the most evictions seen
    "kvroute_cache_model_capacity_ratio": "min",
    "kvroute_cache_model_eviction_rate": "max",
}


def _sum(a: float, b: float) -> float:
    return a + b


def _max(a: float, b: float) -> float:
    return a if a >= b else b


def _min(a: float, b: float) -> float:
    return a if a <= b else b


_COMBINE: dict[Rule, Callable[[float, float], float]] = {"sum": _sum, "max": _max, "min": _min}

#: The per-worker total this module adds: requests each worker served (balance across workers).
WORKER_REQUESTS = "kvroute_worker_requests"


def rule_of(family: Metric) -> Rule:
    """The family's rule: :data:`RULES`, else by its type."""
    rule = RULES.get(family.name)
    if rule is not None:
        return rule
    return "sum" if family.type in ("counter", "histogram", "summary") else "max"


def parse(text: str) -> list[Metric]:
    """The families of one exposition (prometheus-client's text parser)."""
    return list(text_string_to_metric_families(text))


class _Families:
    """Families in a fixed order, for ``generate_latest`` (anything with ``collect``)."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge(expositions: Iterable[Sequence[Metric]]) -> list[Metric]:
    """The families of several workers combined by :func:`rule_of`, in first-seen order."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for families in expositions:
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            combine = _COMBINE[rule_of(family)]
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                previous = samples.get(key)
                samples[key] = sample.value if previous is None else combine(previous, sample.value)
    for name, family in merged.items():
        family.samples = [Sample(sample, dict(labels), value) for (sample, labels), value in values[name].items()]
    return list(merged.values())


def worker_requests(expositions: Sequence[tuple[int, Sequence[Metric]]]) -> Metric:
    """``kvroute_worker_requests{worker}``: the requests each answering worker has counted."""
    family = GaugeMetricFamily(
        WORKER_REQUESTS, "Proxied requests each router worker has counted (kvroute_requests_total).", labels=["worker"]
    )
    for index, families in expositions:
        total = sum(
            sample.value
            for family in families
            if family.name == "kvroute_requests"
            for sample in family.samples
            if sample.name == "kvroute_requests_total"
        )
        family.add_metric([str(index)], total)
    return family


def render(families: Sequence[Metric]) -> bytes:
    """The text exposition of ``families``."""
    return generate_latest(_Families(families))  # type: ignore[arg-type]
