"""Merging the workers' expositions: every family has a rule, counters and histograms sum,
a state every worker sees is not multiplied."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.forwarding import metrics_merge
from kvroute.router.forwarding.metrics import RouterMetrics, RuntimeStats
from kvroute.router.routing.decisions import AttemptOutcome
from kvroute.router.routing.routing_engine import ConversationMemoState
from tests.servers import Scrape


def worker_metrics(requests: int, *, blocks: int, duration_s: float) -> RouterMetrics:
    metrics = RouterMetrics(
        lambda: [], lambda: RuntimeStats(active_requests=1, queued_requests=0, rejected={"queue_full": 2}, rate_limited_clients=0)
    )  # fmt: skip
    metrics.watch_peer_exchange(
        lambda: {"published": 3, "received": 4}, lambda: {"published": 5, "expired": 1}, lambda: {"succeeded": 2}
    )
    for _ in range(requests):
        metrics.record_request(
            AttemptOutcome(
                request_id="r",
                backend="http://a",
                policy="cache_aware",
                endpoint="chat",
                status="200",
                duration_s=duration_s,
                ttft_s=None,
                prompt_tokens=100,
                cached_tokens=50,
                predicted_cached_tokens=60,
            )
        )
        metrics.record_decision("cache_aware", "prefix_match")
    metrics.index_blocks.labels("http://a").set(blocks)
    metrics.index_bytes.set(1000)
    metrics.kv_events_state.labels("http://a").set(1)
    metrics.watch_chat_renders(lambda: {"lookups": requests, "reused": requests - 1, "mismatches": 0})
    metrics.watch_tokenizer_units(lambda: {"cached": requests, "words": 1, "words_compiled": 0, "library": 0})
    memo = ConversationMemoState(bytes=1000, max_bytes=4000, entries=2, lookups=requests, continued=requests - 1)
    metrics.watch_conversation_memo(lambda: {"render": memo, "ids": memo})
    return metrics


def test_every_family_the_router_exports_has_a_rule() -> None:
    text = worker_metrics(1, blocks=1, duration_s=0.1).render().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names - set(metrics_merge.RULES) == set()


def test_counters_and_histograms_sum_shared_state_takes_the_max() -> None:
    workers = [worker_metrics(3, blocks=10, duration_s=0.02), worker_metrics(5, blocks=12, duration_s=2.0)]
    families = metrics_merge.merge(metrics_merge.parse(w.render().decode()) for w in workers)
    scrape = Scrape.parse(metrics_merge.render(families).decode())
    assert scrape.value("kvroute_requests_total", backend="http://a", status="200") == 8
    assert scrape.value("kvroute_routing_decisions_total", reason="prefix_match") == 8
    assert scrape.value("kvroute_prompt_tokens_total") == 800
    assert scrape.value("kvroute_request_duration_seconds_count") == 8
    assert scrape.value("kvroute_request_duration_seconds_bucket", le="0.025") == 3
    assert scrape.value("kvroute_request_duration_seconds_bucket", le="+Inf") == 8
    assert abs(scrape.value("kvroute_request_duration_seconds_sum") - (3 * 0.02 + 5 * 2.0)) < 1e-9
    assert scrape.value("kvroute_rejected_requests_total", reason="queue_full") == 4
    assert scrape.value("kvroute_admission_active_requests") == 2
    assert scrape.value("kvroute_peer_placements_total", event="received") == 8
    assert scrape.value("kvroute_peer_load_reports_total", event="published") == 10
    assert scrape.value("kvroute_peer_handshakes_total", result="succeeded") == 4
    assert scrape.value("kvroute_chat_renders_total", event="reused") == 2 + 4  # each worker its own memo
    assert scrape.value("kvroute_tokenizer_units_total", source="cached") == 8  # each its own tokenizer
    assert scrape.value("kvroute_conversation_memo_turns_total", memo="ids", event="continued") == 2 + 4
    assert scrape.value("kvroute_conversation_memo_bytes", memo="render") == 2000  # each its own memo
    assert scrape.value("kvroute_conversation_memo_max_bytes", memo="ids") == 8000
    assert scrape.value("kvroute_index_blocks", backend="http://a") == 12  # max: the indexes converge
    assert scrape.value("kvroute_index_bytes") == 2000  # memory: sum
    assert scrape.value("kvroute_kv_events_state", backend="http://a") == 1
    start_times = [Scrape.parse(w.render().decode()).value("kvroute_process_start_time_seconds") for w in workers]
    assert scrape.value("kvroute_process_start_time_seconds") == min(start_times)


def test_worker_requests_counts_each_workers_own() -> None:
    parsed = [(index, metrics_merge.parse(worker_metrics(n, blocks=1, duration_s=0.1).render().decode()))
              for index, n in ((0, 2), (1, 7))]  # fmt: skip
    family = metrics_merge.worker_requests(parsed)
    assert [(sample.labels["worker"], sample.value) for sample in family.samples] == [("0", 2.0), ("1", 7.0)]
