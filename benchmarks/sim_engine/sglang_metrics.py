"""Prometheus metrics under SGLang's names and labels (``--enable-metrics``).

Sources (sgl-project/sglang, python/sglang/srt/): ``metrics/collector.py`` (newer
``observability/metrics_collector.py``). The attributes mirror
:class:`kvroute.benchmarks.sim_engine.metrics.EngineMetrics`, so the scheduler updates either
without knowing which engine it plays; the vLLM-only pairs SGLang has no series for are
:class:`~kvroute.benchmarks.sim_engine.metrics.Unexported`.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.metrics import E2E_BUCKETS, TTFT_BUCKETS, Unexported


class SGLangMetrics:
    """One replica's SGLang series; label children bound once."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        labels = ("model_name", "engine_type", "tp_rank", "pp_rank")
        values = (config.models[0], "unified", "0", "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.waiting = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.kv_usage = gauge("sglang:token_usage", "The token usage.")
        self.prefix_queries = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.prefix_hits = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.prefill_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate (last prefill batch).")
        self.prompt_tokens = Unexported()
        self.prompt_tokens_cached = Unexported()
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("sglang:num_requests", "Number of requests processed.")
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=registry,
        ).labels(*values)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            labels,
            buckets=E2E_BUCKETS,
            registry=registry,
        ).labels(*values)
        gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache.").set(
            config.num_blocks * config.block_size
        )
        info = {
            "model_name": config.models[0],
            "page_size": str(config.block_size),
            "num_pages": str(config.num_blocks),
        }
        Gauge("sglang:cache_config_info", "Cache configuration.", tuple(info), registry=registry).labels(**info).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
