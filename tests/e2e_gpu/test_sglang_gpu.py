"""Two real SGLang replicas on one GPU behind kvroute: the vLLM e2e tier's checks, for SGLang.

Started by ``deploy/local/run_sglang_gpu.sh`` (``KVROUTE_RUN_ROUTER=0``); each check starts
its own ``kvroute serve`` with ``engine: auto``, so detection is exercised too. Skipped, with
the reason, where there is no NVIDIA GPU or no ``sglang`` package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.paths import REPO

MODEL = os.environ.get("KVROUTE_GPU_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
PORTS = (8111, 8112)
URLS = [f"http://127.0.0.1:{port}" for port in PORTS]
TOKEN = "e2e-admin"

pytestmark = [
    pytest.mark.e2e_gpu,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        shutil.which("nvidia-smi") is None,
        reason="no NVIDIA GPU here (nvidia-smi not found): the SGLang e2e tier needs one",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None, reason="sglang is not installed (pip install sglang, GPU build)"
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def sglang_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("sglang")
    env = {
        **os.environ,
        "KVROUTE_RUN_ROUTER": "0",
        "KVROUTE_LOG_DIR": str(logs),
        "KVROUTE_SGLANG_PYTHON": sys.executable,
        "KVROUTE_SGLANG_PORTS": " ".join(map(str, PORTS)),
    }
    script = subprocess.Popen([str(REPO / "deploy/local/run_sglang_gpu.sh")], env=env, start_new_session=True)
    try:
        for url in URLS:
            _wait_healthy(url, script, 1200)
        yield URLS
    finally:
        _stop(script)


def _metrics(url: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.labels.get("cache_source", "total") == "total":
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def _engines(name: str) -> float:
    return sum(_metrics(url).get(name, 0.0) for url in URLS)


def _router(policy: str, tmp: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = _free_port()
    args = [
        sys.executable,
        "-m",
        "kvroute.router.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--tokenizer",
        MODEL,
        "--admin-token",
        TOKEN,
        "--log-level",
        "info",
    ]
    for url in URLS:
        args += ["--backend", url]
    log = open(tmp / f"kvroute-{policy}.log", "wb")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    _wait_healthy(f"http://127.0.0.1:{port}", process, 120)
    return f"http://127.0.0.1:{port}", process


def _conversations(router: str, users: int = 6, turns: int = 6) -> list[dict[str, Any]]:
    """Chats with growing histories over a short shared system prompt; one record per answer."""
    records = []
    histories = {user: [{"role": "system", "content": "You answer in one short paragraph."}] for user in range(users)}
    for turn in range(turns):
        for user, messages in histories.items():
            messages.append({"role": "user", "content": f"User {user}, question {turn}: describe river number {turn}."})
            response = httpx.post(
                router + "/v1/chat/completions",
                timeout=120,
                json={"model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0},
            )
            response.raise_for_status()
            body = response.json()
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            records.append({"headers": response.headers, "usage": body["usage"]})
    return records


def test_cache_aware_on_sglangs_own_hit_rate_and_prediction(sglang_fleet: list[str], tmp_path: Path) -> None:
    runs: dict[str, dict[str, Any]] = {}
    for policy in ("round_robin", "cache_aware"):
        for url in sglang_fleet:
            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
        before = (_engines("sglang:cached_tokens_total"), _engines("sglang:prompt_tokens_total"))
        router, process = _router(policy, tmp_path)
        try:
            backends = httpx.get(
                router + "/admin/backends", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
            ).json()["backends"]
            assert {(b["engine"], b["engine_source"]) for b in backends} == {("sglang", "detected")}
            records = _conversations(router)
            scrape = _metrics(router)
        finally:
            _stop(process)
        hits = _engines("sglang:cached_tokens_total") - before[0]
        queries = _engines("sglang:prompt_tokens_total") - before[1]
        runs[policy] = {"records": records, "hit_rate": hits / queries, "hits": hits, "scrape": scrape}
        print(f"{policy}: SGLang hit rate {hits / queries:.1%} ({hits:.0f}/{queries:.0f} tokens)")

    assert runs["cache_aware"]["hit_rate"] > runs["round_robin"]["hit_rate"] + 0.08
    cache_aware = runs["cache_aware"]
    # The router tokenizes as SGLang does (the HF chat template): same prompt length every time.
    mismatched = [
        (r["headers"]["x-kvroute-prompt-tokens"], r["usage"]["prompt_tokens"])
        for r in cache_aware["records"]
        if int(r["headers"]["x-kvroute-prompt-tokens"]) != r["usage"]["prompt_tokens"]
    ]
    assert not mismatched
    # Every hit SGLang counted reached the router (null cached tokens = 0 with --enable-cache-report).
    observed = cache_aware["scrape"]["kvroute_observed_cached_tokens_total"]
    predicted = cache_aware["scrape"]["kvroute_predicted_cached_tokens_total"]
    assert observed == cache_aware["hits"]
    requests = len(cache_aware["records"])
    print(f"cache_aware: predicted {predicted:.0f}, SGLang-reported {observed:.0f} over {requests} requests")
    # 16-token blocks against page size 1: under by the partial block (< 16) plus answer blocks.
    assert 0.8 * observed <= predicted <= observed


def test_generate_through_the_router(sglang_fleet: list[str], tmp_path: Path) -> None:
    router, process = _router("cache_aware", tmp_path)
    try:
        prompt = "Summarise the history of the Danube. " * 40
        answers = [
            httpx.post(
                router + "/generate",
                timeout=120,
                json={
                    "text": prompt + str(index),
                    "sampling_params": {"max_new_tokens": 16, "temperature": 0},
                    "stream": index % 2 == 1,
                },
            )
            for index in range(4)
        ]
        assert all(answer.status_code == 200 for answer in answers)
        assert len({answer.headers["x-kvroute-backend"] for answer in answers}) == 1
        scrape = _metrics(router)
    finally:
        _stop(process)
    assert scrape["kvroute_observed_cached_tokens_total"] > 0
