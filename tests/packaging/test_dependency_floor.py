"""The lower bounds pyproject.toml declares are real: kvroute installs and works on them.

A fresh virtual environment gets every runtime dependency at exactly its declared minimum
(``>=X`` becomes ``==X``), kvroute itself without dependencies, and the test tools at their
current versions; then the core suites (tokenizer, prefix index and kernels, the proxy over
real sockets) run in it. A floor that cannot be installed together (pydantic-settings 2.3
needs pydantic 2.7) or that lacks an API the code calls (``encode_batch_fast`` needs
tokenizers 0.20) fails here instead of on a user's machine.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.paths import REPO

ROOT = REPO
SUITES = [
    "tests/tokenizer_index/test_tokenizer.py",
    "tests/tokenizer_index/test_prefix_index.py",
    "tests/tokenizer_index/test_kernels.py",
    "tests/router/forwarding/test_proxy.py",
    "tests/router/test_bad_input.py",
]
TEST_TOOLS = ["pytest", "pytest-asyncio", "pytest-timeout", "openai", "httpx", "hypothesis"]

pytestmark = [pytest.mark.dependency_floor, pytest.mark.timeout(1200)]


def floor_pins(pyproject: Path) -> list[str]:
    """``name==minimum`` for every runtime dependency that applies to this platform."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = []
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(floors) == 1, f"{line!r}: every runtime dependency declares one lower bound"
        pins.append(f"{requirement.name}=={floors[0]}")
    return pins


def test_every_runtime_dependency_declares_a_floor() -> None:
    pins = floor_pins(ROOT / "pyproject.toml")
    assert any(pin.startswith("tokenizers==") for pin in pins)
    assert all(pin.count("==") == 1 for pin in pins)


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, check=False, cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command[:4])} ...:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def test_the_core_suites_pass_on_the_declared_minimums(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], ROOT)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    floors = tmp_path / "floors.txt"
    floors.write_text("\n".join(floor_pins(ROOT / "pyproject.toml")) + "\n")
    _run([*pip, "--only-binary", ":all:", "-r", str(floors)], ROOT)
    _run([*pip, "--no-deps", "-e", str(ROOT)], ROOT)
    # The test tools may not move a runtime dependency off its floor.
    _run([*pip, "-c", str(floors), *TEST_TOOLS], ROOT)
    _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITES], ROOT)
