"""Fleets and targets as subprocesses: sim engines, ``kvroute serve``, peer routers.

A benchmark needs the same engines behind every target, with caches emptied in between:

- :class:`SimFleet` starts R ``kvroute sim-engine`` replicas and empties their caches
  between targets with ``POST /reset_prefix_cache`` (``--api sglang``: ``/flush_cache``),
  restarting any replica that died;
- :class:`ExternalFleet` uses engines that are already running (real vLLM or SGLang) and
  empties their caches with ``POST /reset_prefix_cache`` (vLLM needs
  ``VLLM_SERVER_DEV_MODE=1`` for that endpoint);
- :func:`start_router` puts a fresh ``kvroute serve --policy P`` in front of them (with
  ``--kv-events`` and each engine's endpoints, for precise mode), and
  :func:`start_peer` the SGLang or vLLM router when its package is installed.

Every child runs in its own process group (and, on Linux, dies with its parent), so
:meth:`ManagedProcess.stop` can take down the whole group, also on Ctrl-C. Its output goes
to a temporary log, deleted when it stops, or kept in the directory :data:`KEEP_LOGS_ENV`
names (with ``KVROUTE_DECISION_LOG=true``, a router's decisions, request by request).

Counters are read the way a user would: from each engine's ``/metrics``
(:class:`EngineCounters`, vLLM and SGLang names) and from the router's ``/metrics``
(:class:`RouterCounters`).
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvroute.benchmarks.results import PEER_PREFIX
from kvroute.router.engines import ENGINES


class FleetError(RuntimeError):
    """A process of the fleet did not start or did not become ready."""


#: Starts of a sim fleet with freshly picked ports when one was taken meanwhile.
PORT_ATTEMPTS = 3
#: What a replica's log says when its port was taken (asyncio's and ZMQ's words, lowercased).
PORT_TAKEN = "address already in use"


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


# Loaded here, in the parent: the child between fork and exec only makes the system call.
_LIBC = _load_libc() if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies, so even a SIGKILLed bench
    leaves no engine or router behind."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


#: Environment variable naming a directory: children's logs are moved there when they stop
#: (``NAME-PID.log``) instead of deleted.
KEEP_LOGS_ENV = "KVROUTE_BENCH_KEEP_LOGS"


class ManagedProcess:
    """A child process in its own process group, its output kept in a log file."""

    def __init__(self, name: str, argv: Sequence[str], url: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.url = url
        self.argv = list(argv)
        self._log = tempfile.NamedTemporaryFile(
            prefix=f"kvroute-{name.replace(':', '-')}-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            # Safe with threads here: the hook only makes one system call, no allocation.
            preexec_fn=_die_with_parent if _LIBC is not None else None,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def wait_ready(self, path: str = "/health", timeout_s: float = 60.0) -> None:
        """Poll ``url + path`` until it answers 200; FleetError with the log tail if not."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise FleetError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    async with client.get(self.url + path) as response:
                        if response.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass
                await asyncio.sleep(0.1)
        raise FleetError(f"{self.name} not ready at {self.url}{path} after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it if it is still there after ``timeout_s``."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(5)
        self._signal(signal.SIGKILL)  # anything the child left in its group
        self._log.close()
        keep = os.environ.get(KEEP_LOGS_ENV)
        if keep:
            kept = Path(keep) / f"{self.name.replace(':', '-')}-{self.pid}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self._log.name, kept)
        else:
            Path(self._log.name).unlink(missing_ok=True)

    def _signal(self, number: int) -> None:
        try:
            os.killpg(self.pid, number)
        except (ProcessLookupError, PermissionError):
            pass


def run_stoppable(main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` to completion; Ctrl-C or SIGTERM cancels it, so its ``finally`` blocks
    stop every process it started. Returns its exit code, 130 when interrupted."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await main

    try:
        return asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted; everything started was stopped", file=sys.stderr)
        return 130


def _kvroute(*args: str) -> list[str]:
    """The ``kvroute`` command, run by this interpreter (works without the script on PATH)."""
    return [sys.executable, "-m", "kvroute.router.cli", *args]


def stop_all(processes: Iterable[ManagedProcess]) -> None:
    for process in processes:
        process.stop()


@dataclass(frozen=True, slots=True)
class KVEventEndpoints:
    """Where a precise router reads one engine's KV events (ZMQ PUB) and asks for the ones
    it missed (the replay ROUTER)."""

    events: str
    replay: str | None = None


@dataclass(frozen=True, slots=True)
class SimSpec:
    """How to run each simulated replica (``kvroute sim-engine`` flags)."""

    replicas: int = 4
    model: str = "sim"
    block_size: int = 16
    kv_capacity_tokens: int = 65536
    prefill_tokens_per_s: float = 20000.0
    decode_tokens_per_s: float = 50.0
    time_scale: float = 1.0
    tokenizer: str | None = None
    #: The engine API the sims speak (``--api``); SGLang sims report cache hits on the
    #: OpenAI endpoints (``--enable-cache-report``) and ``block_size`` is their page size.
    api: str = "vllm"
    #: Publish KV events, so that routers can run in precise mode (``--kv-events``).
    kv_events: bool = False

    def argv(self, port: int, kv_event_ports: tuple[int, int] | None = None) -> list[str]:
        """The replica's command line; ``kv_event_ports``: (events, replay) to publish on."""
        args = [
            "sim-engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            self.model,
            "--block-size",
            str(self.block_size),
            "--kv-capacity-tokens",
            str(self.kv_capacity_tokens),
            "--prefill-tokens-per-s",
            str(self.prefill_tokens_per_s),
            "--decode-tokens-per-s",
            str(self.decode_tokens_per_s),
            "--time-scale",
            str(self.time_scale),
        ]
        if self.tokenizer:
            args += ["--tokenizer", self.tokenizer]
        if self.api != "vllm":
            args += ["--api", self.api, "--enable-cache-report"]
        if kv_event_ports is not None:
            events, replay = kv_event_ports
            # A wildcard endpoint binds (as vLLM's publisher), a host one would connect.
            args += [
                "--kv-events-endpoint",
                f"tcp://*:{events}",
                "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{replay}",
            ]
        return _kvroute(*args)


async def reset_prefix_caches(urls: Sequence[str], api: str = "vllm") -> None:
    """Empty every engine's prefix cache the way its engine module says: vLLM's
    ``POST /reset_prefix_cache`` (a dev endpoint), SGLang's ``/flush_cache``."""
    method, path = ENGINES[api].reset_cache or ("POST", "/reset_prefix_cache")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        for url in urls:
            async with client.request(method, url + path) as response:
                if response.status >= 400:
                    raise FleetError(
                        f"{url}{path} answered {response.status}; for vLLM start it with "
                        "VLLM_SERVER_DEV_MODE=1 (SGLang refuses while requests run), or restart it between targets"
                    )


def router_block_size(api: str, block_size: int) -> int | None:
    """The ``--block-size`` a router in front of these engines gets: the engine module's
    index granularity (None for token-granular SGLang: the router keeps its own 16)."""
    return ENGINES[api].index_block_size(block_size)


class SpecFleet:
    """A fleet of sims built from a :class:`SimSpec`: what it says about its engines."""

    spec: SimSpec
    #: Sims have no data-parallel ranks.
    data_parallel_size = 1

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def api(self) -> str:
        return self.spec.api

    @property
    def capacity_tokens(self) -> int | None:
        return self.spec.kv_capacity_tokens


class SimFleet(SpecFleet):
    """R simulated replicas; :meth:`fresh` starts them or empties their caches."""

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.processes: list[ManagedProcess] = []
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Free ports for the replicas' HTTP servers and KV-event sockets."""
        self.ports = [free_port() for _ in range(self.spec.replicas)]
        self._kv_event_ports = {url: (free_port(), free_port()) for url in (self.urls if self.spec.kv_events else [])}
        #: Where routers read each replica's KV events, by URL (empty unless ``spec.kv_events``).
        self.kv_events = {
            url: KVEventEndpoints(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
            for url, (events, replay) in self._kv_event_ports.items()
        }

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    async def fresh(self) -> None:
        """Empty caches: reset the running replicas, or (re)start them if any is gone."""
        if self.processes and all(p.process.poll() is None for p in self.processes):
            await reset_prefix_caches(self.urls, self.spec.api)
            return
        self.stop()
        # Compile the index kernels once here, so that the replicas (and the routers after
        # them) load numba's cache instead of all compiling them at once on a fresh machine.
        importlib.import_module("kvroute.tokenizer_index.kernels")
        for attempt in range(PORT_ATTEMPTS):
            self.processes = [
                ManagedProcess(f"sim-{number}", self.spec.argv(port, self._kv_event_ports.get(url)), url)
                for number, (port, url) in enumerate(zip(self.ports, self.urls))
            ]
            waited = await asyncio.gather(*(process.wait_ready() for process in self.processes), return_exceptions=True)
            failures = [result for result in waited if isinstance(result, BaseException)]
            if not failures:
                return
            self.stop()
            # A port free when picked may be taken before a replica binds it (an outgoing
            # connection's ephemeral port, another test's server): pick others and start
            # again. Routers read urls and kv_events after this returns.
            if attempt + 1 == PORT_ATTEMPTS or not any(PORT_TAKEN in str(failure).lower() for failure in failures):
                raise failures[0]
            self._pick_ports()

    def stop(self) -> None:
        stop_all(self.processes)
        self.processes = []


class ExternalFleet:
    """Engines already running; :meth:`fresh` empties their prefix caches."""

    def __init__(
        self,
        urls: Sequence[str],
        block_size: int = 16,
        capacity_tokens: int | None = None,
        api: str = "vllm",
        kv_events: Sequence[KVEventEndpoints] = (),
        data_parallel_size: int = 1,
    ) -> None:
        self._urls = [url.rstrip("/") for url in urls]
        if kv_events and len(kv_events) != len(self._urls):
            raise FleetError(f"{len(kv_events)} KV-event endpoints for {len(self._urls)} engines")
        self.block_size = block_size
        #: Each rank's KV cache in tokens (an engine's, without data parallelism).
        self.capacity_tokens = capacity_tokens
        self.api = api
        #: Data-parallel ranks behind each URL (``vllm serve --data-parallel-size``).
        self.data_parallel_size = data_parallel_size
        #: Each engine's KV-event endpoints, by URL (empty: the engines' events are not used).
        self.kv_events = dict(zip(self._urls, kv_events))

    @property
    def urls(self) -> list[str]:
        return list(self._urls)

    async def fresh(self) -> None:
        await reset_prefix_caches(self._urls, self.api)

    def stop(self) -> None:
        """Nothing to stop: these engines belong to the user."""


Fleet = SimFleet | ExternalFleet


async def start_router(
    policy: str,
    backends: Sequence[str],
    *,
    block_size: int | None = None,
    capacity_tokens: int | None = None,
    tokenizer: str | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    kv_events: dict[str, KVEventEndpoints] | None = None,
    data_parallel_size: int = 1,
) -> ManagedProcess:
    """A fresh ``kvroute serve --policy POLICY`` in front of ``backends``, all of them healthy
    (``env``: extra environment, e.g. ``PYTHONPATH`` of another checkout to compare with;
    ``kv_events``: each backend's KV-event endpoints, for precise mode; ``data_parallel_size``:
    each backend's ranks, each routed to as a backend)."""
    port = free_port()
    args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--log-level", "warning"]
    for backend in backends:
        args += ["--backend", backend]
    for backend, endpoints in (kv_events or {}).items():
        args += ["--kv-events", "--kv-events-endpoint", f"{backend}={endpoints.events}"]
        if endpoints.replay is not None:
            args += ["--kv-events-replay-endpoint", f"{backend}={endpoints.replay}"]
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    if capacity_tokens is not None:
        args += ["--default-capacity-tokens", str(capacity_tokens)]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    if data_parallel_size > 1:
        args += ["--data-parallel-size", str(data_parallel_size)]
    router = ManagedProcess(f"kvroute-{policy}", _kvroute(*args, *extra_args), f"http://127.0.0.1:{port}", env=env)
    try:
        await router.wait_ready("/health")
        await _wait_all_healthy(router, len(backends) * data_parallel_size)
    except BaseException:
        router.stop()
        raise
    return router


async def _wait_all_healthy(router: ManagedProcess, count: int, timeout_s: float = 30.0) -> None:
    """Until the router's ``kvroute_backend_healthy`` says every backend is up."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as client:
        while time.monotonic() < deadline:
            samples = await scrape(client, router.url + "/metrics")
            if samples.get("kvroute_backend_healthy", 0.0) >= count:
                return
            await asyncio.sleep(0.1)
    raise FleetError(f"{router.name}: not all {count} backends healthy after {timeout_s:.0f} s")


PEERS = ("sglang-router", "vllm-router")


def peer_installed(name: str) -> bool:
    """Whether the peer router's package is installed here."""
    if name == "sglang-router":
        return importlib.util.find_spec("sglang_router") is not None
    if name == "vllm-router":
        return shutil.which("vllm-router") is not None
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


@dataclass(slots=True)
class PeerRouter:
    """A running peer router and where its Prometheus metrics are."""

    process: ManagedProcess
    metrics_url: str

    @property
    def url(self) -> str:
        return self.process.url

    def stop(self) -> None:
        self.process.stop()


async def start_peer(name: str, backends: Sequence[str], policy: str = "cache_aware") -> PeerRouter:
    """The SGLang or vLLM router (its ``cache_aware`` policy) in front of ``backends``."""
    if not peer_installed(name):
        raise FleetError(f"{name} is not installed (pip install {name})")
    port, metrics_port = free_port(), free_port()
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *backends,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
    ]
    if name == "sglang-router":
        argv = [sys.executable, "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    else:
        argv = [shutil.which("vllm-router") or "vllm-router", *common]
    process = ManagedProcess(f"peer-{name}", argv, f"http://127.0.0.1:{port}")
    try:
        await process.wait_ready("/health", timeout_s=60)
    except BaseException:
        process.stop()
        raise
    return PeerRouter(process, f"http://127.0.0.1:{metrics_port}/metrics")


async def _samples(client: aiohttp.ClientSession, url: str) -> list[Sample]:
    """Every sample of a ``/metrics`` page."""
    async with client.get(url) as response:
        response.raise_for_status()
        text = await response.text()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


async def scrape(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """A ``/metrics`` page as sample name -> value summed over all label sets."""
    totals: dict[str, float] = {}
    for sample in await _samples(client, url):
        totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


@dataclass(frozen=True, slots=True)
class KVEventStreams:
    """A router's KV-event streams as its ``/metrics`` show them, per backend."""

    #: ``kvroute_kv_events_state`` (1: precise, its events answer).
    states: dict[str, int]
    #: ``kvroute_kv_events_total`` by event (messages, gaps, disconnects, ...).
    counts: dict[str, dict[str, int]]


async def kv_event_streams(url: str) -> KVEventStreams:
    """What a router's ``/metrics`` say of its KV-event streams."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        samples = await _samples(client, url + "/metrics")
    states: dict[str, int] = {}
    counts: dict[str, dict[str, int]] = {}
    for sample in samples:
        if sample.name == "kvroute_kv_events_state":
            states[sample.labels["backend"]] = int(sample.value)
        elif sample.name == "kvroute_kv_events_total" and sample.value:
            counts.setdefault(sample.labels["backend"], {})[sample.labels["event"]] = int(sample.value)
    return KVEventStreams(states, counts)


def _first(samples: dict[str, float], *names: str) -> float:
    for name in names:
        if name in samples:
            return samples[name]
    return 0.0


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """An engine's cumulative prefix-cache and request counters (tokens and requests)."""

    hit_tokens: float = 0.0
    queried_tokens: float = 0.0
    requests: float = 0.0
    prompt_tokens: float = 0.0

    @classmethod
    def from_samples(cls, samples: dict[str, float]) -> EngineCounters:
        return cls(
            hit_tokens=_first(samples, "vllm:prefix_cache_hits_total", "sglang:cached_tokens_total"),
            queried_tokens=_first(samples, "vllm:prefix_cache_queries_total", "sglang:prompt_tokens_total"),
            requests=_first(
                samples,
                "vllm:request_success_total",
                "vllm:e2e_request_latency_seconds_count",
                "sglang:num_requests_total",
            ),
            prompt_tokens=_first(samples, "vllm:prompt_tokens_total", "sglang:prompt_tokens_total"),
        )

    def __sub__(self, earlier: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.hit_tokens - earlier.hit_tokens,
            self.queried_tokens - earlier.queried_tokens,
            self.requests - earlier.requests,
            self.prompt_tokens - earlier.prompt_tokens,
        )


async def engine_counters(urls: Sequence[str]) -> dict[str, EngineCounters]:
    """Each engine's counters, read from its ``/metrics``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        pages = await asyncio.gather(*(scrape(client, url + "/metrics") for url in urls))
    return {url: EngineCounters.from_samples(page) for url, page in zip(urls, pages)}


@dataclass(frozen=True, slots=True)
class RouterCounters:
    """kvroute's own token counters: prompt tokens routed and tokens predicted cached."""

    prompt_tokens: float = 0.0
    predicted_cached_tokens: float = 0.0

    def __sub__(self, earlier: RouterCounters) -> RouterCounters:
        return RouterCounters(
            self.prompt_tokens - earlier.prompt_tokens, self.predicted_cached_tokens - earlier.predicted_cached_tokens
        )


async def router_counters(url: str) -> RouterCounters:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
        samples = await scrape(client, url + "/metrics")
    return RouterCounters(
        samples.get("kvroute_prompt_tokens_total", 0.0), samples.get("kvroute_predicted_cached_tokens_total", 0.0)
    )


async def start_target(
    target: str,
    fleet: SimFleet | ExternalFleet,
    *,
    tokenizer: str | None = None,
    env: dict[str, str] | None = None,
) -> ManagedProcess | PeerRouter:
    """The router a bench target names, ready in front of ``fleet``: a peer router
    (``peer:NAME``) or ``kvroute serve --policy TARGET`` (``env``: its extra environment).

    In front of data-parallel engines kvroute routes to their ranks, but for a target
    ``POLICY@whole-engine``: that one sees each engine as one backend (of all its ranks'
    cache), as a router that knows nothing of ranks does, and the engine's own balancer
    picks the rank."""
    if target.startswith(PEER_PREFIX):
        return await start_peer(target.removeprefix(PEER_PREFIX), fleet.urls)
    ranks = fleet.data_parallel_size
    capacity = fleet.capacity_tokens
    policy, whole, _ = target.partition(WHOLE_ENGINE)
    if whole:
        capacity = None if capacity is None else capacity * ranks
        ranks = 1
    return await start_router(
        policy,
        fleet.urls,
        block_size=router_block_size(fleet.api, fleet.block_size),
        capacity_tokens=capacity,
        tokenizer=tokenizer,
        env=env,
        data_parallel_size=ranks,
    )


#: The suffix of a kvroute target that routes to data-parallel engines as wholes.
WHOLE_ENGINE = "@whole-engine"


def rank_targets(policies: Sequence[str], data_parallel_size: int) -> list[str]:
    """In front of data-parallel engines each policy twice: to the ranks, and as
    ``POLICY@whole-engine`` (:func:`start_target`); else the policies as they are."""
    if data_parallel_size == 1:
        return list(policies)
    return [name for policy in policies for name in (policy, policy + WHOLE_ENGINE)]
