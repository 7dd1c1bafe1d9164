"""The router in front of vLLM and SGLang sims, the same checks for both, and a mixed fleet.

openai SDK / httpx -> kvroute -> ``sim-engine --api vllm|sglang``, over real sockets. SGLang
sims run token-granular (``--page-size 1``, its default) with ``--enable-cache-report``.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import numpy as np
import pytest

from tests.engine_apis import APIS, series, sim_options
from tests.servers import RouterServer, SimServer, wait_until

pytestmark = pytest.mark.timeout(180)

TOKEN = "admin-secret"
SYSTEM = "You are a meticulous assistant. " * 30


def start_sims(sim_engines: Any, api: str, count: int, **options: Any) -> list[SimServer]:
    return sim_engines(count, **sim_options(api, **options))


def conversation(client: Any, turns: int, *, stream: bool = False, user: str = "u1") -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn} from {user}: tell me about rivers."})
        if stream:
            chunks = list(client.chat.completions.create(model="sim", messages=messages, max_tokens=6, stream=True))
            answer = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        else:
            answer = (
                client.chat.completions.create(model="sim", messages=messages, max_tokens=6).choices[0].message.content
            )
        messages.append({"role": "assistant", "content": answer})


def admin_backends(router: RouterServer) -> dict[str, dict[str, Any]]:
    response = httpx.get(router.url + "/admin/backends", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    response.raise_for_status()
    return {entry["url"]: entry for entry in response.json()["backends"]}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_feedback_sees_what_the_engines_cached(sim_engines: Any, router_server: Any, api: str, stream: bool) -> None:
    sims = start_sims(sim_engines, api, 2)
    router = router_server(sims, policy="cache_aware", admin_token=TOKEN)
    for user in ("ann", "bob", "cyd"):
        conversation(router.client(), 4, stream=stream, user=user)
    scrape = router.metrics()
    observed = scrape.value("kvroute_observed_cached_tokens_total")
    predicted = scrape.value("kvroute_predicted_cached_tokens_total")
    engines = sum(sim.metrics().value(series(api, "prefix_hit_tokens")) for sim in sims)
    assert observed == engines > 0  # every cached token the engines counted reached the router
    assert 0 < predicted <= observed
    # Unpredicted: blocks of the answers (the engines cache them) and, at SGLang's page size 1,
    # the partial block a 16-token index cannot see: at most a block or two per request.
    requests = scrape.value("kvroute_requests_total")
    assert observed - predicted < 2 * 16 * requests
    assert {entry["engine"] for entry in admin_backends(router).values()} == {api}


def test_sglang_generate_through_the_router_learns_meta_info(sim_engines: Any, router_server: Any) -> None:
    sims = start_sims(sim_engines, "sglang", 2)
    router = router_server(sims, policy="cache_aware")
    prompt = np.random.default_rng(3).integers(10, 1000, size=300).tolist()
    backends = set()
    for index in range(4):
        body = {"input_ids": prompt + [index], "sampling_params": {"max_new_tokens": 4}, "stream": index % 2 == 1}
        response = httpx.post(router.url + "/generate", json=body, timeout=30)
        assert response.status_code == 200
        backends.add(response.headers["x-kvroute-backend"])
    assert len(backends) == 1  # the shared prefix keeps them together
    scrape = router.metrics()
    assert scrape.value("kvroute_observed_cached_tokens_total") == 3 * 300  # token-granular: the whole prefix
    assert scrape.value("kvroute_predicted_cached_tokens_total") == 3 * 288  # the router's 16-token blocks
    assert scrape.value("kvroute_observed_cached_tokens_total") == sum(
        sim.metrics().value("sglang:cached_tokens_total") for sim in sims
    )


def test_a_mixed_fleet_sends_each_path_to_engines_that_serve_it(sim_engines: Any, router_server: Any) -> None:
    (vllm,) = start_sims(sim_engines, "vllm", 1)
    (sglang,) = start_sims(sim_engines, "sglang", 1)
    router = router_server([vllm, sglang], admin_token=TOKEN)
    listed = admin_backends(router)
    assert (listed[vllm.url]["engine"], listed[sglang.url]["engine"]) == ("vllm", "sglang")
    assert {listed[url]["engine_source"] for url in listed} == {"detected"}
    assert router.metrics().label_values("kvroute_backend_engine", "engine") == {"vllm", "sglang"}
    for _ in range(4):
        generate = httpx.post(router.url + "/generate", json={"text": "hello there"}, timeout=30)
        assert generate.status_code == 200 and generate.headers["x-kvroute-backend"] == sglang.url
        tokenize = httpx.post(router.url + "/tokenize", json={"model": "sim", "prompt": "hello"}, timeout=30)
        assert tokenize.status_code == 200 and tokenize.headers["x-kvroute-backend"] == vllm.url
    chats = {
        router.client()
        .chat.completions.with_raw_response.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        .headers["x-kvroute-backend"]
        for _ in range(4)
    }
    assert chats == {vllm.url, sglang.url}


def test_configured_engines_and_a_generic_server_teach_nothing(sim_engines: Any, router_server: Any) -> None:
    (sim,) = start_sims(sim_engines, "vllm", 1)
    router = router_server([{"url": sim.url, "engine": "generic"}], admin_token=TOKEN, policy="cache_aware")
    assert admin_backends(router)[sim.url]["engine"] == "generic"
    assert admin_backends(router)[sim.url]["engine_source"] == "configured"
    conversation(router.client(), 3)
    scrape = router.metrics()
    assert scrape.value("kvroute_observed_cached_tokens_total") == 0  # its reports are not feedback
    assert scrape.value("kvroute_predicted_cached_tokens_total") == 0  # nor counted against it
    assert sim.metrics().value("vllm:prefix_cache_hits_total") > 0
    assert router.state.routing.feedback.observed == 0


def test_a_backend_added_at_run_time_names_its_engine(sim_engines: Any, router_server: Any) -> None:
    (sglang,) = start_sims(sim_engines, "sglang", 1)
    router = router_server([], admin_token=TOKEN)
    added = httpx.post(
        router.url + "/admin/backends",
        json={"url": sglang.url, "engine": "sglang"},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert added.status_code == 201, added.text
    assert (added.json()["engine"], added.json()["engine_source"]) == ("sglang", "configured")
    backend = router.state.pool.get(sglang.url)
    assert backend is not None and backend.engine_facts.page_size == 1  # read from /server_info
    assert backend.engine_facts.cache_report is True


def test_precise_mode_follows_sglangs_per_token_events_exactly(sim_engines: Any, router_server: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (sim,) = start_sims(sim_engines, "sglang", 1, kv_events_endpoint=f"tcp://*:{port}", kv_events_format="array")
    router = router_server(
        [{"url": sim.url, "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}], policy="cache_aware", kv_events=True
    )
    prompt = np.random.default_rng(9).integers(10, 1000, size=203).tolist()

    def generate() -> httpx.Response:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(router.url + "/generate", json=body, timeout=30)
        assert response.status_code == 200
        return response

    def precise() -> bool:
        generate()  # events flow once the subscription is up
        return router.metrics().value("kvroute_kv_events_state", backend=sim.url) == 1

    wait_until(precise, timeout=30)
    answer = generate()
    # The engine's per-token events set the router's block size to 1: the prediction is
    # SGLang's own number, min(common prefix, input_len - 1).
    assert int(answer.headers["x-kvroute-matched-tokens"]) == answer.json()["meta_info"]["cached_tokens"] == 202
