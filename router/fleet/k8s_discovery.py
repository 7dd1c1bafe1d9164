"""Backends from Kubernetes EndpointSlices, through ``kubernetes_asyncio`` (``kvroute[k8s]``).

Why ``kubernetes_asyncio`` rather than ``lightkube``: it rides on aiohttp, the HTTP client
kvroute already runs on, so the extra adds no second HTTP stack; its ``Watch`` requests and
follows BOOKMARK events (the resume point advances while nothing in the selection changes)
and raises 410 Gone as ``ApiException(status=410)``, whether it comes as the HTTP status or
as an ERROR event; its kubeconfig loader speaks exec credential plugins, OIDC and client
certificates, and its in-cluster loader re-reads the rotating service-account token. lightkube
(httpx) sends no ``allowWatchBookmarks`` and, on 410, restarts its watch without a version,
which replays the objects that exist but never reports those deleted in the gap.

Neither library keeps a cache that re-lists by itself (client-go's reflector): the loop below
is that reflector. List (paginated), then watch from the list's resourceVersion; a watch that
ends normally (the server's ``timeoutSeconds``) resumes from the last version seen, BOOKMARKs
included; 410 re-lists; anything else retries with exponential backoff from where it was,
keeping the current backends meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration, DiscoveryV1Api, V1EndpointSlice
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import ConfigException, load_kube_config
from kubernetes_asyncio.config.incluster_config import InClusterConfigLoader
from kubernetes_asyncio.watch import Watch

from kvroute.router.fleet.discovery import ChangeReporter, OnChange

log = logging.getLogger("kvroute.discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
GONE = 410
LIST_TIMEOUT_S = 60


@dataclass(frozen=True, slots=True)
class KubernetesAccess:
    """Where the API server is and how to authenticate.

    Inside a pod (``KUBERNETES_SERVICE_HOST`` set and a service-account token mounted): the
    service account. Otherwise a kubeconfig (``$KUBECONFIG``, else ``~/.kube/config``, its
    current context unless ``context`` names one), with whatever auth it holds. ``api_url``
    replaces the server URL either way; with neither a pod nor a kubeconfig it is used
    without credentials (``kubectl proxy``).
    """

    api_url: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    service_account_dir: Path = SERVICE_ACCOUNT_DIR
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)

    @property
    def in_cluster(self) -> bool:
        return bool(self.environ.get("KUBERNETES_SERVICE_HOST")) and (self.service_account_dir / "token").is_file()

    @property
    def kubeconfig_paths(self) -> str:
        """The kubeconfig file list (``:``-separated, as ``$KUBECONFIG``), read at call time."""
        return self.kubeconfig or self.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())

    def _has_kubeconfig(self) -> bool:
        return any(Path(path).expanduser().is_file() for path in self.kubeconfig_paths.split(os.pathsep) if path)

    async def configuration(self) -> Configuration:
        """A client configuration; raises ``ConfigException`` when no way in is found."""
        configuration = Configuration()
        if self.in_cluster:
            InClusterConfigLoader(
                token_filename=str(self.service_account_dir / "token"),
                cert_filename=str(self.service_account_dir / "ca.crt"),
                environ=dict(self.environ),
            ).load_and_set(configuration)
        elif self._has_kubeconfig() or self.api_url is None:
            await load_kube_config(
                config_file=self.kubeconfig_paths,
                context=self.context,
                client_configuration=configuration,
                persist_config=False,
            )
        if self.api_url is not None:
            configuration.host = self.api_url.rstrip("/")
        return configuration


# --------------------------------------------------------------------------- slices


def _host_for_url(address: str, address_type: str | None) -> str:
    if address_type == "IPv6" or (address_type != "FQDN" and ":" in address):
        return f"[{ipaddress.IPv6Address(address).compressed}]"
    return address


def _slice_port(endpoint_slice: V1EndpointSlice, port_override: int | None) -> int | None:
    """The serving port: the configured one, else the slice's ``http`` port, else its first."""
    if port_override is not None:
        return port_override
    tcp_ports = [port for port in endpoint_slice.ports or [] if port.port and (port.protocol or "TCP") == "TCP"]
    for port in tcp_ports:
        if port.name == "http":
            return int(port.port)
    return int(tcp_ports[0].port) if tcp_ports else None


def _is_ready(endpoint: Any) -> bool:
    # The API reference: a nil ``ready`` is an unknown state that consumers should read as
    # ready; terminating endpoints are reported with ready=false.
    return endpoint.conditions is None or endpoint.conditions.ready is not False


def slice_backend_urls(
    endpoint_slice: V1EndpointSlice, port_override: int | None, scheme: str = "http"
) -> frozenset[str]:
    """Backend URLs of one EndpointSlice's ready endpoints."""
    port = _slice_port(endpoint_slice, port_override)
    if port is None:
        if endpoint_slice.endpoints:
            log.warning(
                "EndpointSlice %s has no TCP port and --k8s-port is not set; ignored", endpoint_slice.metadata.name
            )
        return frozenset()
    urls = set()
    for endpoint in endpoint_slice.endpoints or []:
        if _is_ready(endpoint) and endpoint.addresses:
            # Addresses of one endpoint are fungible (API reference): the first one will do.
            host = _host_for_url(endpoint.addresses[0], endpoint_slice.address_type)
            urls.add(f"{scheme}://{host}:{port}")
    return frozenset(urls)


# --------------------------------------------------------------------------- discovery


class KubernetesDiscovery:
    """Backends from the EndpointSlices that match a label selector, list-then-watch.

    Each slice contributes its ready endpoints' first address with the serving port; the
    backend set is the union over slices.
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

    def _backends(self) -> frozenset[str]:
        return frozenset().union(*self._slices.values())

    async def run(self, on_change: OnChange) -> None:
        reporter = ChangeReporter(on_change)
        delay = self._retry_initial_s
        while True:
            try:
                async with ApiClient(await self._access.configuration()) as client:
                    api = DiscoveryV1Api(client)
                    while True:
                        await self._sync(api, reporter)
                        delay = self._retry_initial_s
            except (TimeoutError, ApiException, ConfigException, aiohttp.ClientError, ValueError, OSError) as exc:
                log.warning("EndpointSlice discovery failed, retrying in %.1f s: %s", delay, _describe(exc))
            except Exception:
                # Discovery must outlive a surprise (a library change, an odd object): a dead
                # task would pin the pool to its last backends without a word.
                log.exception("EndpointSlice discovery failed unexpectedly, retrying in %.1f s", delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._retry_max_s)

    async def _sync(self, api: DiscoveryV1Api, reporter: ChangeReporter) -> None:
        """List if no version is held, then watch until the server ends the stream."""
        if self._resource_version is None:
            # 410 here is an expired continue token: it backs off like any other error.
            await self._list(api)
            await reporter.report(self._backends())
        try:
            await self._watch(api, reporter)
        except ApiException as exc:
            if exc.status != GONE:
                raise
            log.info("EndpointSlice watch expired (%s); re-listing", _describe(exc))
            self._resource_version = None

    async def _list(self, api: DiscoveryV1Api) -> None:
        """Replace the known slices with a fresh (paginated) list."""
        slices: dict[str, frozenset[str]] = {}
        token: str | None = None
        while True:
            page = await api.list_namespaced_endpoint_slice(
                self._namespace,
                label_selector=self._selector,
                limit=self._page_size,
                _continue=token,  # type: ignore[arg-type]  # the generated client's default is None
                _request_timeout=LIST_TIMEOUT_S,
            )
            for endpoint_slice in page.items:
                slices[endpoint_slice.metadata.name] = slice_backend_urls(endpoint_slice, self._port)
            token = page.metadata._continue
            if not token:
                break
        self._slices = slices
        self._resource_version = page.metadata.resource_version
        log.info(
            "listed %d EndpointSlices (%s) at resourceVersion %s", len(slices), self._selector, self._resource_version
        )

    async def _watch(self, api: DiscoveryV1Api, reporter: ChangeReporter) -> None:
        """Follow changes from the held version until the server ends the stream."""
        async with Watch() as watch:
            stream = watch.stream(
                api.list_namespaced_endpoint_slice,
                self._namespace,
                label_selector=self._selector,
                resource_version=self._resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout_s,
                # The server ends the stream at timeoutSeconds; one still open well past that
                # is dead.
                _request_timeout=self._watch_timeout_s + 30,
            )
            async for event in stream:
                self._apply(event["type"], event["object"])
                # The library tracks the version of every event, BOOKMARKs included.
                self._resource_version = watch.resource_version or self._resource_version
                await reporter.report(self._backends())

    def _apply(self, kind: str, obj: Any) -> None:
        if kind == "BOOKMARK":
            return
        name = obj.metadata.name
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = slice_backend_urls(obj, self._port)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"Kubernetes API answered {exc.status}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


__all__ = ["KubernetesAccess", "KubernetesDiscovery", "slice_backend_urls"]
