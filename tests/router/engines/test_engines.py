"""The engine modules: what each engine serves, how its prompts and usage read, its metrics."""

from __future__ import annotations

import orjson
import pytest

from kvroute.router.engines import ENDPOINTS, ENGINES, EngineFacts, endpoint_for
from kvroute.router.engines.generic import GENERIC
from kvroute.router.engines.sglang import GENERATE, META_INFO, SGLANG, facts_from_server_info
from kvroute.router.engines.usage import OPENAI_USAGE, StreamTap, Usage, usage_from_body
from kvroute.router.engines.vllm import GENERATE_TOKENS, VLLM
from kvroute.router.fleet.engine_stats import parse_metrics
from kvroute.router.http.openapi import openapi_spec
from kvroute.router.routing.request_info import expected_output_tokens_of
from kvroute.tokenizer_index import RequestTokenizer


def test_every_proxied_path_belongs_to_an_engine_and_openai_endpoints_are_shared() -> None:
    assert {endpoint.path for endpoint in ENDPOINTS} == set().union(*(engine.paths for engine in ENGINES.values()))
    assert VLLM.serves("/tokenize") and not SGLANG.serves("/tokenize")
    assert SGLANG.serves("/generate") and not VLLM.serves("/generate") and not GENERIC.serves("/generate")
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert endpoint_for(path) is not None
        assert all(engine.serves(path) for engine in ENGINES.values())


def test_the_openapi_document_takes_each_body_schema_from_its_endpoint() -> None:
    paths = openapi_spec(admin=False, api_keys=False)["paths"]
    generate = paths["/generate"]["post"]
    assert "input_ids" in generate["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert generate["description"] == "Served by sglang backends."
    assert "vllm, sglang, generic" in paths["/v1/chat/completions"]["post"]["description"]


def test_generate_prompts_are_text_or_token_ids_and_a_batch_routes_by_its_first() -> None:
    tokenizer = RequestTokenizer.default()
    read = GENERATE.prompt
    assert read is not None
    text = read(tokenizer, {"text": "The quick brown fox"})
    assert text is not None and len(text) > 3
    assert read(tokenizer, {"input_ids": [5, 6, 7]}).tolist() == [5, 6, 7]
    assert read(tokenizer, {"input_ids": [[5, 6], [8, 9, 10]]}).tolist() == [5, 6]
    assert read(tokenizer, {"text": ["The quick brown fox", "other"]}).tolist() == text.tolist()
    assert read(tokenizer, {"sampling_params": {}}) is None


def test_a_token_in_request_is_routed_by_its_token_ids() -> None:
    """vLLM's scale-out generation: ids rendered elsewhere; the output budget in its
    sampling parameters. With multimodal features the engine adds placeholder tokens the
    ids do not show: no prompt to match."""
    tokenizer = RequestTokenizer.default()
    read = GENERATE_TOKENS.prompt
    assert read is not None
    body = {"token_ids": [9, 8, 7, 6], "sampling_params": {"max_tokens": 12}}
    assert read(tokenizer, body).tolist() == [9, 8, 7, 6]
    assert expected_output_tokens_of(body) == 12
    assert expected_output_tokens_of({"sampling_params": {"max_new_tokens": 5}}) == 5  # SGLang's /generate
    assert read(tokenizer, {**body, "features": {"mm_hashes": {"image": ["h"]}}}) is None
    assert read(tokenizer, {**body, "token_ids": []}) is None
    with pytest.raises(ValueError):
        read(tokenizer, {**body, "token_ids": [1, "2"]})
    assert VLLM.serves(GENERATE_TOKENS.path) and not SGLANG.serves(GENERATE_TOKENS.path)


def test_meta_info_usage_in_bodies_batches_and_cumulative_streams() -> None:
    body = {"text": "hi", "output_ids": [1], "meta_info": {"id": "r", "prompt_tokens": 40, "cached_tokens": 39}}
    assert usage_from_body(orjson.dumps(body), META_INFO) == Usage(40, 39)
    assert usage_from_body(orjson.dumps([body, {**body, "meta_info": {}}]), META_INFO) == Usage(40, 39)
    assert usage_from_body(orjson.dumps(body)) is None  # not an OpenAI usage object
    events = [
        b"data: "
        + orjson.dumps(
            {"text": "a" * n, "meta_info": {"prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": n}}
        )
        + b"\n\n"
        for n in range(1, 4)
    ] + [b"data: [DONE]\n\n"]
    tap = StreamTap(strip_usage_chunk=False, usage_format=META_INFO)
    relayed = b"".join(tap.feed(event) for event in events) + tap.finish()
    assert relayed == b"".join(events)
    assert tap.usage == Usage(40, 32)


def test_what_cached_tokens_mean_per_engine() -> None:
    hit, null = Usage(100, 64), Usage(100, None)
    assert VLLM.observed(hit, EngineFacts()) == 64
    assert VLLM.observed(null, EngineFacts()) is None
    # SGLang's OpenAI usage has null cached tokens for a miss, with --enable-cache-report only.
    assert SGLANG.observed(null, EngineFacts(cache_report=True)) == 0
    assert SGLANG.observed(null, EngineFacts(cache_report=False)) is None
    assert SGLANG.observed(hit, EngineFacts()) == 64
    assert GENERIC.observed(hit, EngineFacts()) is None  # load only: nothing to learn from
    assert usage_from_body(
        orjson.dumps({"usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}), OPENAI_USAGE
    ) == Usage(5, None)


def test_server_info_facts_old_and_new_layouts() -> None:
    old = facts_from_server_info(
        {"page_size": 1, "max_total_num_tokens": 500_000, "enable_cache_report": True, "version": "0.4.6"}
    )
    assert (old.page_size, old.capacity_tokens, old.cache_report, old.version) == (1, 500_000, True, "0.4.6")
    new = facts_from_server_info({"page_size": 64, "internal_states": [{"max_total_num_tokens": 1_000_000}]})
    assert (new.page_size, new.capacity_tokens, new.cache_report) == (64, 1_000_000, None)


@pytest.mark.parametrize(("page_size", "block_size"), [(1, None), (16, 16), (64, 64)])
def test_sglang_cache_info_sets_the_index_block_size_except_token_granular(
    page_size: int, block_size: int | None
) -> None:
    page = (
        "\n".join(
            [
                "# TYPE sglang:num_running_reqs gauge",
                'sglang:num_running_reqs{model_name="m",tp_rank="0"} 2.0',
                "# TYPE sglang:cache_config_info gauge",
                f'sglang:cache_config_info{{model_name="m",page_size="{page_size}",num_pages="{4096 // page_size}"}} 1.0',
                "# TYPE sglang:cached_tokens counter",
                'sglang:cached_tokens_total{model_name="m",cache_source="device"} 700.0',
                'sglang:cached_tokens_total{model_name="m",cache_source="host"} 300.0',
                'sglang:cached_tokens_total{model_name="m",cache_source="total"} 1000.0',
                "# TYPE sglang:prompt_tokens counter",
                'sglang:prompt_tokens_total{model_name="m"} 4000.0',
            ]
        )
        + "\n"
    )
    stats = parse_metrics(page)
    assert (stats.kind, stats.running, stats.block_size) == ("sglang", 2, block_size)
    assert stats.capacity_tokens == 4096
    assert (stats.prefix_queries_tokens, stats.prefix_hit_tokens) == (4000.0, 1000.0)  # only cache_source="total"


def test_engine_per_backend_from_a_flag_and_a_bad_name_fails_at_start() -> None:
    from kvroute.router.config import ConfigError
    from kvroute.router.serve import build_parser, settings_from_args

    args = build_parser().parse_args(
        ["--backend", "http://a:8000", "--backend", "http://b:8000", "--engine", "http://b:8000=sglang"]
    )
    engines = {backend.url: backend.engine for backend in settings_from_args(args).backends}
    assert engines == {"http://a:8000": "auto", "http://b:8000": "sglang"}
    bad = build_parser().parse_args(["--backend", "http://a:8000", "--engine", "http://a:8000=tgi"])
    with pytest.raises(ConfigError, match="engine"):
        settings_from_args(bad)


def test_the_admin_api_takes_an_engine_and_the_document_says_which() -> None:
    schema = openapi_spec(admin=True, api_keys=False)["paths"]["/admin/backends"]["post"]["requestBody"]
    engine = schema["content"]["application/json"]["schema"]["properties"]["engine"]
    assert set(engine["enum"]) == {"auto", *ENGINES}
