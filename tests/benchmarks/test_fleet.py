"""Benchmark children: their logs are deleted when they stop, or kept where asked."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from kvroute.benchmarks.fleet import KEEP_LOGS_ENV, ManagedProcess, SimFleet, SimSpec


def finished_child(name: str) -> ManagedProcess:
    child = ManagedProcess(name, [sys.executable, "-c", "print('a decision')"], "http://127.0.0.1:9")
    child.process.wait(30)
    return child


def test_a_stopped_childs_log_is_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_LOGS_ENV, raising=False)
    child = finished_child("kvroute-cache_aware")
    log = Path(child._log.name)
    assert "a decision" in child.log_tail()
    child.stop()
    assert not log.exists()


def test_a_stopped_childs_log_is_kept_where_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(KEEP_LOGS_ENV, str(tmp_path / "logs"))
    child = finished_child("peer:sglang-router")
    child.stop()
    assert (tmp_path / "logs" / f"peer-sglang-router-{child.pid}.log").read_text() == "a decision\n"


async def test_a_sim_fleet_whose_port_was_taken_starts_on_other_ports() -> None:
    """A port free when the fleet picked it may be taken before the replica binds it (an
    outgoing connection, another test's server): the fleet picks others and starts."""
    fleet = SimFleet(SimSpec(replicas=1, time_scale=20, kv_capacity_tokens=4096, kv_events=True))
    taken = fleet.ports[0]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            await fleet.fresh()
            assert fleet.ports[0] != taken and set(fleet.kv_events) == set(fleet.urls)
            async with aiohttp.ClientSession() as session, session.get(fleet.urls[0] + "/health") as answer:
                assert answer.status == 200
        finally:
            fleet.stop()
