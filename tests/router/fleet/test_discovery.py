"""Backend discovery from static lists and real files, and the factory that picks a source.

Kubernetes discovery has its own module, ``test_k8s_discovery.py`` (it needs the k8s extra).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvroute.router.config import load_settings
from kvroute.router.fleet.discovery import FileDiscovery, StaticDiscovery, build_discovery, parse_backends_file
from tests.paths import REPO
from tests.router.fleet.discovery_helpers import Changes, running, stop

# --------------------------------------------------------------------------- files


def test_parse_backends_file_forms() -> None:
    expected = {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    assert parse_backends_file("# fleet\nhttp://10.0.0.1:8000/\n\nhttp://10.0.0.2:8000  # second\n") == expected
    assert parse_backends_file("- http://10.0.0.1:8000\n- http://10.0.0.2:8000\n") == expected
    assert parse_backends_file("backends:\n  - url: http://10.0.0.1:8000\n  - http://10.0.0.2:8000\n") == expected
    assert parse_backends_file("") == frozenset()
    with pytest.raises(ValueError, match="http"):
        parse_backends_file("10.0.0.1:8000\n")
    with pytest.raises(ValueError, match="backends"):
        parse_backends_file("servers: [http://10.0.0.1:8000]\n")


def _write(path: Path, text: str) -> None:
    """Write and move the mtime forward, so a change is visible even on coarse clocks."""
    previous = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(previous + 2_000_000_000, previous + 2_000_000_000))


async def test_file_discovery_reloads_on_change(tmp_path: Path) -> None:
    path = tmp_path / "backends.txt"
    _write(path, "http://127.0.0.1:8101\nhttp://127.0.0.1:8102\n")
    changes = Changes()
    task = await running(FileDiscovery(path, poll_interval_s=0.02), changes)
    try:
        await changes.until({"http://127.0.0.1:8101", "http://127.0.0.1:8102"})
        _write(path, "- http://127.0.0.1:8102\n- http://127.0.0.1:8103\n")
        await changes.until({"http://127.0.0.1:8102", "http://127.0.0.1:8103"})
        # A broken edit keeps the last good set; the next good edit applies.
        _write(path, "- http://127.0.0.1:8104\n- not a url\n")
        await asyncio.sleep(0.3)
        assert changes.calls[-1] == {"http://127.0.0.1:8102", "http://127.0.0.1:8103"}
        path.unlink()
        await asyncio.sleep(0.1)
        _write(path, "http://127.0.0.1:8104\n")
        await changes.until({"http://127.0.0.1:8104"})
        assert len(changes.calls) == 3
    finally:
        await stop(task)


async def test_file_discovery_waits_for_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "later.yaml"
    changes = Changes()
    task = await running(FileDiscovery(path, poll_interval_s=0.02), changes)
    try:
        await asyncio.sleep(0.1)
        assert changes.calls == []
        _write(path, "backends: [http://127.0.0.1:9001]\n")
        await changes.until({"http://127.0.0.1:9001"})
    finally:
        await stop(task)


# --------------------------------------------------------------------------- factory


async def test_build_discovery_from_settings(tmp_path: Path) -> None:
    static = build_discovery(load_settings({"backends": ["http://127.0.0.1:8101/", "http://127.0.0.1:8102"]}))
    assert isinstance(static, StaticDiscovery)
    changes = Changes()
    await static.run(changes)
    assert changes.calls == [{"http://127.0.0.1:8101", "http://127.0.0.1:8102"}]

    backends_file = tmp_path / "b.txt"
    file_source = build_discovery(load_settings({"discovery": "file", "backends_file": str(backends_file)}))
    assert isinstance(file_source, FileDiscovery)


# Runs in a fresh interpreter where kubernetes_asyncio cannot be imported (as where the
# kvroute[k8s] extra was never installed): ``sys.modules[name] = None`` makes every import of
# it fail with ModuleNotFoundError, exactly as an absent package does.
WITHOUT_K8S_EXTRA = """
import sys
sys.modules["kubernetes_asyncio"] = None
"""


def run_without_k8s_extra(script: str) -> subprocess.CompletedProcess[str]:
    code = WITHOUT_K8S_EXTRA + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_k8s_discovery_without_the_extra_is_a_clear_startup_error() -> None:
    result = run_without_k8s_extra("""
        from kvroute.router.serve import main
        sys.exit(main(["--discovery", "k8s", "--port", "0", "--host", "127.0.0.1"]))
    """)
    assert result.returncode == 2, result.stderr
    assert "pip install 'kvroute[k8s]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_router_serves_without_the_extra_when_discovery_is_not_k8s(tmp_path: Path) -> None:
    backends = tmp_path / "backends.txt"
    backends.write_text("http://127.0.0.1:9\n")
    result = run_without_k8s_extra(f"""
        import asyncio
        import aiohttp
        from aiohttp import web
        from kvroute.router.http.app import build_app
        from kvroute.router.config import load_settings

        async def main():
            for config in ({{"backends": ["http://127.0.0.1:9"]}},
                           {{"discovery": "file", "backends_file": {str(backends)!r}}}):
                runner = web.AppRunner(build_app(load_settings(config)))
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                port = site._server.sockets[0].getsockname()[1]
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://127.0.0.1:{{port}}/livez") as response:
                        print(config.get("discovery", "static"), response.status)
                await runner.cleanup()
            print("k8s client loaded:", any(name.startswith("kubernetes_asyncio.") for name in sys.modules))

        asyncio.run(main())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["static 200", "file 200", "k8s client loaded: False"]
