"""mypy holds for the rooms listed here (configuration in pyproject.toml's [tool.mypy]).

The folders install as ``kvroute.*`` through a package-dir mapping that mypy cannot follow,
so the test lays the folders out under a ``kvroute/`` directory of symlinks and checks the
packages there. Imports of other rooms are followed silently: each room answers for its
own errors.
"""

from __future__ import annotations

import os
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
           "kvroute.router.workers", "kvroute.router.dns_name", "kvroute.router.peer_key",
           "kvroute.router.policy_catalog", "kvroute.router.cli"]  # fmt: skip
#: mypy's incremental cache, kept between runs as the e2e tier keeps its venv (a cold check
#: takes ~45 s of CI, a warm one a few): keyed by mypy's version and the files' contents, so
#: a stale entry is never used. ``KVROUTE_MYPY_CACHE`` overrides it.
CACHE = Path(os.environ.get("KVROUTE_MYPY_CACHE", Path.home() / ".cache" / "kvroute" / "mypy"))


@pytest.mark.timeout(900)
def test_mypy(tmp_path: Path) -> None:
    namespace = tmp_path / "kvroute"
    namespace.mkdir()
    for folder in ("router", "tokenizer_index", "benchmarks"):
        (namespace / folder).symlink_to(REPO / folder)
    targets = [arg for package in PACKAGES for arg in ("-p", package)]
    targets += [arg for module in MODULES for arg in ("-m", module)]
    config = ["--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(CACHE)]
    command = [sys.executable, "-m", "mypy", *config, *targets]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
