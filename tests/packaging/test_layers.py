"""The rooms import one way: a change in a lower room never needs a higher one.

``tokenizer_index`` imports nothing of ours; inside ``router`` the order is
process (cli, serve, workers) -> http -> forwarding -> routing -> fleet -> engines -> base (config,
errors, backend_url). The repository's folders are installed as ``kvroute.*`` only, so no
code or test may import them by their folder names.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.paths import REPO

#: Each room and the rooms it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "tokenizer_index": set(),
    "base": {"tokenizer_index"},
    "engines": {"base", "tokenizer_index"},
    "fleet": {"engines", "base", "tokenizer_index"},
    "routing": {"fleet", "engines", "base", "tokenizer_index"},
    "forwarding": {"routing", "fleet", "engines", "base", "tokenizer_index"},
    "http": {"forwarding", "routing", "fleet", "engines", "base", "tokenizer_index"},
    "process": {"http", "forwarding", "routing", "fleet", "engines", "base", "tokenizer_index"},
    "sim_engine": {"tokenizer_index"},
    "benchmarks": {
        "sim_engine",
        "process",
        "http",
        "forwarding",
        "routing",
        "fleet",
        "engines",
        "base",
        "tokenizer_index",
    },
}
ROOMS = {"http", "forwarding", "routing", "fleet", "engines"}
PROCESS = {"cli", "serve", "workers"}
FOLDERS = ("router", "tokenizer_index", "benchmarks")


def room_of(module: str) -> str:
    """The room of a ``kvroute.*`` module name."""
    parts = module.split(".")[1:]
    if parts[0] == "tokenizer_index":
        return "tokenizer_index"
    if parts[0] == "benchmarks":
        return "sim_engine" if parts[1:2] == ["sim_engine"] else "benchmarks"
    if len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    return "process" if len(parts) > 1 and parts[1] in PROCESS else "base"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvroute", *parts])


def imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every absolute module name a file imports, anywhere in it (TYPE_CHECKING included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_room_imports_only_the_rooms_below_it(folder: str) -> None:
    crossings = []
    for path in sources(folder):
        room = room_of(module_name(path))
        for line, name in imported(ast.parse(path.read_text())):
            if not name.startswith("kvroute."):
                continue
            target = room_of(name)
            if target != room and target not in ALLOWED[room]:
                crossings.append(f"{path.relative_to(REPO)}:{line} ({room}) imports {name} ({target})")
    assert not crossings, "\n".join(crossings)


def test_nothing_imports_the_folders_by_their_own_names() -> None:
    """``import router`` would load a second copy of the code beside ``kvroute.router``."""
    found = []
    for path in sources(*FOLDERS, "tests", "deploy"):
        for line, name in imported(ast.parse(path.read_text())):
            if name.split(".")[0] in FOLDERS:
                found.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not found, "\n".join(found)
