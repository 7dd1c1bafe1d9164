"""vllm_bench_serve's own logic: reading vLLM's client result, the per-target summary.

The client and the engines themselves need vLLM; the real runs are in
``benchmarks/results/real-vllm-bench-serve.json``.
"""

from __future__ import annotations

import pytest

from kvroute.benchmarks.vllm_bench_serve import ClientResult, Run, format_table, parse_client_result, summarize

#: The fields of a ``vllm bench serve --save-result --metric-percentiles 50,99`` file (0.32)
#: that we read, among some we do not.
CLIENT_JSON = {
    "date": "20261202-043000",
    "backend": "openai",
    "duration": 7.53,
    "completed": 190,
    "failed": 2,
    "request_throughput": 25.23,
    "output_throughput": 201.8,
    "mean_ttft_ms": 150.2,
    "median_ttft_ms": 131.0,
    "std_ttft_ms": 40.0,
    "p50_ttft_ms": 131.0,
    "p99_ttft_ms": 780.5,
    "mean_e2el_ms": 300.0,
    "p99_e2el_ms": 900.0,
}


def test_parse_client_result_reads_throughput_and_ttft_percentiles() -> None:
    assert parse_client_result(CLIENT_JSON) == ClientResult(
        completed=190,
        failed=2,
        duration_s=7.53,
        request_throughput=25.23,
        ttft_p50_ms=131.0,
        ttft_p99_ms=780.5,
        ttft_mean_ms=150.2,
    )


def test_parse_client_result_names_a_missing_percentile() -> None:
    # Without --metric-percentiles 50,99 the client writes no p50 field.
    without_p50 = {key: value for key, value in CLIENT_JSON.items() if key != "p50_ttft_ms"}
    with pytest.raises(KeyError, match="p50_ttft_ms"):
        parse_client_result(without_p50)


def _run(target: str, hit_rate: float | None, p99_ms: float | None, cpu_s: float | None = None) -> Run:
    client = None if p99_ms is None else ClientResult(192, 0, 8.0, 24.0, 100.0, p99_ms, 120.0)
    return Run(target, 0, hit_rate, 0.0, 0.0, {}, client, (1.0, 1.0, 1.0), router_cpu_s=cpu_s)


def test_summary_is_median_and_range_per_target_counting_failed_runs() -> None:
    runs = [
        _run("cache_aware", 0.80, 900.0, 0.6),
        _run("peer:sglang-router", 0.88, 700.0, 0.3),
        _run("cache_aware", 0.70, 500.0, 0.7),
        _run("cache_aware", 0.90, None, 0.5),  # the client failed; the engines still counted
    ]
    rows = summarize(runs)
    assert [row["target"] for row in rows] == ["cache_aware", "peer:sglang-router"]
    cache_aware = rows[0]
    assert cache_aware["runs"] == 3 and cache_aware["failed_runs"] == 1
    assert cache_aware["hit_rate"] == {"median": 0.80, "min": 0.70, "max": 0.90}
    assert cache_aware["ttft_p99_ms"] == {"median": 700.0, "min": 500.0, "max": 900.0}
    table = format_table(rows).splitlines()
    assert table[1].split()[:2] == ["cache_aware", "0.800"]
    assert "700 [500-900]" in table[1]
    assert cache_aware["router_cpu_s"] == {"median": 0.6, "min": 0.5, "max": 0.7}
    assert table[1].rstrip().endswith("0.60 [0.50-0.70]")
