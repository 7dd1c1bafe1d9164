"""SGLang's API as the router uses it (facts and sources: ``shared/notes/sglang.md``;
paths below are in sgl-project/sglang, ``python/sglang/srt/``).

* Endpoints: the OpenAI ones (``entrypoints/openai/``) and the native ``/generate``
  (``entrypoints/http_server.py``, body ``managers/io_struct.py`` ``GenerateReqInput``):
  exactly one of ``text`` / ``input_ids`` (a list of them is a batch; the router routes
  by the first), ``sampling_params.max_new_tokens`` (default 128), ``stream``.
* Cached tokens: ``/generate`` answers carry ``meta_info.cached_tokens`` always, in every
  streaming event (text is cumulative; the last event counts). The OpenAI endpoints carry
  ``usage.prompt_tokens_details.cached_tokens`` only with ``--enable-cache-report`` and
  only when > 0 (else null, ``openai/usage_processor.py``): with the flag known from
  ``/server_info`` a null is a miss (0); without it nothing is learnt.
* Load: ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``, ``sglang:token_usage``
  (``metrics/collector.py``); ``/get_load`` and ``/v1/loads`` say the same per DP rank.
* Prefix-cache counters: ``sglang:prompt_tokens_total`` / ``sglang:cached_tokens_total``
  (newer: label ``cache_source``, of which only ``total`` is summed).
* Capacity and granularity: ``max_total_num_tokens`` and ``page_size`` in ``/server_info``,
  newer ``sglang:max_total_num_tokens`` and ``sglang:cache_config_info{page_size,num_pages}``.
  The radix cache matches token by token at page size 1 (the default), page by page
  otherwise, capped at ``input_len - 1`` (``mem_cache/radix_cache.py``): the router's
  ``min(match, (len - 1) // size * size)`` rule is SGLang's with ``size = page_size``.
  At page size 1 the router keeps its own block size (a per-token index would cost 16x
  the memory and hashing) and under-predicts by the partial block; see the README.
* Cache reset: ``/flush_cache`` (400 while requests run).
* Chat template: the HF tokenizer's, as vLLM (``template_manager.py``), unless the server
  was started with ``--chat-template NAME``: then the router's rendering may differ.
* KV events (``disaggregation/kv_events.py``): vLLM's framing and layout, one
  ``BlockStored`` per page with SGLang's own hashes: the precise index re-hashes
  ``token_ids`` as it does for vLLM. Events are flushed at prefill batches and every 40
  decode steps, so they lag more than vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvroute.router.engines.base import CacheInfoMetric, Endpoint, EngineAPI, EngineFacts
from kvroute.router.engines.openai import CHAT, COMPLETIONS, EMBEDDINGS
from kvroute.router.engines.usage import Usage, UsageFormat, is_count
from kvroute.tokenizer_index import RequestTokenizer


def meta_info_usage(obj: Any) -> Usage | None:
    """Usage of a ``/generate`` answer or event: its ``meta_info`` (of a batch, the first)."""
    if isinstance(obj, list):
        obj = obj[0] if obj else None
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        return None
    prompt, cached = meta.get("prompt_tokens"), meta.get("cached_tokens")
    return Usage(
        prompt_tokens=prompt if is_count(prompt) else None,
        cached_tokens=cached if is_count(cached) else None,
    )


META_INFO = UsageFormat(b'"meta_info"', meta_info_usage)


def generate_prompt(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> np.ndarray | None:
    """``input_ids`` (ids) or ``text`` (tokenized with special tokens, as SGLang's tokenizer
    manager does); of a batch, the first."""
    prompt = body.get("input_ids", body.get("text"))
    return tokenizer.encode_prompt_array(prompt) if prompt is not None else None


GENERATE = Endpoint(
    "/generate",
    "generate",
    False,
    META_INFO,
    False,
    generate_prompt,
    {
        "properties": {
            "text": {"type": ["string", "array"]},
            "input_ids": {"type": "array"},
            "sampling_params": {"type": "object"},
            "stream": {"type": ["boolean", "null"]},
            "rid": {"type": ["string", "array"]},
        }
    },
    rank_field="routed_dp_rank",
)

SERIES: dict[str, str] = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:prompt_tokens_total": "prefix_queries_tokens",
    "sglang:cached_tokens_total": "prefix_hit_tokens",
    "sglang:max_total_num_tokens": "capacity_tokens",
    "sglang:cache_hit_rate": "engine_hit_rate",
}


def observed(usage: Usage | None, facts: EngineFacts) -> int | None:
    """Cached tokens as SGLang means them: a null beside a usage is a miss when the server
    reports cache hits at all (``--enable-cache-report``)."""
    if usage is None:
        return None
    if usage.cached_tokens is None and usage.prompt_tokens is not None and facts.cache_report:
        return 0
    return usage.cached_tokens


def index_block_size(page_size: int | None) -> int | None:
    """Pages of 2+ tokens are SGLang's blocks; token granularity keeps the router's own."""
    return page_size if page_size and page_size > 1 else None


def facts_from_server_info(info: Mapping[str, Any]) -> EngineFacts:
    """What ``GET /server_info`` says that the router uses (newer servers nest scheduler
    state under ``internal_states``; the fields read here are top level in every version)."""
    page = info.get("page_size")
    capacity = info.get("max_total_num_tokens")
    if not is_count(capacity):
        states = info.get("internal_states")
        first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        capacity = first.get("max_total_num_tokens")
    report = info.get("enable_cache_report")
    version = info.get("version")
    return EngineFacts(
        page_size=page if is_count(page) and page > 0 else None,
        capacity_tokens=capacity if is_count(capacity) and capacity > 0 else None,
        cache_report=report if isinstance(report, bool) else None,
        version=version if isinstance(version, str) else None,
    )


SGLANG = EngineAPI(
    name="sglang",
    endpoints=(CHAT, COMPLETIONS, EMBEDDINGS, GENERATE),
    series=SERIES,
    cache_info=CacheInfoMetric("sglang:cache_config_info", "page_size", "num_pages"),
    reset_cache=("POST", "/flush_cache"),
    feedback=True,
    observed=observed,
    index_block_size=index_block_size,
    describe="SGLang: /generate meta_info.cached_tokens, sglang:* metrics, /server_info",
    rank_label="dp_rank",
)
