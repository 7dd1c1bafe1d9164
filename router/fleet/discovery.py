"""Backend discovery: where the set of backend URLs comes from, and how it follows changes.

Three sources share one interface, :class:`BackendSource`: ``run(on_change)`` runs until
cancelled and calls ``on_change(urls)`` with the *full* set of backend URLs each time that
set changes (never with a partial delta, so a missed call cannot leave the pool wrong).

- :class:`StaticDiscovery` — the ``--backend`` URLs, reported once.
- :class:`FileDiscovery` — ``--discovery file --backends-file F``: a YAML list or one URL a
  line, re-read whenever its modification time, size or inode changes.
- :class:`kvroute.router.fleet.k8s_discovery.KubernetesDiscovery` — ``--discovery k8s``: the EndpointSlices
  matching a label selector, listed and then watched through ``kubernetes_asyncio`` (the
  optional ``kvroute[k8s]`` extra, imported only when this source is chosen, so the router
  runs without it otherwise).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Protocol

import yaml

from kvroute.router.backend_url import parse_backend_url
from kvroute.router.config import ConfigError, Settings

log = logging.getLogger("kvroute.discovery")

OnChange = Callable[[set[str]], Awaitable[None]]


class BackendSource(Protocol):
    """Anything that reports the current set of backend URLs."""

    async def run(self, on_change: OnChange) -> None:
        """Run until cancelled; call ``on_change`` with the full URL set whenever it changes."""


def normalize_backend_url(url: str) -> str:
    """A backend URL as written (checked; trailing slash dropped): its path prefix and any
    credentials stay, for the backend's :class:`~kvroute.router.fleet.backend_access.BackendAccess`."""
    url = url.strip()
    parse_backend_url(url)  # raises ValueError naming what is wrong
    return url.rstrip("/")


class ChangeReporter:
    """Calls ``on_change`` only when the set really differs from the last one reported."""

    def __init__(self, on_change: OnChange) -> None:
        self._on_change = on_change
        self._last: frozenset[str] | None = None

    async def report(self, urls: frozenset[str]) -> None:
        if urls == self._last:
            return
        added = sorted(urls - (self._last or frozenset()))
        removed = sorted((self._last or frozenset()) - urls)
        self._last = urls
        log.info("backends changed: %d now, added %s, removed %s", len(urls), added, removed)
        await self._on_change(set(urls))


# --------------------------------------------------------------------------- static


class StaticDiscovery:
    """A fixed list of backends (``--backend URL`` or the config file's ``backends:``)."""

    def __init__(self, urls: list[str]) -> None:
        self._urls = frozenset(normalize_backend_url(url) for url in urls)

    async def run(self, on_change: OnChange) -> None:
        await ChangeReporter(on_change).report(self._urls)


# --------------------------------------------------------------------------- file


class BackendsFileError(ValueError):
    """The backends file could not be parsed; the message says where."""


def parse_backends_file(text: str) -> frozenset[str]:
    """Backend URLs from a backends file.

    Accepted forms: a YAML list of URLs or of ``{url: ...}`` objects, a YAML mapping with a
    ``backends:`` list, or plain text with one URL a line (``#`` starts a comment).
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict):
        data = data.get("backends")
        if not isinstance(data, list):
            raise BackendsFileError("a YAML mapping must hold a 'backends:' list")
    if isinstance(data, list):
        items = [item["url"] if isinstance(item, dict) and "url" in item else item for item in data]
    else:
        # Plain text parses as one YAML string (or nothing): read it line by line.
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        items = [line for line in lines if line]
    urls: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            raise BackendsFileError(f"expected a URL, got {item!r}")
        try:
            urls.add(normalize_backend_url(item))
        except ValueError as exc:
            raise BackendsFileError(str(exc)) from exc
    return frozenset(urls)


class FileDiscovery:
    """Backends listed in a file, reloaded when the file changes (polled, no inotify needed).

    A file that is missing or malformed keeps the last good set: a half-written file during
    an edit or a ConfigMap update must not empty the pool.
    """

    def __init__(self, path: Path, poll_interval_s: float = 1.0) -> None:
        self._path = path
        self._poll_interval_s = poll_interval_s

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            stat = self._path.stat()
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size, stat.st_ino)

    async def run(self, on_change: OnChange) -> None:
        reporter = ChangeReporter(on_change)
        seen: tuple[int, int, int] | None = None
        warned_missing = False
        while True:
            signature = self._signature()
            if signature is None and not warned_missing:
                log.warning("backends file %s does not exist (yet); keeping current backends", self._path)
                warned_missing = True
            if signature is not None and signature != seen:
                seen, warned_missing = signature, False
                await self._reload(reporter)
            await asyncio.sleep(self._poll_interval_s)

    async def _reload(self, reporter: ChangeReporter) -> None:
        try:
            urls = parse_backends_file(self._path.read_text())
        except (OSError, UnicodeDecodeError, BackendsFileError) as exc:
            log.warning("backends file %s not applied, keeping current backends: %s", self._path, exc)
            return
        await reporter.report(urls)


# --------------------------------------------------------------------------- factory


K8S_EXTRA_MISSING = "--discovery k8s needs the Kubernetes client: pip install 'kvroute[k8s]' (kubernetes_asyncio)"


def _k8s_discovery_module() -> ModuleType:
    """``kvroute.router.fleet.k8s_discovery``, imported on first use: kubernetes_asyncio is the optional k8s extra."""
    try:
        return importlib.import_module("kvroute.router.fleet.k8s_discovery")
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("kubernetes_asyncio"):
            raise
        raise ConfigError(K8S_EXTRA_MISSING) from exc


def check_discovery(settings: Settings) -> None:
    """Raise :class:`ConfigError` at start-up when the chosen source cannot run here."""
    if settings.discovery == "k8s":
        _k8s_discovery_module()


def build_discovery(settings: Settings) -> BackendSource:
    """The backend source that ``settings.discovery`` names."""
    if settings.discovery == "file":
        assert settings.backends_file is not None  # Settings validation guarantees it
        return FileDiscovery(settings.backends_file)
    if settings.discovery == "k8s":
        k8s = _k8s_discovery_module()
        access = k8s.KubernetesAccess(api_url=settings.k8s_api_url)
        return k8s.KubernetesDiscovery(access, settings.k8s_namespace, settings.k8s_selector, settings.k8s_port)
    return StaticDiscovery([backend.url for backend in settings.backends])


__all__ = [
    "K8S_EXTRA_MISSING",
    "BackendSource",
    "BackendsFileError",
    "ChangeReporter",
    "FileDiscovery",
    "OnChange",
    "StaticDiscovery",
    "build_discovery",
    "check_discovery",
    "normalize_backend_url",
    "parse_backends_file",
]
