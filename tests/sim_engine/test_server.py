"""The simulated vLLM replica over real sockets, with the ``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import numpy as np
import openai
import orjson
import pytest
from aiohttp import web

from kvroute.benchmarks.sim_engine import parity
from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.server import SIM_ENGINE, SimEngine, build_app

pytestmark = pytest.mark.timeout(60)

# Fast by default: 1000x real time, so a test request takes milliseconds.
FAST = SimEngineConfig(port=0, time_scale=1000.0)


@contextlib.asynccontextmanager
async def sim_server(config: SimEngineConfig = FAST) -> AsyncIterator[tuple[str, SimEngine]]:
    """A replica on an ephemeral 127.0.0.1 port; yields its base URL and engine."""
    app = build_app(replace(config, host="127.0.0.1", port=0))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", app[SIM_ENGINE]
    finally:
        await runner.cleanup()


def client(base_url: str, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, **kwargs)


def token_prompt(seed: int, length: int) -> list[int]:
    """A token-id prompt: exact lengths, independent of the tokenizer's merges."""
    return np.random.default_rng(seed).integers(10, 1000, size=length).tolist()


async def metrics_of(base_url: str) -> dict[str, float]:
    """Samples of the /metrics page, keyed by name (labels dropped; one series each)."""
    async with aiohttp.ClientSession() as session, session.get(base_url + "/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples[name_labels.split("{", 1)[0]] = float(value)
    return samples


async def get_json(base_url: str, path: str) -> Any:
    async with aiohttp.ClientSession() as session, session.get(base_url + path) as response:
        return await response.json()


async def post(base_url: str, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(base_url + path, json=body) as response:
        return response.status, await response.json(content_type=None)


async def eventually(check: Any, timeout: float = 10.0) -> None:
    """Poll an async predicate until it holds (generous: the machine is shared)."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


MESSAGES = [
    {"role": "system", "content": "You are a terse assistant that answers in one line. " * 4},
    {"role": "user", "content": "Name three rivers of Europe and the seas they flow into."},
]


# --- API shapes -----------------------------------------------------------------------


async def test_models_and_health() -> None:
    async with sim_server(replace(FAST, models=("base", "adapter"))) as (url, _):
        models = await client(url).models.list()
        assert [model.id for model in models.data] == ["base", "adapter"]
        raw = await get_json(url, "/v1/models")
        assert raw["object"] == "list"
        entry = raw["data"][0]
        assert entry["owned_by"] == "kvroute-sim" and entry["object"] == "model"
        assert entry["max_model_len"] == FAST.kv_capacity_tokens
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as response:
            assert response.status == 200


async def test_chat_non_streaming_shape_and_prompt_tokens() -> None:
    async with sim_server() as (url, _):
        completion = await client(url).chat.completions.create(model="sim", messages=MESSAGES, max_tokens=7)
        assert completion.object == "chat.completion"
        assert completion.choices[0].message.role == "assistant"
        assert completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "length"
        usage = completion.usage
        assert usage is not None and usage.completion_tokens == 7
        assert usage.total_tokens == usage.prompt_tokens + 7
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0
        status, tokenized = await post(url, "/tokenize", {"model": "sim", "messages": MESSAGES})
        assert status == 200 and tokenized["count"] == usage.prompt_tokens == len(tokenized["tokens"])
        # Completion text is the decoding of the generated tokens.
        ids = (await post(url, "/tokenize", {"prompt": completion.choices[0].message.content}))[1]
        assert (await post(url, "/detokenize", {"tokens": ids["tokens"]}))[1]["prompt"] == (
            completion.choices[0].message.content
        )


async def test_default_max_tokens_and_max_completion_tokens() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        default = await sdk.chat.completions.create(model="sim", messages=MESSAGES)
        assert default.usage is not None and default.usage.completion_tokens == 16
        newer = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_completion_tokens=3)
        assert newer.usage is not None and newer.usage.completion_tokens == 3


async def test_chat_streaming_with_usage_matches_non_streaming() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        full = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=12)
        stream = await sdk.chat.completions.create(
            model="sim", messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        content = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
        assert len(content) == 12
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == (
            full.choices[0].message.content
        )
        assert content[-1].choices[0].finish_reason == "length"
        final = chunks[-1]
        assert final.choices == [] and final.usage is not None
        assert final.usage.completion_tokens == 12
        assert final.usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]


async def test_completions_streaming_and_non_streaming() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        prompt = "The quick brown fox jumps over the lazy dog. " * 5
        full = await sdk.completions.create(model="sim", prompt=prompt, max_tokens=9)
        assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
        assert full.usage is not None and full.usage.completion_tokens == 9
        stream = await sdk.completions.create(
            model="sim", prompt=prompt, max_tokens=9, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert text == full.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
        # Without include_usage there is no usage chunk.
        plain = [chunk async for chunk in await sdk.completions.create(
            model="sim", prompt=prompt, max_tokens=2, stream=True
        )]  # fmt: skip
        assert all(chunk.choices for chunk in plain)


async def test_raw_sse_framing_ends_with_done() -> None:
    async with sim_server() as (url, _):
        body = {"model": "sim", "prompt": "hello", "max_tokens": 3, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = await response.text()
        events = [event for event in raw.split("\n\n") if event]
        assert all(event.startswith("data: ") for event in events)
        assert events[-1] == "data: [DONE]" and len(events) == 4


# --- the prefix cache -----------------------------------------------------------------


async def test_cached_tokens_rise_on_repeat_and_respect_salt() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)

        async def cached(**extra: Any) -> tuple[int, int]:
            completion = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2, **extra)
            usage = completion.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

        prompt_tokens, first = await cached()
        assert first == 0
        _, second = await cached()
        # Whole blocks, never the whole prompt: the last token is always computed.
        assert second == (prompt_tokens - 1) // 16 * 16 > 0
        _, salted = await cached(extra_body={"cache_salt": "tenant-a"})
        assert salted == 0
        _, salted_again = await cached(extra_body={"cache_salt": "tenant-a"})
        assert salted_again == second
        _, other_salt = await cached(extra_body={"cache_salt": "tenant-b"})
        assert other_salt == 0


async def test_fully_cached_prompt_of_whole_blocks_still_computes_last_block() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        prompt = token_prompt(1, 64)  # exactly 4 blocks
        await sdk.completions.create(model="sim", prompt=prompt, max_tokens=1)
        again = await sdk.completions.create(model="sim", prompt=prompt, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens == 48  # type: ignore[union-attr]


async def test_lora_models_do_not_share_blocks() -> None:
    async with sim_server(replace(FAST, models=("base", "adapter"))) as (url, _):
        sdk = client(url)
        prompt = token_prompt(2, 80)
        await sdk.completions.create(model="base", prompt=prompt, max_tokens=1)
        other = await sdk.completions.create(model="adapter", prompt=prompt, max_tokens=1)
        assert other.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
        same = await sdk.completions.create(model="base", prompt=prompt, max_tokens=1)
        assert same.usage.prompt_tokens_details.cached_tokens == 64  # type: ignore[union-attr]


async def test_eviction_drops_least_recent_sequence_tail_first() -> None:
    # 8 blocks of 16 tokens. max_tokens=1 keeps output blocks out of the picture.
    config = replace(FAST, kv_capacity_tokens=128)
    async with sim_server(config) as (url, engine):
        sdk = client(url)

        async def cached(prompt: list[int]) -> int:
            completion = await sdk.completions.create(model="sim", prompt=prompt, max_tokens=1)
            return completion.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]

        first = token_prompt(3, 96)  # 6 blocks
        second = token_prompt(4, 64)  # 4 blocks: 2 of first's must go
        assert await cached(first) == 0
        assert await cached(second) == 0
        assert (await get_json(url, "/sim/stats"))["blocks"] == 8
        assert engine.cache is not None and engine.cache.index_blocks == 8
        # first kept its head (4 blocks), lost its tail (2 blocks).
        assert await cached(first) == 64
        # Re-storing first's 6 blocks pushed out second's last 2 of 4.
        assert await cached(second) == 32


async def test_reset_prefix_cache() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        prompt = token_prompt(5, 64)
        await sdk.completions.create(model="sim", prompt=prompt, max_tokens=1)
        async with aiohttp.ClientSession() as session, session.post(url + "/reset_prefix_cache") as response:
            assert response.status == 200
        assert (await get_json(url, "/sim/stats"))["blocks"] == 0
        again = await sdk.completions.create(model="sim", prompt=prompt, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]


# --- compute: load and cache hits show in the time to first token ---------------------


async def first_token_seconds(url: str, prompt: list[int], max_tokens: int = 2) -> float:
    """Client-side time to the first SSE event. (Raw HTTP: the SDK spends ~0.1 s just
    validating a 4000-integer prompt, which would swamp what is measured here.)"""
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            elapsed = time.perf_counter() - start
            await response.read()
    return elapsed


async def test_ttft_grows_with_load_and_shrinks_with_a_cache_hit() -> None:
    # 4000-token prompts at 20k tokens/s: 0.2 s of prefill each, 2048 tokens per step.
    config = replace(FAST, time_scale=1.0, prefill_tokens_per_s=20000.0, decode_tokens_per_s=200.0)
    async with sim_server(config) as (url, _):
        # A first request pays for what a process does once (compiled index kernels loaded,
        # imports): not the prefill this test compares.
        await first_token_seconds(url, token_prompt(1, 64))
        alone = await first_token_seconds(url, token_prompt(10, 4000))
        loaded = await asyncio.gather(*(first_token_seconds(url, token_prompt(20 + i, 4000)) for i in range(6)))
        # Six prompts share one prefill budget: on average they wait for about half the others.
        assert sum(loaded) / len(loaded) > 2.0 * alone
        assert max(loaded) > 3.0 * alone
        hit = await first_token_seconds(url, token_prompt(10, 4000))
        assert hit < 0.5 * alone


async def test_max_num_seqs_queues_the_rest() -> None:
    config = replace(FAST, time_scale=1.0, max_num_seqs=2, decode_tokens_per_s=100.0)
    async with sim_server(config) as (url, _):
        sdk = client(url)
        tasks = [
            asyncio.create_task(sdk.completions.create(model="sim", prompt=token_prompt(30 + i, 20), max_tokens=40))
            for i in range(5)
        ]

        async def queued() -> bool:
            samples = await metrics_of(url)
            return samples["vllm:num_requests_running"] == 2 and samples["vllm:num_requests_waiting"] == 3

        await eventually(queued)
        await asyncio.gather(*tasks)
        samples = await metrics_of(url)
        assert samples["vllm:num_requests_running"] == 0 and samples["vllm:num_requests_waiting"] == 0


async def test_concurrent_generations_share_decode_steps() -> None:
    # Continuous batching: four 300-token generations advance together, one token per step.
    async with sim_server() as (url, engine):
        sdk = client(url)
        completions = await asyncio.gather(
            *(sdk.completions.create(model="sim", prompt=token_prompt(40 + i, 30), max_tokens=300) for i in range(4))
        )
        assert all(completion.usage.completion_tokens == 300 for completion in completions)  # type: ignore[union-attr]
        assert engine.scheduler is not None
        assert 300 <= engine.scheduler.totals.steps < 2 * 300


# --- metrics --------------------------------------------------------------------------


async def test_metrics_agree_with_responses() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        usages = []
        for _ in range(3):
            completion = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4)
            usages.append(completion.usage)
        samples = await metrics_of(url)
        prompt = sum(usage.prompt_tokens for usage in usages)
        cached = sum(usage.prompt_tokens_details.cached_tokens for usage in usages)
        assert samples["vllm:prefix_cache_queries_total"] == prompt
        assert samples["vllm:prefix_cache_hits_total"] == cached > 0
        assert samples["vllm:prompt_tokens_total"] == prompt
        assert samples["vllm:generation_tokens_total"] == 12
        assert samples["vllm:time_to_first_token_seconds_count"] == 3
        assert samples["vllm:e2e_request_latency_seconds_count"] == 3
        assert samples["vllm:num_requests_running"] == 0
        assert 0.0 <= samples["vllm:kv_cache_usage_perc"] <= 1.0
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            text = await response.text()
        info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
        assert 'block_size="16"' in info and f'num_gpu_blocks="{FAST.num_blocks}"' in info
        assert info.endswith(" 1.0")
        assert 'model_name="sim"' in text and 'engine="0"' in text


# --- disconnects ----------------------------------------------------------------------


async def test_client_disconnect_mid_stream_aborts_the_request() -> None:
    config = replace(FAST, time_scale=1.0, decode_tokens_per_s=50.0)
    async with sim_server(config) as (url, engine):
        sdk = client(url)
        stream = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=1000, stream=True)
        received = 0
        async for _chunk in stream:
            received += 1
            if received == 3:
                break
        assert (await metrics_of(url))["vllm:num_requests_running"] == 1
        await stream.close()

        async def drained() -> bool:
            return (await metrics_of(url))["vllm:num_requests_running"] == 0

        await eventually(drained)
        assert engine.scheduler is not None and engine.scheduler.totals.requests_aborted == 1


async def test_client_disconnect_while_waiting_for_non_streaming_answer() -> None:
    config = replace(FAST, time_scale=1.0, decode_tokens_per_s=20.0)
    async with sim_server(config) as (url, _):
        body = {"model": "sim", "prompt": "slow", "max_tokens": 1000}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(url + "/v1/completions", json=body) as response:
                    await response.read()

        async def drained() -> bool:
            stats = await get_json(url, "/sim/stats")
            return stats["running"] == 0 and stats["requests_aborted"] == 1

        await eventually(drained)


# --- errors ---------------------------------------------------------------------------


async def test_errors_in_openai_shape() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(model="nope", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError):
            await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=0)
        with pytest.raises(openai.BadRequestError):
            await sdk.completions.create(model="sim", prompt="x", max_tokens=FAST.kv_capacity_tokens + 1)
        cases: list[tuple[str, Any, int]] = [
            ("/v1/chat/completions", {"model": "sim"}, 400),
            ("/v1/chat/completions", {"model": "sim", "messages": "hi"}, 400),
            ("/v1/chat/completions", [1, 2], 400),
            ("/v1/completions", {"model": "sim", "prompt": {"a": 1}}, 400),
            ("/v1/completions", {"model": "sim", "prompt": "x", "stream": "maybe"}, 400),
            ("/v1/completions", {"model": "sim"}, 400),
            ("/v1/completions", {"model": "sim", "prompt": [1, -5]}, 400),
            ("/v1/embeddings", {"model": "sim", "input": 5}, 400),
            ("/v1/embeddings", {"model": "sim", "input": "x", "encoding_format": {}}, 400),
            ("/v1/embeddings", {"model": "sim", "input": [99999]}, 400),
            ("/sim/fault", {"mode": "explode"}, 400),
        ]
        for path, body, status in cases:
            got, payload = await post(url, path, body)
            assert got == status, (path, body)
            error = payload["error"]
            assert set(error) >= {"message", "type", "code"} and error["code"] == status
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", data=b"{not json") as response:
                assert response.status == 400 and "error" in await response.json()
            async with session.get(url + "/no/such/path") as response:
                assert response.status == 404 and (await response.json())["error"]["code"] == 404
            async with session.get(url + "/v1/completions") as response:
                assert response.status == 405 and "error" in await response.json()


# --- vLLM's request validation ---------------------------------------------------------------


def test_requests_are_judged_as_vllm_judges_them(sim_engines: Any) -> None:
    """Every case of the parity table (recorded against a real vLLM) gets vLLM's answer."""
    (sim,) = sim_engines(1, models=("tiny",), max_model_len=2048)
    report = parity.run(sim.url, "tiny")
    assert not report.differences, "\n".join(
        f"{name}: {'; '.join(differences)}" for name, differences in report.differences.items()
    )
    assert report.agree == len(parity.CASES) >= 200


async def test_max_completion_tokens_zero_is_refused_not_ignored() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        for fields in ({"max_completion_tokens": 0}, {"max_completion_tokens": 0, "max_tokens": 5}):
            with pytest.raises(openai.BadRequestError) as raised:
                await sdk.chat.completions.create(model="sim", messages=MESSAGES, **fields)
            error = raised.value.body
            assert isinstance(error, dict)
            assert error["param"] == "max_tokens" and error["type"] == "BadRequestError"
            assert error["message"].startswith("max_tokens must be at least 1, got 0.")
        # A positive max_completion_tokens wins over max_tokens, even over a max_tokens of 0.
        answer = await sdk.chat.completions.create(
            model="sim", messages=MESSAGES, max_completion_tokens=2, max_tokens=0
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 2


async def test_type_errors_and_rule_errors_have_vllms_two_shapes() -> None:
    async with sim_server() as (url, _):
        status, typed = await post(url, "/v1/chat/completions", {"model": "sim", "messages": MESSAGES, "n": 1.5})
        assert status == 400 and typed["error"]["type"] == "Bad Request" and typed["error"]["param"] == "body.n"
        assert typed["error"]["message"].startswith("1 validation error:")
        status, ruled = await post(url, "/v1/chat/completions", {"model": "sim", "messages": MESSAGES, "top_p": 0})
        assert status == 400 and ruled["error"] == {
            "message": "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)",
            "type": "BadRequestError",
            "param": "top_p",
            "code": 400,
        }
        # A huge wrong value is summarised, not echoed back.
        body = {"model": "sim", "messages": MESSAGES, "max_tokens": ["x"] * 100_000}
        status, bounded = await post(url, "/v1/chat/completions", body)
        assert status == 400 and len(bounded["error"]["message"]) < 1000


async def test_lax_values_are_read_as_vllm_reads_them() -> None:
    async with sim_server() as (url, _):
        body = {"model": "sim", "messages": MESSAGES, "max_tokens": "4", "n": "2", "stream": "yes",
                "stream_options": {"include_usage": 1}}  # fmt: skip
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/chat/completions", json=body) as response,
        ):
            assert response.status == 200
            raw = await response.text()
        events = [orjson.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        assert {choice["index"] for event in events for choice in event["choices"]} == {0, 1}
        assert events[-1]["usage"]["completion_tokens"] == 2 * 4


async def test_n_choices_differ_and_the_prompt_is_counted_once() -> None:
    async with sim_server() as (url, engine):
        sdk = client(url)
        single = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=6)
        several = await sdk.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=6, n=3)
        assert [choice.index for choice in several.choices] == [0, 1, 2]
        texts = [choice.message.content for choice in several.choices]
        assert texts[0] == single.choices[0].message.content, "sample 0 is the n=1 answer"
        assert len(set(texts)) == 3, "the samples differ"
        assert several.usage is not None and single.usage is not None
        assert several.usage.prompt_tokens == single.usage.prompt_tokens
        assert several.usage.completion_tokens == 3 * 6
        stream = await sdk.chat.completions.create(
            model="sim", messages=MESSAGES, max_tokens=6, n=3, stream=True, stream_options={"include_usage": True}
        )
        streamed = {0: "", 1: "", 2: ""}
        roles = set()
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
                if choice.delta.role:
                    roles.add(choice.index)
            usage = chunk.usage or usage
        assert [streamed[index] for index in range(3)] == texts
        assert roles == {0, 1, 2}
        assert usage is not None and usage.completion_tokens == 18
        assert engine.scheduler is not None and engine.scheduler.totals.requests_served == 1 + 3 + 3


async def test_completion_batches_answer_every_prompt_n_times() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        prompts = [token_prompt(1, 20), token_prompt(2, 30)]
        answer = await sdk.completions.create(model="sim", prompt=prompts, max_tokens=4, n=2)
        assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
        alone = await sdk.completions.create(model="sim", prompt=prompts[1], max_tokens=4)
        assert answer.choices[2].text == alone.choices[0].text, "choice 2 is the second prompt's first sample"
        assert answer.usage is not None and answer.usage.prompt_tokens == 50
        assert answer.usage.completion_tokens == 4 * 4


async def test_output_is_clamped_to_the_context_and_longer_prompts_are_refused() -> None:
    async with sim_server(replace(FAST, max_model_len=64)) as (url, _):
        sdk = client(url)
        clamped = await sdk.completions.create(model="sim", prompt=token_prompt(3, 60), max_tokens=30)
        assert clamped.usage is not None and clamped.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len=64"):
            await sdk.completions.create(model="sim", prompt=token_prompt(3, 10), max_tokens=65)
        with pytest.raises(openai.BadRequestError, match="your prompt contains 65 input tokens"):
            await sdk.completions.create(model="sim", prompt=token_prompt(3, 65), max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1, got 0"):
            await sdk.completions.create(model="sim", prompt=token_prompt(3, 64), max_tokens=1)


async def test_a_request_without_model_is_served_by_the_first_model() -> None:
    async with sim_server(replace(FAST, models=("base", "adapter"))) as (url, _):
        status, answer = await post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert status == 200 and answer["model"] == "base"
        status, refused = await post(url, "/v1/completions", {"model": "nope", "prompt": "hello"})
        assert status == 404 and refused["error"]["message"] == "The model `nope` does not exist. Valid aliases: base."


# --- other endpoints ------------------------------------------------------------------


async def test_embeddings_are_deterministic_unit_vectors() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        # The SDK asks for base64 by default and decodes it.
        result = await sdk.embeddings.create(model="sim", input=["alpha beta", "gamma", "alpha beta"])
        vectors = [np.asarray(item.embedding) for item in result.data]
        assert [item.index for item in result.data] == [0, 1, 2]
        assert np.allclose(vectors[0], vectors[2]) and not np.allclose(vectors[0], vectors[1])
        assert all(abs(np.linalg.norm(vector) - 1.0) < 1e-5 for vector in vectors)
        status, floats = await post(url, "/v1/embeddings", {"model": "sim", "input": "alpha beta"})
        assert status == 200 and np.allclose(floats["data"][0]["embedding"], vectors[0], atol=1e-6)
        assert result.usage.prompt_tokens > 0


async def test_tokenize_and_detokenize_roundtrip() -> None:
    async with sim_server() as (url, _):
        text = "Tokenize me, please: 123 and ünïcödé."
        status, tokenized = await post(url, "/tokenize", {"model": "sim", "prompt": text})
        assert status == 200 and tokenized["count"] == len(tokenized["tokens"]) > 0
        assert tokenized["max_model_len"] == FAST.kv_capacity_tokens
        status, detokenized = await post(url, "/detokenize", {"model": "sim", "tokens": tokenized["tokens"]})
        assert status == 200 and detokenized["prompt"] == text
        status, _ = await post(url, "/tokenize", {"model": "other", "prompt": text})
        assert status == 404


# --- fault injection ------------------------------------------------------------------


async def set_fault(url: str, mode: str, count: int | None) -> None:
    status, state = await post(url, "/sim/fault", {"mode": mode, "count": count})
    assert status == 200 and state["mode"] == mode


async def test_fault_errors_apply_to_count_requests() -> None:
    async with sim_server() as (url, _):
        sdk = client(url)
        await set_fault(url, "error_503", 2)
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as raised:
                await sdk.completions.create(model="sim", prompt="x", max_tokens=1)
            assert raised.value.status_code == 503
        await sdk.completions.create(model="sim", prompt="x", max_tokens=1)
        await set_fault(url, "error_500", None)
        for _ in range(3):
            with pytest.raises(openai.InternalServerError):
                await sdk.completions.create(model="sim", prompt="x", max_tokens=1)
        await set_fault(url, "none", None)
        await sdk.completions.create(model="sim", prompt="x", max_tokens=1)


async def test_fault_hang_before_first_byte() -> None:
    async with sim_server() as (url, _):
        await set_fault(url, "hang_before_first_byte", 1)
        with pytest.raises(openai.APITimeoutError):
            await client(url, timeout=0.5).completions.create(model="sim", prompt="x", max_tokens=1)

        async def released() -> bool:
            return (await get_json(url, "/sim/stats"))["hanging"] == 0

        await eventually(released)
        # The count is used up: the next request is served.
        await client(url).completions.create(model="sim", prompt="x", max_tokens=1)


async def test_fault_stall_mid_stream_holds_the_slot_until_the_client_leaves() -> None:
    async with sim_server() as (url, _):
        await set_fault(url, "stall_mid_stream", 1)
        stream = await client(url, timeout=1.0).completions.create(model="sim", prompt="x", max_tokens=50, stream=True)
        texts: list[str] = []
        with pytest.raises(openai.APITimeoutError):
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert len(texts) >= 1
        await stream.close()

        async def released() -> bool:
            stats = await get_json(url, "/sim/stats")
            return stats["running"] == 0 and stats["hanging"] == 0

        await eventually(released)


async def test_fault_close_mid_stream_truncates_streams_and_bodies() -> None:
    async with sim_server() as (url, _):
        await set_fault(url, "close_mid_stream", 2)
        body = {"model": "sim", "prompt": "x", "max_tokens": 20, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await response.read()
            async with session.post(url + "/v1/completions", json={**body, "stream": False}) as response:
                assert response.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await response.read()
        stats = await get_json(url, "/sim/stats")
        assert stats["running"] == 0


# --- the command ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_kvroute_sim_engine_subprocess_serves_and_dies_on_sigkill() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvroute.router.cli", "sim-engine", "--port", str(port), "--model", "a,b",
         "--time-scale", "100"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 30
        while True:
            try:
                models = sdk.models.list()
                break
            except openai.APIConnectionError:
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                assert time.monotonic() < deadline, "sim-engine did not start"
                time.sleep(0.1)
        assert [model.id for model in models.data] == ["a", "b"]
        completion = sdk.completions.create(model="b", prompt="hello", max_tokens=2)
        assert completion.usage is not None and completion.usage.completion_tokens == 2
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    assert process.returncode == -signal.SIGKILL
