"""What kvroute needs to know about one engine's API: the protocol each engine module fills.

An engine module (:mod:`kvroute.router.engines.vllm`, :mod:`kvroute.router.engines.sglang`,
:mod:`kvroute.router.engines.generic`) is the one place where that engine's paths, body shapes,
usage report, metric names, cache granularity and cache-reset call are written down.
The proxy, the routing engine, the usage tap, the metrics scraper and the OpenAPI
document ask it instead of testing paths, so a new engine is one new module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvroute.router.engines.usage import Usage, UsageFormat
from kvroute.router.errors import OPENAI_ERRORS, ErrorTypes
from kvroute.tokenizer_index import RequestTokenizer

#: Token ids of a request's prompt as the engine will compute them (None: cannot tell).
PromptReader = Callable[[RequestTokenizer, Mapping[str, Any]], "np.ndarray | None"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One proxied POST path and how the router treats its body and answer."""

    path: str
    #: Short label for metrics (``endpoint`` label).
    name: str
    #: OpenAI endpoints need ``model``; vLLM's /tokenize and SGLang's /generate do not.
    requires_model: bool
    #: Where the answer reports prompt and cached tokens (None: it does not).
    usage: UsageFormat | None
    #: Streams whose final usage chunk the router may request with ``stream_options``.
    accepts_stream_options: bool
    #: The prompt's token ids (None: this endpoint's prompt is not matched against caches).
    prompt: PromptReader | None = None
    #: The request body's schema in the router's OpenAPI document (what the router reads).
    schema: Mapping[str, Any] | None = None
    #: The body field that sends a request to one data-parallel rank, where the engine reads
    #: the rank from the body (SGLang's ``/generate``: ``routed_dp_rank``); None: the header
    #: the backend's calls carry is enough (vLLM's, and SGLang's OpenAI endpoints).
    rank_field: str | None = None
    #: The ``error.type`` of the router's own errors on this path (its API's clients read them).
    errors: ErrorTypes = OPENAI_ERRORS

    @property
    def reports_usage(self) -> bool:
        return self.usage is not None


@dataclass(frozen=True, slots=True)
class CacheInfoMetric:
    """An info-style gauge whose labels give the KV cache's granularity and size."""

    name: str
    #: Label with the tokens per block (vLLM ``block_size``, SGLang ``page_size``).
    size_label: str
    #: Label with the number of blocks (vLLM ``num_gpu_blocks``, SGLang ``num_pages``).
    count_label: str
    #: Label with the cache's size in tokens, where the engine gives it (vLLM's
    #: ``kv_cache_size_tokens``); else the size is blocks x tokens per block.
    tokens_label: str | None = None


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What an engine said about itself when it was detected (``/server_info``); None: unknown."""

    page_size: int | None = None
    capacity_tokens: int | None = None
    #: SGLang's ``--enable-cache-report``: its OpenAI answers then carry cached tokens.
    cache_report: bool | None = None
    version: str | None = None
    #: How auto-detection told the engine (``/server_info``, ``/metrics``...); None: not detected.
    detected_by: str | None = None


@dataclass(frozen=True, slots=True)
class EngineAPI:
    """One engine's API as the router uses it; each engine module defines one."""

    name: str
    endpoints: tuple[Endpoint, ...]
    #: Prometheus sample name -> :class:`kvroute.router.fleet.engine_stats.EngineStats` field.
    series: Mapping[str, str]
    cache_info: CacheInfoMetric | None
    #: ``(method, path)`` that empties the prefix cache (benchmarks), None when there is none.
    reset_cache: tuple[str, str] | None
    #: Whether its cached-token reports may teach the routing engine (feedback).
    feedback: bool
    #: How an answer's usage becomes the cached tokens the router learns from.
    observed: Callable[[Usage | None, EngineFacts], int | None]
    #: Index block size for an engine page size (None: keep the router's own).
    index_block_size: Callable[[int | None], int | None]
    describe: str = ""
    #: The label that tells one data-parallel rank's metrics from another's (None: none).
    rank_label: str | None = None
    #: The paths of ``endpoints`` (derived; a set for the proxy's per-request filter).
    paths: frozenset[str] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", frozenset(endpoint.path for endpoint in self.endpoints))

    def serves(self, path: str) -> bool:
        return path in self.paths


def cached_as_reported(usage: Usage | None, facts: EngineFacts) -> int | None:
    """The engine's cached tokens exactly as reported (vLLM always reports them)."""
    return usage.cached_tokens if usage is not None else None


def whole_blocks(page_size: int | None) -> int | None:
    """vLLM caches whole blocks: the index uses the engine's block size."""
    return page_size if page_size and page_size > 0 else None
