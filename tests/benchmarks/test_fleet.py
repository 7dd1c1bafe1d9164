"""Benchmark children: their logs are deleted when they stop, or kept where asked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvroute.benchmarks.fleet import KEEP_LOGS_ENV, ManagedProcess


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
