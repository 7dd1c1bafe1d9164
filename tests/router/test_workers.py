"""``kvroute serve --workers N`` as a real process over sim engines: one port, every worker
serving, placements shared, metrics merged, admin writes everywhere, SIGTERM drains all.

Each request goes over a new connection (the kernel's SO_REUSEPORT spreads connections,
not requests); each worker's own view is read from its internal Unix socket, whose
directory the supervisor logs.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import zmq

from kvroute.benchmarks.fleet import free_port
from kvroute.benchmarks.workloads import words
from kvroute.router.peer_key import PeerKey
from kvroute.router.routing.peer_auth import secure_subscriber
from kvroute.router.routing.peer_exchange import TOPIC, Placement, decode
from kvroute.router.routing.peer_load import LOAD_TOPIC, decode_report
from tests.servers import Scrape, SimServer, wait_until

LISTENING = re.compile(r"kvroute listening on http://[\d.]+:(\d+) \(policy [^,)]+(?:, (\d+) workers, pids ([\d ]+))?\)")
DIRECTORY = re.compile(r"workers' private directory \(Unix sockets, placement endpoints\): (\S+)")
ADMIN = "admin-secret"


class WorkersProcess:
    """``kvroute serve --workers N`` as a subprocess; stderr collected line by line."""

    def __init__(self, *args: str) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTE_")}
        command = [sys.executable, "-m", "kvroute.router.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
        self.process = subprocess.Popen([*command, *args], stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.pids: list[int] = []
        self.directory: Path | None = None

    def wait_listening(self) -> None:
        """Wait for the ``kvroute listening`` line (the supervisor's, once every worker listens)."""
        wait_until(lambda: self._listening() is not None or self.process.poll() is not None, timeout=90)
        assert self._listening() is not None, self.log
        port, _, pids = self._listening()  # type: ignore[misc]
        self.url = f"http://127.0.0.1:{port}"
        self.pids = [int(pid) for pid in (pids or "").split()]
        match = next((m for m in map(DIRECTORY.search, self.lines) if m), None)
        self.directory = Path(match.group(1)) if match else None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def _listening(self) -> tuple[int, int, str | None] | None:
        for line in self.lines:
            match = LISTENING.search(line)
            if match:
                return int(match.group(1)), int(match.group(2) or 1), match.group(3)
        return None

    def client(self) -> openai.OpenAI:
        """An openai client that opens a new connection for every request."""
        transport = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30)
        return openai.OpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, http_client=transport)

    def worker_metrics(self, index: int) -> Scrape:
        """Worker ``index``'s own metrics, from its internal Unix socket."""
        assert self.directory is not None, "not started with --workers"
        transport = httpx.HTTPTransport(uds=str(self.directory / f"worker-{index}.sock"))
        with httpx.Client(transport=transport, timeout=10) as client:
            response = client.get("http://worker/metrics")
        response.raise_for_status()
        return Scrape.parse(response.text)

    def metrics(self) -> Scrape:
        """``/metrics`` over a new connection (whichever worker it reaches)."""
        response = httpx.get(self.url + "/metrics", timeout=30, headers={"Connection": "close"})
        response.raise_for_status()
        return Scrape.parse(response.text)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for pid in self.pids:  # never leave a worker behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def serve_workers() -> Iterator[Any]:
    started: list[WorkersProcess] = []

    def start(*args: str, wait: bool = True) -> WorkersProcess:
        process = WorkersProcess(*args)
        started.append(process)  # stopped even if it never listens
        if wait:
            process.wait_listening()
        return process

    yield start
    for process in started:
        process.stop()


def backend_args(sims: list[SimServer]) -> list[str]:
    return [arg for sim in sims for arg in ("--backend", sim.url)]


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **headers: str) -> tuple[str, str]:
    """One chat; the backend and reason the router gave."""
    raw = client.chat.completions.with_raw_response.create(
        model="sim", messages=messages, max_tokens=4, extra_headers=headers or None
    )
    raw.parse()
    return raw.headers["x-kvroute-backend"], raw.headers["x-kvroute-reason"]


def test_two_workers_serve_and_metrics_sum_whichever_answers(sim_engines: Any, serve_workers: Any) -> None:
    sims = sim_engines(2)
    router = serve_workers("--workers", "2", *backend_args(sims))
    client = router.client()
    sent = 24
    for turn in range(sent):
        backend, _ = chat(client, [{"role": "user", "content": f"question {turn}: " + "words " * 30}])
        assert backend in {sim.url for sim in sims}
    own = [router.worker_metrics(index).value("kvroute_requests_total") for index in (0, 1)]
    assert sum(own) == sent and min(own) > 0, own  # both workers served
    for _ in range(6):  # new connections: the scrape reaches one worker or the other
        scrape = router.metrics()
        assert scrape.value("kvroute_requests_total") == sent
        assert scrape.value("kvroute_workers") == 2
        assert scrape.value("kvroute_workers_unreachable") == 0
        assert [scrape.value("kvroute_worker_requests", worker=str(i)) for i in (0, 1)] == own
        assert scrape.value("kvroute_request_duration_seconds_count") == sent
        for sim in sims:  # a state gauge every worker sees is not doubled
            assert scrape.value("kvroute_backend_healthy", backend=sim.url) == 1
    assert "Traceback" not in router.log


def agent_turns(sessions: int = 6, turns: int = 5, seed: int = 7) -> list[tuple[int, list[dict[str, str]]]]:
    """Seeded multi-turn sessions (a long per-session system prompt, growing histories),
    their turns interleaved at random but in order within each session."""
    rng = np.random.default_rng(seed)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"agent {s}: " + words(rng, 300)}] for s in range(sessions)
    ]
    order = [s for s in range(sessions) for _ in range(turns)]
    rng.shuffle(order)
    requests = []
    for session in order:
        history = histories[session]
        history.append({"role": "user", "content": words(rng, 60)})
        requests.append((session, [dict(message) for message in history]))
        history.append({"role": "assistant", "content": words(rng, 40)})
    return requests


def replay(router: WorkersProcess, sims: list[SimServer]) -> list[tuple[int, str]]:
    """Each turn's backend (as an index into ``sims``) and reason, sent one after another."""
    client = router.client()
    index = {sim.url: position for position, sim in enumerate(sims)}
    chosen = []
    for session, messages in agent_turns():
        backend, reason = chat(client, messages, **{"x-session-id": f"s{session}"})
        chosen.append((index[backend], reason))
    return chosen


def test_two_workers_route_a_replayed_workload_as_one_process(sim_engines: Any, serve_workers: Any) -> None:
    """The same seeded agent sessions, sent one request at a time, through one process and
    through two workers (each request on a new connection, so turns alternate between the
    workers): every request goes to the same backend, for the same reason. The placement
    exchange tells each worker what the other placed before the next turn arrives (it is
    published when the route is chosen, the upstream answer takes longer)."""
    single_sims = sim_engines(2)
    single = serve_workers("--policy", "cache_aware", *backend_args(single_sims))
    one = replay(single, single_sims)
    single.stop()
    worker_sims = sim_engines(2)
    workers = serve_workers("--workers", "2", "--policy", "cache_aware", *backend_args(worker_sims))
    two = replay(workers, worker_sims)
    served = [workers.worker_metrics(index).value("kvroute_requests_total") for index in (0, 1)]
    assert min(served) > 0, served  # the turns really were split between the workers
    assert sum(1 for reason in (r for _, r in one) if reason == "prefix_match") >= len(one) // 2
    assert canonical(two) == canonical(one)


def canonical(chosen: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Backends named by first use: the two sims are identical, and which one a cold tie
    goes to is the pool's order (the order their first health probes answered), in one
    process as in two."""
    names: dict[int, int] = {}
    return [(names.setdefault(backend, len(names)), reason) for backend, reason in chosen]


def test_sigterm_drains_every_worker(sim_engines: Any, serve_workers: Any) -> None:
    (sim,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=40.0)
    router = serve_workers("--workers", "2", "--backend", sim.url, "--drain-timeout-s", "30")
    streams: list[tuple[httpx.Client, Any, Iterator[str]]] = []
    results: list[list[str]] = []

    def in_flight(index: int) -> float:
        return router.worker_metrics(index).value("kvroute_backend_in_flight_requests")

    try:
        # Open streams on new connections until both workers hold one.
        while len(streams) < 16 and not (in_flight(0) and in_flight(1)):
            client = httpx.Client(timeout=30)
            context = client.stream(
                "POST",
                router.url + "/v1/chat/completions",
                json={"model": "sim", "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 60,
                      "stream": True},
            )  # fmt: skip
            response = context.__enter__()
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:")).startswith("data: {")
            streams.append((client, context, lines))
        assert in_flight(0) and in_flight(1)
        router.process.send_signal(signal.SIGTERM)
        for _, _, lines in streams:
            results.append([line for line in lines if line.startswith("data:")])
    finally:
        for client, context, _ in streams:
            context.__exit__(None, None, None)
            client.close()
    for rest in results:
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2].replace(" ", "")
    assert router.process.wait(timeout=30) == 0
    assert "Traceback" not in router.log
    for pid in router.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_admin_writes_reach_every_worker(sim_engines: Any, serve_workers: Any) -> None:
    first, second = sim_engines(2)
    router = serve_workers("--workers", "2", "--backend", first.url, "--admin-token", ADMIN)
    auth = {"Authorization": f"Bearer {ADMIN}", "Connection": "close"}

    def backends(index: int) -> set[str]:
        return router.worker_metrics(index).label_values("kvroute_backend_healthy", "backend")

    added = httpx.post(router.url + "/admin/backends", json={"url": second.url}, headers=auth, timeout=30)
    assert added.status_code == 201, added.text
    assert added.headers["x-kvroute-workers-applied"] == "2/2"
    assert backends(0) == backends(1) == {first.url, second.url}
    removed = httpx.request("DELETE", router.url + "/admin/backends", json={"url": first.url}, headers=auth, timeout=30)
    assert removed.status_code == 200 and removed.headers["x-kvroute-workers-applied"] == "2/2"
    assert backends(0) == backends(1) == {second.url}
    drained = httpx.post(router.url + "/admin/backends/drain", json={"url": second.url}, headers=auth, timeout=30)
    assert drained.status_code == 202 and drained.headers["x-kvroute-workers-applied"] == "2/2"
    wait_until(lambda: backends(0) == backends(1) == set())  # idle: each worker lets it go
    missing = httpx.request("DELETE", router.url + "/admin/backends", json={"url": first.url}, headers=auth, timeout=30)
    assert missing.status_code == 404  # refused here: not forwarded
    unauthorized = httpx.post(router.url + "/admin/backends", json={"url": first.url}, timeout=30)
    assert unauthorized.status_code == 401
    assert backends(0) == backends(1) == set()


def test_a_worker_that_cannot_start_fails_kvroute_serve(sim_engines: Any, serve_workers: Any) -> None:
    (sim,) = sim_engines(1)
    router = serve_workers("--workers", "2", "--backend", sim.url, "--tokenizer", "/nonexistent/tok", wait=False)
    assert router.process.wait(timeout=90) == 2
    wait_until(lambda: "before listening" in router.log, timeout=10)
    assert "cannot start: no tokenizer directory at /nonexistent/tok" in router.log
    assert "kvroute listening" not in router.log


def test_a_taken_port_fails_kvroute_serve(serve_workers: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        router = serve_workers("--workers", "2", "--port", str(port), wait=False)
        assert router.process.wait(timeout=60) == 2
    wait_until(lambda: "cannot listen on 127.0.0.1" in router.log, timeout=10)
    assert "Address already in use" in router.log


def test_other_routers_hear_every_worker_on_the_peer_bind(sim_engines: Any, serve_workers: Any, tmp_path: Path) -> None:
    """``--workers 2 --peer-bind --peer-secret-file``: the supervisor relays both workers'
    placements and load reports there over CurveZMQ, so another router holding the secret (a
    real ZMQ subscriber here) hears this one whole: every placement the workers published,
    and the reports of both workers apart."""
    sims = sim_engines(2)
    port = free_port()
    secret = tmp_path / "peer-secret"
    secret.write_text("fleet-secret-0123456789abcdefghijklmnop\n")
    context = zmq.Context()
    listener = context.socket(zmq.SUB)
    listener.setsockopt(zmq.LINGER, 0)
    for topic in (TOPIC, LOAD_TOPIC):
        listener.setsockopt(zmq.SUBSCRIBE, topic)
    secure_subscriber(listener, PeerKey.read(secret))
    listener.connect(f"tcp://127.0.0.1:{port}")
    try:
        router = serve_workers(
            "--workers", "2", "--peer-bind", f"tcp://127.0.0.1:{port}", "--peer-secret-file", str(secret),
            *backend_args(sims),
        )  # fmt: skip
        time.sleep(0.5)  # the subscription reaches the relay
        client = router.client()
        sent = 16
        for turn in range(sent):
            chat(client, [{"role": "user", "content": f"question {turn}: " + "words " * 30}])
        published = [router.worker_metrics(index) for index in (0, 1)]
        assert all(scrape.value("kvroute_requests_total") > 0 for scrape in published)  # both served
        placements: list[Placement] = []
        senders: set[bytes] = set()
        expected = sum(scrape.value("kvroute_peer_placements_total", event="published") for scrape in published)
        deadline = time.monotonic() + 10
        while (len(placements) < expected or len(senders) < 2) and time.monotonic() < deadline:
            if not listener.poll(100):
                continue
            frames = listener.recv_multipart()
            if frames[0] == LOAD_TOPIC:
                senders.add(decode_report(frames[1]).sender)
            else:
                placements.append(decode(frames))
        assert expected >= sent and len(placements) == expected
        assert {placement.backend for placement in placements} <= {sim.url for sim in sims}
        assert len(senders) == 2  # each worker's counts, summed apart by the peers
    finally:
        listener.close()
        context.term()


def test_a_peer_bind_the_supervisor_cannot_bind_fails_kvroute_serve(serve_workers: Any) -> None:
    router = serve_workers("--workers", "2", "--peer-bind", "tcp://192.0.2.1:5999", wait=False)
    assert router.process.wait(timeout=60) == 2
    wait_until(lambda: "peer_bind tcp://192.0.2.1:5999" in router.log, timeout=10)
    assert "kvroute listening" not in router.log


def test_a_unix_peer_bind_with_workers_is_refused(serve_workers: Any) -> None:
    router = serve_workers("--workers", "2", "--peer-bind", "unix:///tmp/kvroute-peers.sock", wait=False)
    assert router.process.wait(timeout=60) == 2
    wait_until(lambda: "peer_bind: with workers > 1 it must be a ZMQ endpoint" in router.log, timeout=10)


def test_a_crashed_worker_is_restarted(sim_engines: Any, serve_workers: Any) -> None:
    sims = sim_engines(2)
    router = serve_workers("--workers", "2", *backend_args(sims))
    os.kill(router.pids[1], signal.SIGKILL)
    wait_until(lambda: "worker 1 restarted" in router.log, timeout=90)
    assert "exited unexpectedly with status -9" in router.log
    client = router.client()
    for turn in range(8):
        chat(client, [{"role": "user", "content": f"after the crash {turn}"}])
    assert router.metrics().value("kvroute_workers_unreachable") == 0
    assert router.worker_metrics(1).value("kvroute_process_open_fds") > 0  # the new worker 1 answers
    router.process.send_signal(signal.SIGTERM)
    assert router.process.wait(timeout=30) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_idle_workers_exit_0_on_signal(signum: int, sim_engines: Any, serve_workers: Any) -> None:
    (sim,) = sim_engines(1)
    router = serve_workers("--workers", "2", "--backend", sim.url)
    assert httpx.get(router.url + "/health", timeout=30).status_code == 200
    router.process.send_signal(signum)
    assert router.process.wait(timeout=30) == 0
    wait_until(lambda: "kvroute stopped" in router.lines[-1], timeout=10)
    for pid in router.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
