"""The simulated SGLang replica (``kvroute sim-engine --api sglang``) over real sockets.

What each check stands for is in the parity table of the README's "SGLang" section.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from kvroute.benchmarks.sim_engine.cli import config_from_args, parser

pytestmark = pytest.mark.timeout(120)


def ids(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 1000, size=length).tolist()


def generate(url: str, **body: Any) -> Any:
    body.setdefault("sampling_params", {"max_new_tokens": 4})
    response = httpx.post(url + "/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def sglang(sim_engines: Any, page_size: int = 1, **options: Any) -> Any:
    (sim,) = sim_engines(1, api="sglang", block_size=page_size, **options)
    return sim


def test_the_cli_speaks_sglang_with_token_granular_pages_by_default() -> None:
    config = config_from_args(parser().parse_args(["--api", "sglang", "--enable-cache-report"]))
    assert (config.api, config.block_size, config.enable_cache_report) == ("sglang", 1, True)
    assert config_from_args(parser().parse_args(["--api", "sglang", "--page-size", "64"])).block_size == 64
    assert config_from_args(parser().parse_args([])).block_size == 16


def test_server_info_model_info_and_load(sim_engines: Any) -> None:
    sim = sglang(sim_engines, page_size=1, enable_cache_report=True)
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(sim.url + path, timeout=10).json()
        assert (info["page_size"], info["max_total_num_tokens"], info["enable_cache_report"]) == (1, 65536, True)
        assert info["version"]
    assert httpx.get(sim.url + "/model_info", timeout=10).json()["is_generation"] is True
    assert httpx.get(sim.url + "/get_load", timeout=10).json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    # vLLM's own paths are not SGLang's.
    assert httpx.post(sim.url + "/reset_prefix_cache", timeout=10).status_code == 404
    assert httpx.post(sim.url + "/tokenize", json={"prompt": "x"}, timeout=10).status_code == 404


def test_generate_reports_token_granular_cached_tokens_capped_at_input_len_minus_one(sim_engines: Any) -> None:
    sim = sglang(sim_engines, page_size=1)
    prompt = ids(1, 50)
    first = generate(sim.url, input_ids=prompt)
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert first["output_ids"] and first["text"]
    assert generate(sim.url, input_ids=prompt)["meta_info"]["cached_tokens"] == 49  # the last token is computed
    shares_37 = prompt[:37] + ids(2, 20)
    assert generate(sim.url, input_ids=shares_37)["meta_info"]["cached_tokens"] == 37  # no block rounding


def test_pages_round_the_match_down(sim_engines: Any) -> None:
    sim = sglang(sim_engines, page_size=16)
    prompt = ids(3, 50)
    generate(sim.url, input_ids=prompt)
    assert generate(sim.url, input_ids=prompt)["meta_info"]["cached_tokens"] == 48
    assert generate(sim.url, input_ids=prompt[:37] + ids(4, 20))["meta_info"]["cached_tokens"] == 32


def test_generate_streams_cumulative_text_with_meta_info_in_every_event(sim_engines: Any) -> None:
    sim = sglang(sim_engines, page_size=1, time_scale=20.0)
    prompt = ids(5, 40)
    whole = generate(sim.url, input_ids=prompt, sampling_params={"max_new_tokens": 12})
    with httpx.stream(
        "POST",
        sim.url + "/generate",
        timeout=30,
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 12}, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes())
    events = [event[len(b"data: ") :] for event in raw.split(b"\n\n") if event]
    assert events[-1] == b"[DONE]"
    objects = [orjson.loads(event) for event in events[:-1]]
    assert len(objects) > 1
    texts = [obj["text"] for obj in objects]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == whole["text"]
    assert all(obj["meta_info"]["cached_tokens"] == 39 for obj in objects)
    assert [obj["meta_info"]["finish_reason"] for obj in objects][-1] == {"type": "length", "length": 12}
    assert all(obj["meta_info"]["finish_reason"] is None for obj in objects[:-1])


def test_a_batch_answers_a_list_and_text_prompts_work(sim_engines: Any) -> None:
    sim = sglang(sim_engines)
    answers = generate(sim.url, text=["The quick brown fox", "jumps over"], rid=["a", "b"])
    assert [answer["meta_info"]["id"] for answer in answers] == ["a", "b"]
    assert all(answer["meta_info"]["prompt_tokens"] > 1 for answer in answers)
    bad = httpx.post(sim.url + "/generate", json={"text": "x", "input_ids": [1, 2]}, timeout=10)
    assert bad.status_code == 400 and "error" in bad.json()


@pytest.mark.parametrize("cache_report", [False, True])
def test_openai_usage_carries_cached_tokens_only_with_the_cache_report_flag(
    sim_engines: Any, cache_report: bool
) -> None:
    sim = sglang(sim_engines, enable_cache_report=cache_report)
    body = {"model": "sim", "prompt": ids(6, 30), "max_tokens": 2}
    first = httpx.post(sim.url + "/v1/completions", json=body, timeout=30).json()["usage"]
    second = httpx.post(sim.url + "/v1/completions", json=body, timeout=30).json()["usage"]
    assert first["prompt_tokens_details"] is None  # a miss is null, never 0
    assert second["prompt_tokens_details"] == ({"cached_tokens": 29} if cache_report else None)


def test_sglang_metric_names_and_flush_cache(sim_engines: Any) -> None:
    sim = sglang(sim_engines, page_size=1)
    prompt = ids(7, 20)
    generate(sim.url, input_ids=prompt)
    generate(sim.url, input_ids=prompt)
    scrape = sim.metrics()
    assert scrape.value("sglang:prompt_tokens_total") == 40
    assert scrape.value("sglang:cached_tokens_total") == 19
    assert scrape.value("sglang:cache_hit_rate") == pytest.approx(19 / 20)  # the last prefill batch
    assert scrape.value("sglang:num_requests_total") == 2
    assert scrape.value("sglang:max_total_num_tokens") == 65536
    assert scrape.label_values("sglang:cache_config_info", "page_size") == {"1"}
    assert not [name for name, _, _ in scrape.samples if name.startswith("vllm:")]
    for method in ("GET", "POST"):
        assert httpx.request(method, sim.url + "/flush_cache", timeout=10).status_code == 200
    assert generate(sim.url, input_ids=prompt)["meta_info"]["cached_tokens"] == 0


def test_kv_events_one_per_page_under_sglangs_sha256_chain() -> None:
    import hashlib
    import struct

    from kvroute.benchmarks.sim_engine.sglang_events import SGLangEventHashes

    hashes = SGLangEventHashes()
    tokens = [5, 6, 7, 8, 9, 10]
    events = hashes.stored(np.array([101, 102, 103], dtype=np.uint64), tokens, 0, 3, 2, None)
    assert [event.token_ids for event in events] == [[5, 6], [7, 8], [9, 10]]
    first = hashlib.sha256(struct.pack("<2I", 5, 6)).digest()
    second = hashlib.sha256(first + struct.pack("<2I", 7, 8)).digest()
    assert events[0].block_hashes == [int.from_bytes(first[:8], "big", signed=True)]
    assert events[0].parent_block_hash is None
    assert events[1].block_hashes == [int.from_bytes(second[:8], "big", signed=True)]
    assert events[1].parent_block_hash == events[0].block_hashes[0]
    assert events[2].parent_block_hash == events[1].block_hashes[0]
    # A later store continues the chain from the held parent page; removals use the same hashes.
    more = hashes.stored(np.array([101, 102, 103, 104], dtype=np.uint64), [*tokens, 11, 12], 3, 4, 2, None)
    assert more[0].parent_block_hash == events[2].block_hashes[0]
    removed = hashes.removed([103, 104, 999])
    assert [event.block_hashes for event in removed] == [events[2].block_hashes, more[0].block_hashes]
