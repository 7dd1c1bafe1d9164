"""mypy holds for the rooms listed here (configuration in pyproject.toml's [tool.mypy]).

The folders install as ``kvroute.*`` through a package-dir mapping that mypy cannot follow,
so the test lays the folders out under a ``kvroute/`` directory of symlinks and checks the
packages there. Imports of other rooms are followed silently: each room answers for its
own errors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGES = [
    "kvroute.tokenizer_index",
    "kvroute.router.engines",
    "kvroute.router.fleet",
    "kvroute.router.forwarding",
    "kvroute.router.http",
    "kvroute.router.routing",
]
MODULES = ["kvroute.router.config", "kvroute.router.errors", "kvroute.router.backend_url", "kvroute.router.serve",
           "kvroute.router.workers",
           "kvroute.router.cli"]  # fmt: skip


@pytest.mark.timeout(900)
def test_mypy(tmp_path: Path) -> None:
    namespace = tmp_path / "kvroute"
    namespace.mkdir()
    for folder in ("router", "tokenizer_index", "benchmarks"):
        (namespace / folder).symlink_to(REPO / folder)
    targets = [arg for package in PACKAGES for arg in ("-p", package)]
    targets += [arg for module in MODULES for arg in ("-m", module)]
    command = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), *targets]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
