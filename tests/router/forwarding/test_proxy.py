"""The proxy end to end: openai SDK -> kvroute -> simulated vLLM engines, over real sockets."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from kvroute.router.engines.vllm import GENERATE_TOKENS, POOLING_ENDPOINTS, RENDER_ENDPOINTS
from tests.engine_apis import APIS, series, sim_options
from tests.servers import RouterServer, SimServer, wait_until

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


@pytest.fixture(params=APIS)
def api(request: pytest.FixtureRequest) -> str:
    """Every test here runs against simulated vLLM and SGLang engines (engine_apis)."""
    return str(request.param)


@pytest.fixture
def sim_engines(sim_engines: Any, api: str) -> Any:
    def start(n: int = 1, **options: Any) -> list[SimServer]:
        return sim_engines(n, **sim_options(api, **options))

    return start


def chat(router: RouterServer, **kwargs: Any) -> Any:
    """One non-streaming chat completion with its raw response (headers)."""
    kwargs.setdefault("model", "sim")
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 8)
    return router.client().chat.completions.with_raw_response.create(**kwargs)


def backends_of(router: RouterServer, count: int, **kwargs: Any) -> list[str]:
    return [chat(router, **kwargs).headers["x-kvroute-backend"] for _ in range(count)]


# --- the proxied API ---------------------------------------------------------------------
def test_chat_non_streaming_with_routing_headers(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(2)
    router = router_server(sims)
    raw = chat(router)
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 8
    assert raw.headers["x-kvroute-backend"] in {s.url for s in sims}
    assert raw.headers["x-kvroute-policy"] == "round_robin"
    assert raw.headers["x-kvroute-reason"]
    assert len(raw.headers["x-request-id"]) >= 16
    sent = chat(router, extra_headers={"x-request-id": "my-request-42"})
    assert sent.headers["x-request-id"] == "my-request-42"


@pytest.mark.parametrize("http_server", ["lean", "aiohttp"])
def test_a_request_id_that_is_not_a_plain_token_is_replaced(
    sim_engines: Any, router_server: Any, http_server: str
) -> None:
    """Bytes that are not UTF-8, spaces, control characters or an overlong id are neither
    echoed nor sent on: the request gets a fresh id (it was a 500 with a logged traceback)."""
    (sim,) = sim_engines(1)
    router = router_server([sim], http_server=http_server)
    body = {"model": "sim", "messages": MESSAGES, "max_tokens": 2}
    with httpx.Client(base_url=router.url) as client:
        kept = client.post("/v1/chat/completions", json=body, headers={"x-request-id": "trace-7:a/b=c"})
        assert kept.status_code == 200
        assert kept.headers["x-request-id"] == "trace-7:a/b=c"
        for given in (b"\xff\xfe", "\u00e9t\u00e9".encode(), b"two words", b"x" * 129):
            answer = client.post("/v1/chat/completions", json=body, headers={b"x-request-id": given})
            assert answer.status_code == 200, given
            replaced = answer.headers["x-request-id"]
            assert len(replaced) == 32 and int(replaced, 16) >= 0, given
    assert router.metrics().value("kvroute_requests_total", backend=sim.url, status="200") == 5


def test_streaming_chat_matches_non_streaming_and_hides_the_injected_usage(
    sim_engines: Any, router_server: Any, api: str
) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim])
    client = router.client()
    whole = client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=12)
    chunks = list(client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=12, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    # The router asked the engine for usage; the client, who did not, gets no usage chunk.
    assert all(chunk.choices and chunk.usage is None for chunk in chunks)
    metrics = router.metrics()
    engine = sim.metrics()
    assert metrics.value("kvroute_prompt_tokens_total") == engine.value(series(api, "prefix_queries_tokens"))
    assert metrics.value("kvroute_observed_cached_tokens_total") == engine.value(series(api, "prefix_hit_tokens")) > 0


def test_streaming_with_usage_requested_by_the_client_keeps_it(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1))
    chunks = list(
        router.client().chat.completions.create(
            model="sim", messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens > 0
    assert chunks[-1].usage.completion_tokens == 5


def test_completions_stream_and_non_stream(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(2))
    client = router.client()
    whole = client.completions.create(model="sim", prompt="The quick brown fox", max_tokens=6)
    pieces = list(client.completions.create(model="sim", prompt="The quick brown fox", max_tokens=6, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert whole.usage.prompt_tokens > 0


def test_other_endpoints_pass_through(sim_engines: Any, router_server: Any, api: str) -> None:
    router = router_server(sim_engines(2))
    embedding = router.client().embeddings.create(model="sim", input="hello")
    assert len(embedding.data[0].embedding) > 0
    if api == "sglang":  # its native API instead of vLLM's /tokenize
        generated = httpx.post(router.url + "/generate", json={"text": "hello world"}, timeout=30)
        assert generated.status_code == 200 and generated.json()["meta_info"]["prompt_tokens"] > 0
        return
    tokens = httpx.post(router.url + "/tokenize", json={"model": "sim", "prompt": "hello world"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    text = httpx.post(router.url + "/detokenize", json={"tokens": tokens.json()["tokens"]}, timeout=30)
    assert text.status_code == 200 and "hello" in text.json()["prompt"]
    # vLLM's other paths reach a backend too (the sim answers them 404 itself: the router's
    # own 404 for a path it does not proxy would name no backend).
    paths = [endpoint.path for endpoint in (GENERATE_TOKENS, *RENDER_ENDPOINTS, *POOLING_ENDPOINTS)]
    for path in paths:
        answer = httpx.post(router.url + path, json={"model": "sim", "token_ids": [1, 2]}, timeout=30)
        assert "x-kvroute-backend" in answer.headers, (path, answer.status_code, answer.text)


def test_async_client_concurrent_streams(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(2))

    async def one(client: openai.AsyncOpenAI, index: int) -> str:
        stream = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": f"question {index}"}], max_tokens=10, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def main() -> list[str]:
        async with router.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(24)))

    assert all(asyncio.run(main()))
    wait_until(lambda: all(b.in_flight == 0 for b in router.state.pool))


# --- policies and model routing -----------------------------------------------------------
def test_round_robin_alternates(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(2)
    router = router_server(sims, policy="round_robin")
    assert Counter(backends_of(router, 10)) == {sims[0].url: 5, sims[1].url: 5}


@pytest.mark.parametrize("policy", ["random", "least_load", "power_of_two"])
def test_load_policies_use_every_backend(policy: str, sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(3)
    router = router_server(sims, policy=policy)
    seen = Counter(backends_of(router, 30))
    assert set(seen) == {s.url for s in sims}, seen
    assert all(router.state.pool.get(s.url).in_flight == 0 for s in sims)


def test_model_routing_and_model_list(sim_engines: Any, router_server: Any) -> None:
    alpha = sim_engines(2, models=("alpha",))
    (beta,) = sim_engines(1, models=("beta",))
    router = router_server([*alpha, beta])
    assert set(backends_of(router, 6, model="alpha")) == {s.url for s in alpha}
    assert set(backends_of(router, 3, model="beta")) == {beta.url}
    listed = [m.id for m in router.client().models.list()]
    assert sorted(listed) == ["alpha", "beta"]
    with pytest.raises(openai.NotFoundError) as raised:
        chat(router, model="gamma")
    assert raised.value.code == "model_not_found"


# --- failures ------------------------------------------------------------------------------
def test_retry_on_a_dead_backend_then_marked_unhealthy(sim_engines: Any, router_server: Any) -> None:
    live, dead = sim_engines(2)
    router = router_server([dead, live], unhealthy_after=2)
    dead.stop()  # still "healthy" for the router: nothing has told it yet
    assert backends_of(router, 6) == [live.url] * 6
    assert not router.state.pool.get(dead.url).healthy
    metrics = router.metrics()
    assert metrics.value("kvroute_requests_total", backend=dead.url, status="502") == 2
    assert metrics.value("kvroute_requests_total", backend=live.url, status="200") == 6


def test_retry_on_a_503_answer(sim_engines: Any, router_server: Any) -> None:
    first, second = sim_engines(2)
    router = router_server([first, second])
    first.set_fault("error_503", 1)
    # Whichever request meets the fault moves on to the other backend: the client never sees
    # the 503 (the SDK would raise), and the router counted it once. (Which request meets it
    # depends on health-check timing under load, so the order is not asserted.)
    served = backends_of(router, 4)
    assert set(served) <= {first.url, second.url}
    assert router.metrics().value("kvroute_requests_total", backend=first.url, status="503") == 1
    assert first.url in backends_of(router, 2)  # the fault was one-off: first serves again


def test_a_lone_backend_error_answer_is_relayed(sim_engines: Any, router_server: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim])
    sim.set_fault("error_500", 1)
    with pytest.raises(openai.InternalServerError):
        chat(router)
    assert chat(router).parse().choices


def test_stream_cut_by_the_engine_ends_with_an_error_event(sim_engines: Any, router_server: Any, api: str) -> None:
    engines = sim_engines(2)
    router = router_server(engines)
    for engine in engines:  # whichever the router picks cuts its stream (a health check may shift the order)
        engine.set_fault("close_mid_stream", 1)
    with httpx.stream(
        "POST",
        router.v1 + "/chat/completions",
        json={"model": "sim", "messages": MESSAGES, "max_tokens": 50, "stream": True},
        timeout=30,
    ) as response:
        cut = next(engine for engine in engines if engine.url == response.headers["x-kvroute-backend"])
        body = response.read()
    assert body.endswith(b"data: [DONE]\n\n")
    assert b"event: error" in body
    # Bytes had reached the client: no retry on the other backend.
    (other,) = (engine for engine in engines if engine is not cut)
    assert other.metrics().value(series(api, "prefix_queries_tokens")) == 0
    cut.set_fault("close_mid_stream", 1)  # both armed again: the SDK sees the cut as an error
    with pytest.raises(openai.APIError):
        for _ in router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=50, stream=True):
            pass
    wait_until(lambda: all(b.in_flight == 0 for b in router.state.pool))


def test_stalled_stream_hits_the_idle_timeout(sim_engines: Any, router_server: Any, api: str) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim], idle_timeout_s=0.5)
    sim.set_fault("stall_mid_stream", 1)
    with pytest.raises(openai.APIError, match="broke off"):
        for _ in router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=50, stream=True):
            pass
    wait_until(lambda: sim.metrics().value(series(api, "running")) == 0)


def test_engine_hanging_before_the_first_byte_is_a_504(sim_engines: Any, router_server: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim], first_byte_timeout_s=0.5)
    sim.set_fault("hang_before_first_byte", 1)
    response = httpx.post(router.v1 + "/chat/completions", json={"model": "sim", "messages": MESSAGES}, timeout=30)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    wait_until(lambda: sim.engine.hanging == 0)


def test_client_disconnect_mid_stream_releases_everything(sim_engines: Any, router_server: Any, api: str) -> None:
    (sim,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=40.0)
    router = router_server([sim])
    stream = router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2000, stream=True)
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    assert router.metrics().value("kvroute_backend_in_flight_requests", backend=sim.url) == 1
    # round_robin tokenizes nothing: the request's work is its output budget alone.
    assert router.metrics().value("kvroute_backend_in_flight_work_tokens", backend=sim.url) == 2000
    assert sim.metrics().value(series(api, "running")) == 1
    stream.close()  # hang up mid-stream
    wait_until(lambda: router.metrics().value("kvroute_backend_in_flight_requests", backend=sim.url) == 0)
    wait_until(lambda: sim.metrics().value(series(api, "running")) == 0)
    backend = router.state.pool.get(sim.url)
    assert (backend.in_flight, backend.in_flight_work_tokens) == (0, 0)
    assert router.metrics().value("kvroute_requests_total", status="499") == 1
    assert chat(router).parse().choices  # and the router carries on


# --- what reaches the engine ---------------------------------------------------------------
def test_body_bytes_and_headers_forwarded(recording_engine: Any, router_server: Any) -> None:
    url, received = recording_engine
    router = router_server([url])
    received.clear()
    body = b'{ "model" : "rec",\n  "messages": [{"role": "user", "content": "h\\u00e9"}], "zz": 1 }'
    response = httpx.post(
        router.v1 + "/chat/completions",
        content=body,
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer client-key",
            "X-Custom": "kept",
            "x-kvroute-policy": "random",
            "Proxy-Authorization": "Basic x",
            "TE": "trailers",
        },
        timeout=30,
    )
    assert response.status_code == 200
    assert "connection" not in {k.lower() for k in response.headers if response.headers[k] == "keep-alive"}
    headers, forwarded = received[-1]
    lower = {k.lower(): v for k, v in headers.items()}
    assert forwarded == body
    assert lower["authorization"] == "Bearer client-key"
    assert lower["x-custom"] == "kept"
    assert lower["x-request-id"] == response.headers["x-request-id"]
    assert "x-kvroute-policy" not in lower
    assert "proxy-authorization" not in lower and "te" not in lower


def test_policy_header_passes_only_when_allowed(recording_engine: Any, router_server: Any) -> None:
    url, received = recording_engine
    router = router_server([url], allow_policy_header=True, backend_api_key="engine-secret")
    httpx.post(
        router.v1 + "/chat/completions",
        json={"model": "rec", "messages": MESSAGES},
        headers={"x-kvroute-policy": "round_robin", "Authorization": "Bearer client-key"},
        timeout=30,
    )
    lower = {k.lower(): v for k, v in received[-1][0].items()}
    assert lower["x-kvroute-policy"] == "round_robin"
    assert lower["authorization"] == "Bearer engine-secret"


def test_headers_an_engine_lists_in_connection_stop_at_the_router(server_loop: Any, router_server: Any) -> None:
    """RFC 9110 7.6.1 on the way back too: the headers an engine's ``Connection`` names are
    for the router's hop only; its other headers reach the client."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(
            {"object": "list", "data": [{"id": "rec"}]},
            headers={"Connection": "keep-alive, X-Engine-Hop", "X-Engine-Hop": "private", "X-Engine-Kept": "yes"},
        )

    app = web.Application()
    app.router.add_get("/health", answer)
    app.router.add_get("/v1/models", answer)
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    server_loop.run(runner.setup())
    server_loop.run(web.TCPSite(runner, "127.0.0.1", 0).start())
    try:
        router = router_server([f"http://127.0.0.1:{runner.addresses[0][1]}"])
        response = httpx.post(router.v1 + "/chat/completions", json={"model": "rec", "messages": MESSAGES}, timeout=30)
        assert response.status_code == 200
        assert response.headers["x-engine-kept"] == "yes"
        assert "x-engine-hop" not in response.headers
        assert response.headers["x-kvroute-policy"] == "round_robin"
    finally:
        server_loop.run(runner.cleanup())


def test_client_api_keys(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1), api_keys=["k1", "k2"])
    with pytest.raises(openai.AuthenticationError):
        router.client(api_key="wrong").chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
    assert router.client(api_key="k2").chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2).choices
    assert httpx.get(router.v1 + "/models", timeout=30).status_code == 401
    assert httpx.get(router.url + "/health", timeout=30).status_code == 200


# --- health and metrics endpoints -------------------------------------------------------
def test_health_endpoint(sim_engines: Any, router_server: Any, server_loop: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([sim], unhealthy_after=1)
    assert httpx.get(router.url + "/health", timeout=30).status_code == 200
    sim.stop()
    server_loop.run(router.state.health.check_all())
    response = httpx.get(router.url + "/health", timeout=30)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_backend"
    # Liveness stays up during the outage, so Kubernetes does not restart the router.
    assert httpx.get(router.url + "/livez", timeout=30).status_code == 200


def test_metrics_endpoint_counts_requests(sim_engines: Any, router_server: Any) -> None:
    sims: list[SimServer] = sim_engines(2)
    router = router_server(sims)
    for _ in range(4):
        chat(router)
    list(router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=3, stream=True))
    metrics = router.metrics()
    assert metrics.value("kvroute_requests_total", endpoint="chat", status="200", policy="round_robin") == 5
    assert metrics.value("kvroute_request_duration_seconds_count") == 5
    assert metrics.value("kvroute_time_to_first_token_seconds_count") == 1
    assert metrics.value("kvroute_routing_decisions_total", policy="round_robin") == 5
    assert metrics.label_values("kvroute_backend_healthy", "backend") == {s.url for s in sims}
    text = httpx.get(router.url + "/metrics", timeout=30)
    assert text.headers["content-type"].startswith("text/plain")
    assert orjson.loads(httpx.get(router.url + "/health", timeout=30).content)["healthy_backends"] == 2


def test_metrics_count_chats_rendered_through_a_fast_path(sim_engines: Any, router_server: Any) -> None:
    """A conversation of 16 messages or more is remembered rendered; its next turn renders
    only its new messages, which ``kvroute_chat_renders_total`` counts (and no mismatch); a
    short chat of plain texts fills its shape's skeleton."""
    router = router_server(sim_engines(1), policy="cache_aware")
    messages: list[dict[str, str]] = [{"role": "system", "content": "You answer briefly."}]
    for turn in range(10):
        messages += [
            {"role": "user", "content": f"question {turn}"},
            {"role": "assistant", "content": f"answer {turn}"},
        ]
    chat(router, messages=[*messages, {"role": "user", "content": "one"}])
    chat(
        router,
        messages=[
            *messages,
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "two"},
        ],
    )
    metrics = router.metrics()
    assert metrics.value("kvroute_chat_renders_total", event="lookups") == 2
    assert metrics.value("kvroute_chat_renders_total", event="reused") == 1
    assert metrics.value("kvroute_chat_renders_total", event="mismatches") == 0
    assert metrics.value("kvroute_chat_renders_total", event="skeleton_mismatches") == 0
    filled = metrics.value("kvroute_chat_renders_total", event="skeleton")
    chat(router, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}])
    assert router.metrics().value("kvroute_chat_renders_total", event="skeleton") == filled + 1


def test_metrics_say_which_fast_path_tokenized_the_prompt(sim_engines: Any, router_server: Any) -> None:
    """``kvroute_tokenizer_units_total{source}``: a short new question word by word in
    Python, a long new tool result in compiled code (its new words by the compiled BPE,
    ``kvroute_tokenizer_new_words_total{by}``), both again from the piece cache."""
    router = router_server(sim_engines(1), policy="cache_aware")
    short = [{"role": "user", "content": "what does the router cache, and why?"}]
    long = [{"role": "user", "content": " ".join(f"line {number} of a tool result" for number in range(60))}]

    def units() -> dict[str, float]:
        metrics = router.metrics()
        return {
            source: metrics.value("kvroute_tokenizer_units_total", source=source)
            for source in ("cached", "words", "words_compiled", "library")
        }

    before = units()
    chat(router, messages=short)
    after_short = units()
    assert after_short["words"] > before["words"] and after_short["words_compiled"] == before["words_compiled"]
    new_words = router.metrics().value("kvroute_tokenizer_new_words_total", by="bpe")
    chat(router, messages=long)
    after_long = units()
    assert after_long["words_compiled"] > after_short["words_compiled"]
    # Its new words (numbers, under the default tokenizer's whole digit runs) by the BPE.
    assert router.metrics().value("kvroute_tokenizer_new_words_total", by="bpe") > new_words
    chat(router, messages=long)
    again = units()
    assert again["cached"] > after_long["cached"]
    assert {source: again[source] for source in ("words", "words_compiled")} == {
        source: after_long[source] for source in ("words", "words_compiled")
    }


def test_metrics_show_what_the_cache_model_learnt_from_the_answers(
    sim_engines: Any, router_server: Any, api: str
) -> None:
    """An answer that holds the predicted history counts as held; after the engine dropped
    its cache, the next answer counts as evicted and the model counts on less of that cache."""
    (sim,) = sim_engines(1)
    router = router_server([sim], policy="cache_aware")
    history: list[dict[str, str]] = [{"role": "system", "content": "You answer briefly. " * 40}]
    for turn in range(3):
        history.append({"role": "user", "content": f"question {turn}"})
        chat(router, messages=history)
        history.append({"role": "assistant", "content": f"answer {turn}"})
        if turn == 1:
            empty = "/flush_cache" if api == "sglang" else "/reset_prefix_cache"
            httpx.post(sim.url + empty, timeout=30).raise_for_status()
    metrics = router.metrics()
    assert metrics.value("kvroute_cache_model_answers_total", backend=sim.url, result="held") == 1
    assert metrics.value("kvroute_cache_model_answers_total", backend=sim.url, result="evicted") == 1
    assert 0 < metrics.value("kvroute_cache_model_eviction_rate", backend=sim.url) < 1
    assert 0.25 <= metrics.value("kvroute_cache_model_capacity_ratio", backend=sim.url) < 1


def test_long_prompt_is_tokenized_off_the_event_loop_with_the_same_key(
    sim_engines: Any, router_server: Any, api: str
) -> None:
    """A body over THREAD_PREPARE_BYTES is tokenized in a worker thread; its routing key is the
    one the engine computes, so its second turn lands on the first turn's replica, cached."""
    from kvroute.router.forwarding.proxy import THREAD_PREPARE_BYTES

    sims = sim_engines(2)
    router = router_server(sims, policy="cache_aware")
    long_text = "the quick brown fox jumps over the lazy dog " * (THREAD_PREPARE_BYTES // 40)
    messages = [{"role": "user", "content": long_text}]
    first = chat(router, messages=messages)
    follow_up = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = chat(router, messages=follow_up)
    assert int(first.headers["x-kvroute-prompt-tokens"]) == first.parse().usage.prompt_tokens
    assert second.headers["x-kvroute-backend"] == first.headers["x-kvroute-backend"]
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    assert cached > 0.9 * first.parse().usage.prompt_tokens
    matched = int(second.headers["x-kvroute-matched-tokens"])
    # SGLang's page size 1 caches the partial block the router's 16-token blocks cannot see.
    assert cached - 16 < matched <= cached if api == "sglang" else matched == cached


def test_a_long_prompt_goes_into_the_index_a_slice_per_loop_turn(
    sim_engines: Any, router_server: Any, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts of more than INSERT_SLICE_BLOCKS blocks are inserted a slice per event-loop
    turn before they go upstream: every block is in the index by the time the answer
    comes, and the next turn finds its history there."""
    from kvroute.router.routing import sliced_insert

    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    router = router_server(sim_engines(2), policy="cache_aware")
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 60}]
    first = chat(router, messages=messages)
    backend = first.headers["x-kvroute-backend"]
    blocks = first.parse().usage.prompt_tokens // 16
    assert blocks > 8 * 4
    assert router.metrics().value("kvroute_index_blocks", backend=backend) == blocks
    follow_up = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = chat(router, messages=follow_up)
    assert second.headers["x-kvroute-backend"] == backend
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    matched = int(second.headers["x-kvroute-matched-tokens"])
    assert cached - 16 < matched <= cached if api == "sglang" else matched == cached


def test_decision_log_line_explains_each_request(
    sim_engines: Any, router_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """--decision-log: one JSON line per request with backend, policy, reason, prompt tokens,
    predicted and observed cached tokens, and TTFT."""
    sims = sim_engines(2)
    router = router_server(sims, policy="cache_aware", decision_log=True)
    with caplog.at_level("INFO", logger="kvroute.decisions"):
        chat(router)
        raw = chat(router)
        wait_until(lambda: len([r for r in caplog.records if r.name == "kvroute.decisions"]) >= 2)
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvroute.decisions"]
    last = lines[-1]
    usage = raw.parse().usage
    assert last["backend"] == raw.headers["x-kvroute-backend"]
    assert last["policy"] == "cache_aware" and last["reason"] == raw.headers["x-kvroute-reason"]
    assert last["prompt_tokens"] == usage.prompt_tokens
    assert last["predicted_cached_tokens"] == int(raw.headers["x-kvroute-matched-tokens"])
    assert last["observed_cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert last["status"] == "200" and last["duration_s"] > 0


# --- stored responses -------------------------------------------------------------------
def test_a_stored_response_is_found_where_it_is_stored(response_stores: Any, router_server: Any) -> None:
    """Calls on a stored response (read, cancel, delete, continue) reach the replica that
    stored it. One this router did not see created (another router or worker did, or this
    one restarted) is searched for: each replica's 404 sends the call on, and where it was
    found is remembered. An id no replica holds gets the last replica's own 404."""
    urls, asked = response_stores
    router = router_server(urls, policy="round_robin")

    def send(method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, list[str]]:
        asked.clear()
        response = httpx.request(method, router.url + path, timeout=30, **kwargs)
        return response, [name for name, *_ in asked]

    found, tried = send("GET", "/v1/responses/resp_c?stream=false&starting_after=3")
    assert found.status_code == 200 and found.json()["id"] == "resp_c"
    assert (found.headers["x-kvroute-backend"], found.headers["x-kvroute-reason"]) == (urls[2], "search")
    assert tried[-1] == "c" and sorted(tried) == sorted(set(tried))  # each replica once at most
    assert asked[-1][2:] == ("/v1/responses/resp_c?stream=false&starting_after=3", False)
    # Known now: straight there, for every call on it.
    for method, path in [("GET", "/v1/responses/resp_c"), ("DELETE", "/v1/responses/resp_c")]:
        again, tried = send(method, path)
        assert (again.status_code, again.headers["x-kvroute-reason"], tried) == (200, "stored_response", ["c"])
        assert asked[-1][1] == method
    cancel, tried = send("POST", "/v1/responses/resp_c/cancel", content=b"")
    assert (cancel.status_code, tried, asked[-1][1:3]) == (200, ["c"], ("POST", "/v1/responses/resp_c/cancel"))

    # A continuation of a response this router never saw: searched, then remembered,
    # and so is the new response it stored.
    body = {"model": "m", "input": "and?", "previous_response_id": "resp_b"}
    continued, tried = send("POST", "/v1/responses", json=body)
    assert continued.status_code == 200 and tried[-1] == "b"
    assert continued.headers["x-kvroute-backend"] == urls[1]
    new_id = continued.json()["id"]
    for previous in ("resp_b", new_id):
        again, tried = send("POST", "/v1/responses", json={**body, "previous_response_id": previous})
        assert (again.headers["x-kvroute-reason"], tried) == ("stored_response", ["b"])

    missing, tried = send("GET", "/v1/responses/resp_nowhere")
    assert missing.status_code == 404 and sorted(tried) == ["a", "b", "c"]
    assert missing.json()["error"]["param"] == "response_id"  # the engine's own answer
    metrics = router.metrics()
    assert metrics.value("kvroute_requests_total", endpoint="responses_stored", status="404") >= 3
    # The two found by searching, and the three answers the continuations stored.
    assert metrics.value("kvroute_stored_responses") == 5
    assert all(backend.in_flight == 0 for backend in router.state.pool)


def test_a_router_remembering_no_stored_responses_searches_every_time(response_stores: Any, router_server: Any) -> None:
    urls, asked = response_stores
    router = router_server(urls, policy="round_robin", stored_responses=0)
    for _ in range(2):
        asked.clear()
        found = httpx.get(router.url + "/v1/responses/resp_c", timeout=30)
        assert (found.status_code, found.headers["x-kvroute-reason"]) == (200, "search")
        assert asked[-1][0] == "c"
    assert router.metrics().value("kvroute_stored_responses") == 0
