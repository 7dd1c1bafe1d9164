"""ruff's lint and format hold for the whole repository (configuration in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
