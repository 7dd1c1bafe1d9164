"""Graceful shutdown of a real ``kvroute serve`` process: SIGTERM stops accepting, drains, exits 0."""

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
from typing import Any

import httpx
import pytest

from tests.servers import SimServer, wait_until

MESSAGES = [{"role": "user", "content": "tell me a long story"}]
LISTENING = re.compile(r"kvroute listening on http://([\d.]+):(\d+)")


class RouterProcess:
    """``kvroute serve`` as a subprocess; its stderr is collected line by line."""

    def __init__(self, *args: str) -> None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("KVROUTE_")}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvroute.router.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--policy",
                "round_robin",
                *args,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_until(lambda: self.port is not None or self.process.poll() is not None, timeout=60)
        assert self.port is not None, "".join(self.lines)
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def port(self) -> int | None:
        for line in self.lines:
            match = LISTENING.search(line)
            if match:
                return int(match.group(2))
        return None

    def accepts_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port or 0), timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def router_process() -> Iterator[Any]:
    started: list[RouterProcess] = []

    def start(*args: str) -> RouterProcess:
        process = RouterProcess(*args)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def slow_sim(sim_engines: Any) -> SimServer:
    (sim,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=40.0)
    return sim


def test_sigterm_drains_a_running_stream_then_exits_0(sim_engines: Any, router_process: Any) -> None:
    sim = slow_sim(sim_engines)
    router = router_process("--backend", sim.url, "--drain-timeout-s", "30")
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "sim", "messages": MESSAGES, "max_tokens": 60, "stream": True},
    ) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert first.startswith("data: {")
        router.process.send_signal(signal.SIGTERM)
        wait_until(lambda: not router.accepts_connections(), timeout=10)
        assert router.process.poll() is None  # still draining the stream
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2].replace(" ", "")
    assert router.process.wait(timeout=30) == 0
    assert sim.metrics().value("vllm:num_requests_running") == 0
    assert "Traceback" not in "".join(router.lines)


def test_drain_timeout_bounds_the_wait(sim_engines: Any, router_process: Any) -> None:
    sim = slow_sim(sim_engines)
    router = router_process("--backend", sim.url, "--drain-timeout-s", "0.5")
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "sim", "messages": MESSAGES, "max_tokens": 5000, "stream": True},
    ) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        started = time.monotonic()
        router.process.send_signal(signal.SIGTERM)
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
    assert router.process.wait(timeout=30) == 0
    assert time.monotonic() - started < 15
    wait_until(lambda: sim.metrics().value("vllm:num_requests_running") == 0)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_idle_router_exits_0_on_signal(signum: int, sim_engines: Any, router_process: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_process("--backend", sim.url)
    assert httpx.get(router.url + "/health", timeout=30).status_code == 200
    router.process.send_signal(signum)
    assert router.process.wait(timeout=30) == 0
