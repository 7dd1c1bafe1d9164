"""Backend discovery: where the set of backend URLs comes from, and how it follows changes.

Three sources share one interface, :class:`BackendSource`: ``run(on_change)`` runs until
cancelled and calls ``on_change(urls)`` with the *full* set of backend URLs each time that
set changes (never with a partial delta, so a missed call cannot leave the pool wrong).

- :class:`StaticDiscovery` — the ``--backend`` URLs, reported once.
- :class:`FileDiscovery` — ``--discovery file --backends-file F``: a YAML list or one URL a
  line, re-read whenever its modification time, size or inode changes.
- :class:`KubernetesDiscovery` — ``--discovery k8s``: the EndpointSlices matching a label
  selector, listed and then watched through the Kubernetes API with the pod's service
  account, re-listed when the watch history is gone (410) as client-go's reflector does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlencode

import aiohttp
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from router.config import BackendConfig, Settings

log = logging.getLogger("kvroute.discovery")

OnChange = Callable[[set[str]], Awaitable[None]]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class BackendSource(Protocol):
    """Anything that reports the current set of backend URLs."""

    async def run(self, on_change: OnChange) -> None:
        """Run until cancelled; call ``on_change`` with the full URL set whenever it changes."""


def normalize_backend_url(url: str) -> str:
    """The canonical form of a backend URL (scheme checked, trailing slash dropped)."""
    return BackendConfig(url=url.strip()).url


class _Reporter:
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
        await _Reporter(on_change).report(self._urls)


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
        except ValidationError as exc:
            raise BackendsFileError(exc.errors()[0]["msg"]) from exc
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
        reporter = _Reporter(on_change)
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

    async def _reload(self, reporter: _Reporter) -> None:
        try:
            urls = parse_backends_file(self._path.read_text())
        except (OSError, UnicodeDecodeError, BackendsFileError) as exc:
            log.warning("backends file %s not applied, keeping current backends: %s", self._path, exc)
            return
        await reporter.report(urls)


# --------------------------------------------------------------------------- Kubernetes
# The subset of discovery.k8s.io/v1 EndpointSlice and of the watch protocol that we read.


class _K8sModel(BaseModel):
    model_config = ConfigDict(extra="ignore", alias_generator=to_camel, populate_by_name=True)


class ObjectMeta(_K8sModel):
    name: str = ""
    namespace: str = ""
    resource_version: str = ""
    continue_: str | None = Field(default=None, alias="continue")


class EndpointConditions(_K8sModel):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class Endpoint(_K8sModel):
    addresses: list[str]
    conditions: EndpointConditions = Field(default_factory=EndpointConditions)

    @property
    def is_ready(self) -> bool:
        # The API reference: a nil ``ready`` is an unknown state that consumers should read
        # as ready; terminating endpoints are reported with ready=false.
        return self.conditions.ready is not False


class EndpointPort(_K8sModel):
    name: str | None = None
    port: int | None = None
    protocol: str = "TCP"


class EndpointSlice(_K8sModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    address_type: Literal["IPv4", "IPv6", "FQDN"] = "IPv4"
    endpoints: list[Endpoint] | None = None
    ports: list[EndpointPort] | None = None


class EndpointSliceList(_K8sModel):
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    items: list[EndpointSlice] = Field(default_factory=list)


class Status(_K8sModel):
    """The API's error object (``kind: Status``), in error bodies and ERROR watch events."""

    message: str = ""
    reason: str = ""
    code: int = 0


class WatchEvent(_K8sModel):
    type: Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]
    object: dict[str, Any]


class KubernetesAPIError(RuntimeError):
    """A non-success answer of the API server (the message carries its Status)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API answered {status}: {message}")
        self.status = status


class ResourceVersionGone(KubernetesAPIError):
    """410 Gone: the watch history no longer reaches our resourceVersion; re-list."""


def _host_for_url(address: str, address_type: str) -> str:
    if address_type == "IPv6" or (address_type != "FQDN" and ":" in address):
        return f"[{ipaddress.IPv6Address(address).compressed}]"
    return address


def _slice_port(endpoint_slice: EndpointSlice, port_override: int | None) -> int | None:
    """The serving port: the configured one, else the slice's ``http`` port, else its first."""
    if port_override is not None:
        return port_override
    tcp_ports = [port for port in endpoint_slice.ports or [] if port.port and port.protocol == "TCP"]
    for port in tcp_ports:
        if port.name == "http":
            return port.port
    return tcp_ports[0].port if tcp_ports else None


def slice_backend_urls(endpoint_slice: EndpointSlice, port_override: int | None, scheme: str = "http") -> frozenset[str]:
    """Backend URLs of one EndpointSlice's ready endpoints."""
    port = _slice_port(endpoint_slice, port_override)
    if port is None:
        if endpoint_slice.endpoints:
            log.warning("EndpointSlice %s has no TCP port and --k8s-port is not set; ignored", endpoint_slice.metadata.name)
        return frozenset()
    urls = set()
    for endpoint in endpoint_slice.endpoints or []:
        if endpoint.is_ready and endpoint.addresses:
            # Addresses of one endpoint are fungible (API reference): the first one will do.
            host = _host_for_url(endpoint.addresses[0], endpoint_slice.address_type)
            urls.add(f"{scheme}://{host}:{port}")
    return frozenset(urls)


@dataclass(frozen=True, slots=True)
class KubernetesAccess:
    """Where the API server is and how to authenticate (in-cluster service account)."""

    api_url: str
    token_path: Path | None
    ca_path: Path | None

    @classmethod
    def in_cluster(cls, api_url: str | None = None, service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubernetesAccess:
        """The service account's token and CA; the API URL from the pod's environment."""
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if ":" in host:
                host = f"[{host}]"
            api_url = f"https://{host}:{port}"
        token_path = service_account_dir / "token"
        ca_path = service_account_dir / "ca.crt"
        return cls(
            api_url=api_url.rstrip("/"),
            token_path=token_path if token_path.exists() else None,
            ca_path=ca_path if ca_path.exists() else None,
        )

    def headers(self) -> dict[str, str]:
        """Request headers; the token is re-read each time because bound tokens rotate."""
        headers = {"Accept": "application/json"}
        if self.token_path is not None:
            headers["Authorization"] = f"Bearer {self.token_path.read_text().strip()}"
        return headers

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.api_url.startswith("https://"):
            return False
        if self.ca_path is not None:
            return ssl.create_default_context(cafile=str(self.ca_path))
        return True


class KubernetesDiscovery:
    """Backends from the EndpointSlices that match a label selector, list-then-watch.

    Each slice contributes the ready endpoints' first address with the serving port; the
    backend set is the union over slices. After a list, a watch streams changes from the
    list's resourceVersion; a watch that ends normally (the server's timeout) resumes from
    the last resourceVersion seen, while 410 Gone (as HTTP status or ERROR event) re-lists.
    Other failures retry with exponential backoff, keeping the current backends meanwhile.
    """

    def __init__(
        self,
        access: KubernetesAccess,
        namespace: str,
        selector: str,
        port: int | None = None,
        *,
        watch_timeout_s: int = 300,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        page_size: int = 500,
    ) -> None:
        self._access = access
        self._namespace = namespace
        self._selector = selector
        self._port = port
        self._watch_timeout_s = watch_timeout_s
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._page_size = page_size
        self._slices: dict[str, frozenset[str]] = {}
        self._resource_version: str | None = None

    @property
    def _collection_url(self) -> str:
        return f"{self._access.api_url}/apis/discovery.k8s.io/v1/namespaces/{self._namespace}/endpointslices"

    def _backends(self) -> frozenset[str]:
        return frozenset().union(*self._slices.values())

    async def run(self, on_change: OnChange) -> None:
        reporter = _Reporter(on_change)
        delay = self._retry_initial_s
        # No total timeout: a watch is a long-lived response; sock_read bounds a dead stream.
        timeout = aiohttp.ClientTimeout(total=None, connect=10, sock_read=self._watch_timeout_s + 30)
        connector = aiohttp.TCPConnector(ssl=self._access.ssl_context())
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while True:
                try:
                    if self._resource_version is None:
                        await self._list(session)
                        await reporter.report(self._backends())
                    await self._watch(session, reporter)
                    delay = self._retry_initial_s
                except ResourceVersionGone as exc:
                    log.info("EndpointSlice watch expired (%s); re-listing", exc)
                    if self._resource_version is None:
                        # Gone during a list (an expired continue token): back off a little.
                        await asyncio.sleep(delay)
                    self._resource_version = None
                except (aiohttp.ClientError, asyncio.TimeoutError, KubernetesAPIError, ValueError) as exc:
                    log.warning("EndpointSlice discovery failed, retrying in %.1f s: %s", delay, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._retry_max_s)

    async def _get(self, session: aiohttp.ClientSession, params: dict[str, str]) -> aiohttp.ClientResponse:
        url = f"{self._collection_url}?{urlencode(params)}"
        response = await session.get(url, headers=self._access.headers())
        if response.status != 200:
            body = await response.text()
            response.release()
            try:
                status = Status.model_validate_json(body)
                message = f"{status.reason}: {status.message}"
            except ValidationError:
                message = body[:500]
            error = ResourceVersionGone if response.status == 410 else KubernetesAPIError
            raise error(response.status, message)
        return response

    async def _list(self, session: aiohttp.ClientSession) -> None:
        """Replace the known slices with a fresh (paginated) list."""
        slices: dict[str, frozenset[str]] = {}
        params = {"labelSelector": self._selector, "limit": str(self._page_size)}
        while True:
            response = await self._get(session, params)
            async with response:
                page = EndpointSliceList.model_validate_json(await response.read())
            for endpoint_slice in page.items:
                slices[endpoint_slice.metadata.name] = slice_backend_urls(endpoint_slice, self._port)
            if not page.metadata.continue_:
                break
            params["continue"] = page.metadata.continue_
        self._slices = slices
        self._resource_version = page.metadata.resource_version
        log.info("listed %d EndpointSlices (%s) at resourceVersion %s", len(slices), self._selector, self._resource_version)

    async def _watch(self, session: aiohttp.ClientSession, reporter: _Reporter) -> None:
        """Follow changes from the current resourceVersion until the server ends the stream."""
        assert self._resource_version is not None
        params = {
            "labelSelector": self._selector,
            "watch": "1",
            "resourceVersion": self._resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self._watch_timeout_s),
        }
        response = await self._get(session, params)
        async with response:
            buffer = b""
            # Events are JSON objects one a line; a slice can exceed aiohttp's line limit,
            # so lines are split here rather than with readline().
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._apply(WatchEvent.model_validate_json(line))
                await reporter.report(self._backends())

    def _apply(self, event: WatchEvent) -> None:
        if event.type == "ERROR":
            status = Status.model_validate(event.object)
            error = ResourceVersionGone if status.code == 410 else KubernetesAPIError
            raise error(status.code, f"{status.reason}: {status.message}")
        if event.type == "BOOKMARK":
            self._resource_version = ObjectMeta.model_validate(event.object.get("metadata", {})).resource_version
            return
        endpoint_slice = EndpointSlice.model_validate(event.object)
        name = endpoint_slice.metadata.name
        if event.type == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = slice_backend_urls(endpoint_slice, self._port)
        self._resource_version = endpoint_slice.metadata.resource_version or self._resource_version


# --------------------------------------------------------------------------- factory


def build_discovery(settings: Settings) -> BackendSource:
    """The backend source that ``settings.discovery`` names."""
    if settings.discovery == "file":
        assert settings.backends_file is not None  # Settings validation guarantees it
        return FileDiscovery(settings.backends_file)
    if settings.discovery == "k8s":
        access = KubernetesAccess.in_cluster(settings.k8s_api_url)
        return KubernetesDiscovery(access, settings.k8s_namespace, settings.k8s_selector, settings.k8s_port)
    return StaticDiscovery([backend.url for backend in settings.backends])


__all__ = [
    "BackendSource",
    "BackendsFileError",
    "EndpointSlice",
    "FileDiscovery",
    "KubernetesAccess",
    "KubernetesAPIError",
    "KubernetesDiscovery",
    "OnChange",
    "ResourceVersionGone",
    "StaticDiscovery",
    "build_discovery",
    "normalize_backend_url",
    "parse_backends_file",
    "slice_backend_urls",
]
