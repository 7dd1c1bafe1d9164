"""The lower bounds pyproject.toml declares are real: kvroute installs and works on them.

A fresh virtual environment gets every runtime dependency at exactly its declared minimum
(``>=X`` becomes ``==X``), kvroute itself without dependencies, and the test tools at their
current versions; then the core suites (tokenizer, prefix index and kernels, the proxy over
real sockets) run in it. Installing the floors takes about a minute of CI, so the
environment with them and the tools is built once per set of pins and kept (as the e2e tier
keeps its vLLM venv); each run copies it and installs this checkout into the copy. A floor that cannot be installed together (pydantic-settings 2.3
needs pydantic 2.7) or that lacks an API the code calls (``encode_batch_fast`` needs
tokenizers 0.20) fails here instead of on a user's machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
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
    # the word splitter's regex translations against the library, on the floor's regex module
    "tests/tokenizer_index/test_word_split.py",
    "tests/tokenizer_index/test_prefix_index.py",
    "tests/tokenizer_index/test_kernels.py",
    # compares the chat sandbox's shortcuts with the installed Jinja's general paths
    "tests/tokenizer_index/test_chat_template_sandbox.py",
    "tests/router/forwarding/test_proxy.py",
    "tests/router/test_bad_input.py",
]
TEST_TOOLS = ["pytest", "pytest-asyncio", "pytest-timeout", "openai", "httpx", "hypothesis"]
#: Where the environments of floors are kept, one per set of pins and tools.
CACHE = Path(os.environ.get("KVROUTE_FLOOR_VENVS", Path.home() / ".cache" / "kvroute" / "floor-venvs"))

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


def floor_venv(floors: Path) -> Path:
    """The kept environment of these floors and the test tools, built if missing. Built
    under a private name and renamed, so two runs at once never share a half-built one."""
    key = hashlib.sha256("\n".join([floors.read_text(), *TEST_TOOLS, sys.version]).encode()).hexdigest()[:16]
    kept = CACHE / key
    if (kept / "complete").exists():
        return kept
    building = CACHE / f"{key}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    building.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(building)], ROOT)
    pip = [str(building / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "--only-binary", ":all:", "-r", str(floors)], ROOT)
    # The test tools may not move a runtime dependency off its floor.
    _run([*pip, "-c", str(floors), *TEST_TOOLS], ROOT)
    (building / "complete").write_text(floors.read_text())
    try:
        building.rename(kept)
    except OSError:  # another run kept one first
        shutil.rmtree(building, ignore_errors=True)
    for other in CACHE.iterdir():  # older pins' environments (~400 MB each)
        if other.name != key and (other / "complete").exists():
            shutil.rmtree(other, ignore_errors=True)
    return kept


def test_the_core_suites_pass_on_the_declared_minimums(tmp_path: Path) -> None:
    floors = tmp_path / "floors.txt"
    floors.write_text("\n".join(floor_pins(ROOT / "pyproject.toml")) + "\n")
    venv = tmp_path / "venv"
    shutil.copytree(floor_venv(floors), venv, symlinks=True)  # a venv runs from wherever it lies
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-e", str(ROOT)], ROOT)
    # In one process: pyproject's addopts ask for pytest-xdist, which is no floor of ours.
    _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-x", *SUITES], ROOT)
