"""Prometheus metrics under vLLM's own names and labels, one registry per replica.

A router (or a dashboard) that reads a real vLLM's ``/metrics`` reads these unchanged:
counters in tokens for the prefix cache, gauges for the queues and KV usage, and the
``cache_config_info`` info-style gauge carrying ``block_size`` and ``num_gpu_blocks``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvroute.benchmarks.sim_engine.config import SimEngineConfig

# vLLM's bucket boundaries for these two histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Unexported:
    """A series the engine played does not export: the scheduler's updates go nowhere."""

    def inc(self, amount: float = 1.0) -> None:
        return None

    def set(self, value: float) -> None:
        return None


class EngineMetrics:
    """The replica's metrics; label children are bound once so updates stay cheap."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (config.models[0], config.engine_id)
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.prefill_hit_rate = Unexported()  # SGLang's cache_hit_rate; vLLM has no such gauge
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that finished.",
            (*labels, "finished_reason"),
            registry=registry,
        ).labels(*values, "length")
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=registry,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=E2E_BUCKETS,
            registry=registry,
        ).labels(*values)
        cache_info = {
            "engine": config.engine_id,
            "model_name": config.models[0],
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(config.num_blocks),
            "num_cpu_blocks": "0",
            "enable_prefix_caching": "True",
            "cache_dtype": "auto",
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            tuple(cache_info),
            registry=registry,
        ).labels(**cache_info).set(1)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
