"""The wheel installs ``kvroute.*`` and nothing else at the top level of site-packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.paths import REPO

FOLDERS = {"router": "kvroute.router", "tokenizer_index": "kvroute.tokenizer_index", "benchmarks": "kvroute.benchmarks"}


def test_every_package_folder_is_listed_once_under_kvroute() -> None:
    """pyproject.toml names packages one by one (a package-dir mapping cannot be found
    automatically): a new folder with an ``__init__.py`` must be added there."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join([FOLDERS[init.relative_to(REPO).parts[0]], *init.relative_to(REPO).parts[1:-1]])
        for folder in FOLDERS
        for init in (REPO / folder).rglob("__init__.py")
    }
    assert listed == on_disk


@pytest.mark.timeout(600)
def test_wheel_in_a_clean_venv_exposes_only_kvroute(tmp_path: Path) -> None:
    pip = [sys.executable, "-m", "pip"]
    source = tmp_path / "source"  # pip builds in the tree: keep build/ out of the checkout
    ignore = shutil.ignore_patterns("__pycache__", "results", "reliability", "*.egg-info", "build")
    for folder in FOLDERS:
        shutil.copytree(REPO / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(source)], check=True)
    (wheel,) = (tmp_path / "dist").glob("kvroute-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([*pip, "--python", str(python), "install", "-q", "--no-deps", str(wheel)], check=True)

    (site_packages,) = venv.glob("lib/python*/site-packages")
    top_level = {path.name for path in site_packages.iterdir() if not path.name.startswith(("_", "."))}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"kvroute"}
    assert (venv / "bin" / "kvroute").exists()
    assert (site_packages / "kvroute" / "tokenizer_index" / "data").is_dir()  # package data travels

    probe = (
        "import importlib.util as u; "
        "print([n for n in ('router', 'benchmarks', 'tokenizer_index') if u.find_spec(n)]); "
        "print(bool(u.find_spec('kvroute.router.cli')), bool(u.find_spec('kvroute.benchmarks.sim_engine')))"
    )
    seen = subprocess.run([str(python), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert seen.stdout.split("\n")[:2] == ["[]", "True True"]
