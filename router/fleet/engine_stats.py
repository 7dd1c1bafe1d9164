"""What each engine says about itself: scrape its ``/metrics`` and keep the numbers routing uses.

vLLM and SGLang both export Prometheus text. Of the hundreds of series a vLLM replica
exports (histograms mostly), routing needs a handful:

============================  ==================================  ==========================
                              vLLM                                SGLang (--enable-metrics)
============================  ==================================  ==========================
running requests              ``vllm:num_requests_running``       ``sglang:num_running_reqs``
waiting requests              ``vllm:num_requests_waiting``       ``sglang:num_queue_reqs``
KV cache usage (0..1)         ``vllm:kv_cache_usage_perc``        ``sglang:token_usage``
prefix-cache lookups, tokens  ``vllm:prefix_cache_queries_total`` ``sglang:prompt_tokens_total``
prefix-cache hits, tokens     ``vllm:prefix_cache_hits_total``    ``sglang:cached_tokens_total``
cache size                    ``vllm:cache_config_info`` labels   ``sglang:max_total_num_tokens``
                              ``kv_cache_size_tokens``, else      ``sglang:cache_config_info``
                              ``block_size`` x ``num_gpu_blocks`` ``page_size`` x ``num_pages``
============================  ==================================  ==========================

The names are the engine modules' (``kvroute.router.engines.vllm.SERIES``, ``...sglang.SERIES``);
``kind`` is the engine whose names a page uses. SGLang's page size 1 (token-granular)
gives no ``block_size``: the router keeps its own (see :mod:`kvroute.router.engines.sglang`).

Older vLLM releases name two of them ``vllm:gpu_cache_usage_perc`` and
``vllm:gpu_prefix_cache_{queries,hits}_total``; both spellings are read. An engine with
several data-parallel ranks exports one series per rank: counts, counters and capacity
are summed, usage is the mean.

A backend that is one data-parallel rank (``BackendConfig.data_parallel_rank``) reads only
its rank's series (``EngineAPI.rank_label``: vLLM labels them ``engine="<rank>"``, SGLang
``dp_rank="<rank>"``); its engine's page is fetched once per round for all its ranks.

The hit ratio is measured between two scrapes (delta hits / delta lookups), so it says how
the cache does now, not since the engine started; with no lookups in between the previous
ratio stands. A counter that went down means the engine restarted: the new value is the
delta. SGLang's own ``sglang:cache_hit_rate`` gauge is used only when its counters are
missing.

Only lines of the wanted series are handed to ``prometheus_client``'s parser, so a scrape
of a busy vLLM (100 KB of histograms) costs well under a millisecond of the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from ssl import SSLContext

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router.engines import ENGINES, EngineAPI
from kvroute.router.fleet.backends import Backend

log = logging.getLogger("kvroute.engine_stats")

#: The engine module whose metric names a scrape matched (kvroute.router.engines), else "unknown".
EngineKind = str

#: Listener of fresh stats: ``(backend url, stats)``; e.g. the routing engine's block size.
StatsListener = Callable[[str, "EngineStats"], None]

# Sample name -> (engine, the EngineStats field it feeds); each engine module lists its own.
_SERIES: dict[str, tuple[EngineAPI, str]] = {
    name: (engine, field_name) for engine in ENGINES.values() for name, field_name in engine.series.items()
}
_CACHE_INFO: dict[str, EngineAPI] = {
    engine.cache_info.name: engine for engine in ENGINES.values() if engine.cache_info is not None
}
_PREFIXES = (*_SERIES, *_CACHE_INFO)
_MEAN_FIELDS = frozenset({"kv_usage", "engine_hit_rate"})
# SGLang's newer cached_tokens_total splits by cache_source; only its "total" is the sum.
_PARTIAL_LABEL, _WHOLE_VALUE = "cache_source", "total"


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape of one engine; a field is None when the engine did not export it."""

    kind: EngineKind = "unknown"
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    #: Tokens per KV block, and the cache size in tokens (blocks x block size).
    block_size: int | None = None
    capacity_tokens: int | None = None
    #: Cumulative prompt tokens looked up in / found in the prefix cache (the engine's counters).
    prefix_queries_tokens: float | None = None
    prefix_hit_tokens: float | None = None
    #: Hits / lookups between the previous scrape and this one (see the module docstring).
    hit_ratio: float | None = None
    #: ``time.monotonic()`` of the scrape.
    scraped_at: float = 0.0
    #: Data-parallel ranks the page has series of (1: none named).
    ranks: int = 1


def parse_metrics(text: str, *, rank: int | None = None, scraped_at: float | None = None) -> EngineStats:
    """The routing-relevant numbers of one ``/metrics`` page (vLLM or SGLang names); with
    ``rank``, of that data-parallel rank's series only.

    ``hit_ratio`` is left None here (it needs two scrapes: see :func:`with_hit_ratio`),
    except that SGLang's own hit-rate gauge fills it when its counters are missing.
    """
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    kind: EngineKind = "unknown"
    block_size: int | None = None
    capacity_in_info = 0  # tokens (or blocks x block size), summed over ranks
    wanted_rank = None if rank is None else str(rank)
    ranks_seen: set[str] = set()
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            info_of = _CACHE_INFO.get(sample.name)
            series = _SERIES.get(sample.name)
            owner = info_of or (series[0] if series is not None else None)
            if owner is None:
                continue  # a longer name sharing a wanted prefix, e.g. a histogram's _bucket
            sample_rank = sample.labels.get(owner.rank_label) if owner.rank_label is not None else None
            if sample_rank is not None:
                ranks_seen.add(sample_rank)
                if wanted_rank is not None and sample_rank != wanted_rank:
                    continue  # another rank's series
            if info_of is not None and info_of.cache_info is not None:
                kind = info_of.name
                cache_info = info_of.cache_info
                size = _int_label(sample.labels, cache_info.size_label)
                blocks = _int_label(sample.labels, cache_info.count_label)
                tokens = _int_label(sample.labels, cache_info.tokens_label) if cache_info.tokens_label else None
                if size:
                    block_size = info_of.index_block_size(size)
                if tokens:
                    capacity_in_info += tokens
                elif size and blocks:
                    capacity_in_info += blocks * size
                continue
            assert series is not None  # the owner was found by it
            if sample.labels.get(_PARTIAL_LABEL, _WHOLE_VALUE) != _WHOLE_VALUE:
                continue
            engine, field_name = series
            if kind == "unknown":
                kind = engine.name
            sums[field_name] = sums.get(field_name, 0.0) + sample.value
            counts[field_name] = counts.get(field_name, 0) + 1
    for name in _MEAN_FIELDS & sums.keys():
        sums[name] /= counts[name]

    capacity = sums.get("capacity_tokens")
    if capacity_in_info:
        capacity = float(capacity_in_info)  # summed over ranks
    engine_hit_rate = sums.get("engine_hit_rate")
    has_counters = "prefix_queries_tokens" in sums and "prefix_hit_tokens" in sums
    return EngineStats(
        kind=kind,
        running=_as_int(sums.get("running")),
        waiting=_as_int(sums.get("waiting")),
        kv_usage=sums.get("kv_usage"),
        block_size=block_size,
        capacity_tokens=_as_int(capacity) or None,
        prefix_queries_tokens=sums.get("prefix_queries_tokens"),
        prefix_hit_tokens=sums.get("prefix_hit_tokens"),
        hit_ratio=engine_hit_rate if not has_counters else None,
        scraped_at=time.monotonic() if scraped_at is None else scraped_at,
        ranks=max(1, len(ranks_seen)),
    )


def with_hit_ratio(current: EngineStats, previous: EngineStats | None) -> EngineStats:
    """``current`` with ``hit_ratio`` = delta hits / delta lookups since ``previous``."""
    queries, hits = current.prefix_queries_tokens, current.prefix_hit_tokens
    if queries is None or hits is None:
        return current
    if (
        previous is None
        or previous.prefix_queries_tokens is None
        or previous.prefix_hit_tokens is None
        or queries < previous.prefix_queries_tokens  # the engine restarted: counters reset
    ):
        delta_queries, delta_hits = queries, hits
        carried = None
    else:
        delta_queries = queries - previous.prefix_queries_tokens
        delta_hits = hits - previous.prefix_hit_tokens
        carried = previous.hit_ratio
    if delta_queries <= 0:
        return replace(current, hit_ratio=carried)
    ratio = min(1.0, max(0.0, delta_hits / delta_queries))
    return replace(current, hit_ratio=ratio)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        return int(float(labels[name]))
    except (KeyError, ValueError):
        return None


def _as_int(value: float | None) -> int | None:
    return None if value is None else int(value)


async def scrape(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    ssl: SSLContext | bool = True,
) -> EngineStats:
    """GET ``{url}/metrics`` once (``url`` with its path prefix; ``headers``, ``ssl``: the
    backend's :class:`~kvroute.router.fleet.backend_access.BackendAccess`) and parse it. Raises on HTTP or
    connection errors."""
    return parse_metrics(await _metrics_page(session, url, timeout_s=timeout_s, headers=headers, ssl=ssl))


async def _metrics_page(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None,
    ssl: SSLContext | bool,
) -> str:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(f"{url}/metrics", headers=headers, ssl=ssl, timeout=timeout) as response:
        response.raise_for_status()
        return await response.text()


class EngineScraper:
    """Scrapes every backend's ``/metrics`` and hands the results to the backends.

    Each :class:`~kvroute.router.fleet.backends.Backend` gets ``update_engine_stats(...)``; listeners
    (the routing engine, for the engine's block size) get the full :class:`EngineStats`.
    The last stats per backend are kept for the between-scrapes hit ratio and dropped with
    :meth:`forget_backend`.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        listeners: Sequence[StatsListener] = (),
    ) -> None:
        self._session = session
        self._timeout_s = timeout_s
        self._listeners = list(listeners)
        self._last: dict[str, EngineStats] = {}

    def last(self, url: str) -> EngineStats | None:
        """The most recent stats of a backend, if one scrape succeeded."""
        return self._last.get(url)

    def forget_backend(self, url: str) -> None:
        """A backend left the pool."""
        self._last.pop(url, None)

    async def scrape_all(self, backends: Iterable[Backend]) -> None:
        """One round: scrape all given backends concurrently; failures are logged and skipped."""
        targets = list(backends)
        # One page per engine: the ranks of a data-parallel engine share it (fetched with the
        # first rank's credentials: a rank is the engine's, not another server).
        pages = {b.access.base_url: b.access for b in targets}
        results = await asyncio.gather(
            *(
                _metrics_page(
                    self._session,
                    url,
                    timeout_s=self._timeout_s,
                    headers=access.probe_headers,
                    ssl=access.aiohttp_ssl,
                )
                for url, access in pages.items()
            ),
            return_exceptions=True,
        )
        texts = dict(zip(pages, results, strict=True))
        for backend in targets:
            result = texts[backend.access.base_url]
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                log.debug("scraping %s/metrics failed: %r", backend.access.base_url, result)
                continue
            try:
                stats = parse_metrics(result, rank=backend.access.rank)
            except Exception as exc:  # a malformed page, as a failed scrape: skipped
                log.debug("parsing %s/metrics failed: %r", backend.access.base_url, exc)
                continue
            self.apply(backend, stats)

    def apply(self, backend: Backend, stats: EngineStats) -> EngineStats:
        """Record one scrape of ``backend``: computes its hit ratio and notifies everyone."""
        previous = self._last.get(backend.url)
        if stats.ranks > 1 and backend.access.rank is None and (previous is None or previous.ranks == 1):
            log.warning(
                "backend %s has %d data-parallel ranks, each with its own KV cache: route to them "
                "with --data-parallel-size %d (or data_parallel_size on the backend), else the "
                "engine's own balancer picks one whatever it holds",
                backend.url,
                stats.ranks,
                stats.ranks,
            )
        stats = with_hit_ratio(stats, previous)
        page_size = backend.engine_facts.page_size
        if stats.block_size is None and page_size:  # e.g. SGLang's /server_info page_size
            stats = replace(stats, block_size=backend.engine.index_block_size(page_size))
        self._last[backend.url] = stats
        backend.update_engine_stats(
            running=stats.running,
            waiting=stats.waiting,
            kv_usage=stats.kv_usage,
            prefix_cache_hit_ratio=stats.hit_ratio,
            capacity_tokens=stats.capacity_tokens,
        )
        for listener in self._listeners:
            listener(backend.url, stats)
        return stats


async def scrape_loop(
    backends: Callable[[], Iterable[Backend]],
    session: aiohttp.ClientSession,
    *,
    interval_s: float,
    timeout_s: float,
    listeners: Sequence[StatsListener] = (),
    scraper: EngineScraper | None = None,
) -> None:
    """Scrape every backend every ``interval_s`` until cancelled (the app runs it as a task).

    ``backends`` is called each round, so backends added or removed meanwhile are followed.
    Pass ``scraper`` to keep a handle on it (e.g. to call ``forget_backend``).
    """
    scraper = scraper or EngineScraper(session, timeout_s=timeout_s, listeners=listeners)
    while True:
        started = time.monotonic()
        try:
            await scraper.scrape_all(backends())
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one round must not end scraping for good
            log.exception("engine stats scrape round failed")
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
