"""Kubernetes discovery (``kvroute.router.fleet.k8s_discovery``, the ``kvroute[k8s]`` extra) against a fake API server.

The fake below is a real aiohttp server answering the EndpointSlice list and watch requests
that kubernetes_asyncio sends (``watch=True``, ``allowWatchBookmarks=True``, ``limit``,
``continue``, ``resourceVersion``, ``timeoutSeconds``) with the response shapes of the
Kubernetes API reference (discovery.k8s.io/v1): an ``EndpointSliceList`` with
``metadata.resourceVersion`` / ``continue``, watch streams of ``{"type", "object"}`` lines,
BOOKMARK events, and 410 Gone both as an HTTP status and as an ERROR event carrying a
``Status`` object. The client reaches it the ways kvroute does in production: a kubeconfig
with a bearer token or an exec credential plugin, and the in-cluster service account over TLS.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
import json
import ssl
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from aiohttp import web

from kvroute.router.config import load_settings
from kvroute.router.fleet.discovery import build_discovery
from tests.router.fleet.discovery_helpers import Changes, eventually, running, stop
from tests.servers import wait_until

k8s = pytest.importorskip(
    "kvroute.router.fleet.k8s_discovery", reason="the kvroute[k8s] extra (kubernetes_asyncio) is not installed"
)
from kubernetes_asyncio.client import ApiClient  # noqa: E402  (after the skip: the extra may be absent)

NAMESPACE = "llm"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-service-account-token"
COLLECTION = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def endpoint(ip: str, pod: str, ready: bool | None = True, terminating: bool = False) -> dict[str, Any]:
    """One ``endpoints[]`` entry as the EndpointSlice controller writes it."""
    conditions: dict[str, Any] = {"serving": ready if not terminating else True, "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {
        "addresses": [ip],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": pod, "uid": f"uid-{pod}"},
        "nodeName": "node-1",
        "zone": "zone-a",
    }


def endpoint_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    *,
    port: int = 8000,
    service: str = "vllm",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice object as the API returns it."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "generateName": f"{service}-",
            "namespace": NAMESPACE,
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": "2026-01-05T10:00:00Z",
            "labels": labels
            if labels is not None
            else {
                "app": "vllm",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": service,
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": service,
                    "uid": f"uid-svc-{service}",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "protocol": "TCP", "port": port}],
    }


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class FakeKubeAPI:
    """Just enough of kube-apiserver's EndpointSlice list/watch for the discovery client."""

    resource_version: int = 1000
    slices: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    oldest_watchable: int = 0
    watchers: list[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=list)
    requests: list[dict[str, str]] = field(default_factory=list)
    auth_headers: list[str] = field(default_factory=list)
    fail_next: list[tuple[int, str]] = field(default_factory=list)  # (HTTP status, reason)
    peers: list[bool] = field(default_factory=list)  # per request: did it come over TLS

    @property
    def lists(self) -> int:
        return sum(1 for params in self.requests if "watch" not in params)

    @property
    def watches(self) -> list[dict[str, str]]:
        return [params for params in self.requests if "watch" in params]

    def _bump(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    def put(self, obj: dict[str, Any], deliver: bool = True) -> None:
        """Create or update a slice; ``deliver=False`` loses the event (history compacted)."""
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.slices else "ADDED"
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._bump()
        self.slices[name] = obj
        self._emit({"type": kind, "object": obj}, deliver)

    def delete(self, name: str) -> None:
        obj = copy.deepcopy(self.slices.pop(name))
        obj["metadata"]["resourceVersion"] = self._bump()
        self._emit({"type": "DELETED", "object": obj}, True)

    def bookmark(self) -> str:
        version = self._bump()
        event = {
            "type": "BOOKMARK",
            "object": {
                "kind": "EndpointSlice",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": version},
            },
        }
        for queue in self.watchers:
            queue.put_nowait(event)
        return version

    def _emit(self, event: dict[str, Any], deliver: bool) -> None:
        if not deliver:
            # The event is lost to watchers and to history: only a re-list can see it.
            self.oldest_watchable = self.resource_version + 1
            return
        self.history.append((self.resource_version, event))
        for queue in self.watchers:
            queue.put_nowait(event)

    def expire_watches(self) -> None:
        """What the API server sends when a watcher fell too far behind: ERROR 410 Expired."""
        message = f"too old resource version: {self.oldest_watchable - 1} ({self.resource_version})"
        for queue in self.watchers:
            queue.put_nowait({"type": "ERROR", "object": status_object(410, "Expired", message)})

    def end_watches(self) -> None:
        """End every watch stream normally, as the server does at timeoutSeconds."""
        for queue in self.watchers:
            queue.put_nowait(None)

    def _selected(self, selector: str) -> list[dict[str, Any]]:
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        return [
            obj
            for obj in self.slices.values()
            if all(obj["metadata"]["labels"].get(key) == value for key, value in wanted.items())
        ]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        params = dict(request.query)
        self.requests.append(params)
        self.peers.append(request.transport.get_extra_info("sslcontext") is not None if request.transport else False)
        self.auth_headers.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response(status_object(401, "Unauthorized", "Unauthorized"), status=401)
        if self.fail_next:
            code, reason = self.fail_next.pop(0)
            message = (
                (
                    'endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:llm:kvroute" '
                    'cannot list resource "endpointslices"'
                )
                if code == 403
                else reason
            )
            return web.json_response(status_object(code, reason, message), status=code)
        if params.get("watch", "").lower() in ("1", "true"):
            return await self._watch(request, params)
        return self._list(params)

    def _list(self, params: dict[str, str]) -> web.Response:
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for obj in self._selected(params.get("labelSelector", ""))
        ]
        start = int(params.get("continue", "0"))
        limit = int(params.get("limit", "0")) or len(items) or 1
        page = items[start : start + limit]
        metadata: dict[str, Any] = {"resourceVersion": str(self.resource_version)}
        if start + limit < len(items):
            metadata["continue"] = str(start + limit)
            metadata["remainingItemCount"] = len(items) - start - limit
        return web.json_response(
            {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": metadata, "items": page}
        )

    async def _watch(self, request: web.Request, params: dict[str, str]) -> web.StreamResponse:
        since = int(params["resourceVersion"])
        if since + 1 < self.oldest_watchable:
            message = f"too old resource version: {since} ({self.resource_version})"
            return web.json_response(status_object(410, "Expired", message), status=410)
        selector = params.get("labelSelector", "")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        for version, event in self.history:
            if version > since:
                queue.put_nowait(event)
        self.watchers.append(queue)
        try:
            while (event := await queue.get()) is not None:
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    labels = event["object"]["metadata"]["labels"]
                    wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
                    if any(labels.get(key) != value for key, value in wanted.items()):
                        continue
                await response.write(json.dumps(event).encode() + b"\n")
                if event["type"] == "ERROR":
                    break
        finally:
            self.watchers.remove(queue)
        await response.write_eof()
        return response


async def serve(api: FakeKubeAPI, ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get(COLLECTION, api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"


@pytest.fixture
async def kube_api() -> AsyncIterator[tuple[FakeKubeAPI, str]]:
    api = FakeKubeAPI()
    runner, url = await serve(api)
    yield api, url
    api.end_watches()
    await runner.cleanup()


def write_kubeconfig(directory: Path, server: str, user: dict[str, Any]) -> Path:
    """A kubeconfig as kubectl writes it: one cluster, one user, one current context."""
    path = directory / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": user}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": NAMESPACE}}],
            }
        )
    )
    return path


def discovery(access: Any, **kwargs: Any) -> Any:
    return k8s.KubernetesDiscovery(access, NAMESPACE, "app=vllm", retry_initial_s=0.05, retry_max_s=0.2, **kwargs)


def token_access(url: str, tmp_path: Path) -> Any:
    """Outside a cluster, through a kubeconfig holding a bearer token."""
    return k8s.KubernetesAccess(kubeconfig=str(write_kubeconfig(tmp_path, url, {"token": TOKEN})), environ={})


# --------------------------------------------------------------------------- watching


async def test_pods_becoming_ready_unready_and_leaving(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(
        endpoint_slice(
            "vllm-7xk2p",
            [
                endpoint("10.244.1.5", "vllm-0"),
                endpoint("10.244.2.7", "vllm-1"),
                endpoint("10.244.3.9", "vllm-2", ready=False),  # still loading the model
                endpoint("10.244.4.2", "vllm-3", ready=False, terminating=True),
            ],
        )
    )
    api.put(endpoint_slice("other-abcde", [endpoint("10.244.9.9", "other-0")], labels={"app": "other"}))
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path)), changes)
    try:
        await changes.until({"http://10.244.1.5:8000", "http://10.244.2.7:8000"})
        assert api.requests[0]["labelSelector"] == "app=vllm"
        assert set(api.auth_headers) == {f"Bearer {TOKEN}"}

        # vllm-2 becomes ready, a new slice brings vllm-4.
        api.put(
            endpoint_slice(
                "vllm-7xk2p",
                [
                    endpoint("10.244.1.5", "vllm-0"),
                    endpoint("10.244.2.7", "vllm-1"),
                    endpoint("10.244.3.9", "vllm-2"),
                ],
            )
        )
        api.put(endpoint_slice("vllm-q9z4m", [endpoint("10.244.5.1", "vllm-4")]))
        await changes.until(
            {"http://10.244.1.5:8000", "http://10.244.2.7:8000", "http://10.244.3.9:8000", "http://10.244.5.1:8000"}
        )

        # vllm-0 is terminating (ready false), vllm-1 fails its readiness probe, then the
        # second slice goes away.
        api.put(
            endpoint_slice(
                "vllm-7xk2p",
                [
                    endpoint("10.244.1.5", "vllm-0", ready=False, terminating=True),
                    endpoint("10.244.2.7", "vllm-1", ready=False),
                    endpoint("10.244.3.9", "vllm-2"),
                ],
            )
        )
        api.delete("vllm-q9z4m")
        await changes.until({"http://10.244.3.9:8000"})
        # vllm-1 passes its probe again.
        api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.2.7", "vllm-1"), endpoint("10.244.3.9", "vllm-2")]))
        await changes.until({"http://10.244.2.7:8000", "http://10.244.3.9:8000"})
        assert api.lists == 1, "plain changes must arrive over the watch, without re-listing"
        assert api.watches[0]["resourceVersion"] and api.watches[0]["labelSelector"] == "app=vllm"
        # Each reported set differs from the one before it (no duplicate notifications).
        assert all(a != b for a, b in zip(changes.calls, changes.calls[1:]))
    finally:
        await stop(task)


async def test_error_event_410_relists(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path)), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        await eventually(lambda: len(api.watchers) == 1, "the watch to start")
        # A change the watch never delivers, then the server expires the watch.
        api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.6", "vllm-0b")]), deliver=False)
        api.expire_watches()
        await changes.until({"http://10.244.1.6:8000"})
        assert api.lists == 2
        await eventually(lambda: len(api.watches) == 2, "the second watch")
        assert api.watches[-1]["resourceVersion"] == str(api.resource_version)
    finally:
        await stop(task)


async def test_http_410_on_watch_relists(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path)), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        await eventually(lambda: len(api.watchers) == 1, "the watch to start")
        # History is compacted past the client's version while its stream is down, and a
        # slice is deleted in the gap: only a re-list can see both.
        api.put(endpoint_slice("vllm-q9z4m", [endpoint("10.244.5.1", "vllm-4")]), deliver=False)
        api.slices.pop("vllm-7xk2p")
        api.end_watches()
        await changes.until({"http://10.244.5.1:8000"})
        assert api.lists == 2
    finally:
        await stop(task)


async def test_watch_resumes_from_bookmark_without_relist(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path), watch_timeout_s=120), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        await eventually(lambda: len(api.watchers) == 1, "the watch to start")
        assert api.watches[0]["allowWatchBookmarks"].lower() == "true"
        assert api.watches[0]["timeoutSeconds"] == "120"
        version = api.bookmark()
        api.end_watches()  # the server's timeoutSeconds
        await eventually(lambda: len(api.watches) == 2, "the watch to resume")
        assert api.watches[1]["resourceVersion"] == version, "a BOOKMARK advances the resume point"
        api.put(endpoint_slice("vllm-q9z4m", [endpoint("10.244.5.1", "vllm-4")]))
        await changes.until({"http://10.244.1.5:8000", "http://10.244.5.1:8000"})
        assert api.lists == 1
    finally:
        await stop(task)


async def test_service_scaled_to_zero(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    """A Service without pods has a slice with ``endpoints: null``, listed and watched alike
    (clients generated before Kubernetes 1.33 refused to decode it)."""
    api, url = kube_api
    api.put({**endpoint_slice("idle-x1", [], service="idle"), "endpoints": None})
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path)), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        api.put({**endpoint_slice("vllm-7xk2p", []), "endpoints": None})
        await changes.until(set())
        api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.9", "vllm-5")]))
        await changes.until({"http://10.244.1.9:8000"})
        assert api.lists == 1
    finally:
        await stop(task)


async def test_api_errors_retry_and_keep_backends(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    api.fail_next = [(403, "Forbidden"), (500, "InternalError")]
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path)), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        assert api.lists == 3
        assert changes.calls == [{"http://10.244.1.5:8000"}], "no empty set is reported while the API fails"
        # A watch that fails (500) resumes from the held version: no re-list, no change.
        await eventually(lambda: len(api.watchers) == 1, "the watch to start")
        api.fail_next = [(500, "InternalError")]
        api.end_watches()
        await eventually(lambda: len(api.watchers) == 1 and len(api.watches) == 3, "the watch after the failure")
        assert api.lists == 3 and changes.calls == [{"http://10.244.1.5:8000"}]
    finally:
        await stop(task)


async def test_paginated_list(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    for index in range(5):
        api.put(endpoint_slice(f"vllm-{index:05d}", [endpoint(f"10.244.0.{index + 1}", f"vllm-{index}")]))
    changes = Changes()
    task = await running(discovery(token_access(url, tmp_path), page_size=2), changes)
    try:
        await changes.until({f"http://10.244.0.{index + 1}:8000" for index in range(5)})
        list_requests = [params for params in api.requests if "watch" not in params]
        assert [params.get("continue") for params in list_requests] == [None, "2", "4"]
        assert {params["limit"] for params in list_requests} == {"2"}
        assert changes.calls[0] == {f"http://10.244.0.{index + 1}:8000" for index in range(5)}
    finally:
        await stop(task)


# --------------------------------------------------------------------------- ways in


async def test_kubeconfig_exec_plugin(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    """A client.authentication.k8s.io exec plugin (as EKS, GKE and OIDC logins use) supplies the token."""
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": TOKEN}}
    plugin = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": sys.executable,
        "args": ["-c", f"print({json.dumps(json.dumps(credential))})"],
        "interactiveMode": "Never",
    }
    access = k8s.KubernetesAccess(kubeconfig=str(write_kubeconfig(tmp_path, url, {"exec": plugin})), environ={})
    changes = Changes()
    task = await running(discovery(access), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        assert api.auth_headers[0] == f"Bearer {TOKEN}"
    finally:
        await stop(task)


async def test_kubeconfig_from_environment(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    """``$KUBECONFIG`` is read when discovery starts, and may list several files (merged)."""
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    path = write_kubeconfig(tmp_path, url, {"token": TOKEN})
    access = k8s.KubernetesAccess(environ={"KUBECONFIG": f"{tmp_path / 'absent.yaml'}:{path}"})
    changes = Changes()
    task = await running(discovery(access), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
    finally:
        await stop(task)


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A CA-less self-signed certificate for 127.0.0.1, as the in-cluster CA bundle to trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "apiserver.crt", directory / "apiserver.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def test_in_cluster_service_account_over_tls(tmp_path: Path) -> None:
    """In a pod: KUBERNETES_SERVICE_HOST/PORT, the mounted token, and the CA bundle verifying TLS."""
    cert_path, key_path = self_signed_certificate(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert_path, key_path)
    api = FakeKubeAPI()
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    runner, url = await serve(api, server_tls)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)  # the kubelet's projected token has no newline
    (account / "ca.crt").write_bytes(cert_path.read_bytes())
    (account / "namespace").write_text(NAMESPACE)
    port = url.rsplit(":", 1)[1]
    access = k8s.KubernetesAccess(
        service_account_dir=account, environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    )
    assert access.in_cluster
    changes = Changes()
    task = await running(discovery(access), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        assert api.auth_headers[0] == f"Bearer {TOKEN}"
        assert all(api.peers), "every request came over TLS"
    finally:
        await stop(task)
        api.end_watches()
        await runner.cleanup()


async def test_missing_credentials_are_reported_not_fatal(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    # No pod, no kubeconfig: only the API URL (as through ``kubectl proxy``), no credentials.
    access = k8s.KubernetesAccess(api_url=url, kubeconfig=str(tmp_path / "absent"), environ={})
    changes = Changes()
    task = await running(discovery(access), changes)
    try:
        await eventually(lambda: api.lists >= 2, "retries after 401")
        assert changes.calls == []
        assert api.auth_headers[0] == ""
    finally:
        await stop(task)


async def test_build_discovery_from_settings(
    kube_api: tuple[FakeKubeAPI, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")], labels={"app": "engine"}))
    # The router's own process environment: a kubeconfig for the user running it.
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, "https://unused.invalid", {"token": TOKEN})))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    source = build_discovery(
        load_settings(
            {
                "discovery": "k8s",
                "k8s_api_url": url,
                "k8s_namespace": NAMESPACE,
                "k8s_selector": "app=engine",
                "k8s_port": 8001,
            }
        )
    )
    assert isinstance(source, k8s.KubernetesDiscovery)
    changes = Changes()
    task = await running(source, changes)
    try:
        # k8s_api_url replaces the kubeconfig's server; its credentials still apply.
        await changes.until({"http://10.244.1.5:8001"})
        assert api.requests[0]["labelSelector"] == "app=engine"
        assert api.auth_headers[0] == f"Bearer {TOKEN}"
    finally:
        await stop(task)


# --------------------------------------------------------------------------- the router


def test_router_routes_to_the_pods_discovery_reports(
    server_loop: Any, sim_engines: Any, router_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The whole path: a router with ``discovery: k8s`` serves requests on the engines whose
    endpoints are ready, and follows them becoming ready and unready."""
    engines = sim_engines(2)
    ports = [int(engine.url.rsplit(":", 1)[1]) for engine in engines]
    api = FakeKubeAPI()
    runner, url = server_loop.run(serve(api))
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path, url, {"token": TOKEN})))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    def publish(name: str, port: int, ready: bool) -> None:
        # One Service per engine (their ports differ); the API state lives on the server loop.
        server_loop.call(lambda: api.put(endpoint_slice(name, [endpoint("127.0.0.1", name, ready=ready)], port=port)))

    def served_by(count: int = 4) -> set[str]:
        client = router.client()
        return {
            client.chat.completions.with_raw_response.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            ).headers["x-kvroute-backend"]
            for _ in range(count)
        }

    def routable() -> set[str]:
        return {backend.url for backend in router.state.pool if backend.healthy and not backend.draining}

    try:
        publish("engine-0", ports[0], ready=True)
        publish("engine-1", ports[1], ready=False)  # still loading its model
        router = router_server(discovery="k8s", k8s_namespace=NAMESPACE, k8s_selector="app=vllm")
        wait_until(lambda: routable() == {engines[0].url})
        assert served_by() == {engines[0].url}

        publish("engine-1", ports[1], ready=True)
        wait_until(lambda: routable() == {engines[0].url, engines[1].url})
        assert served_by() == {engines[0].url, engines[1].url}

        publish("engine-0", ports[0], ready=False)  # terminating, or failing its readiness probe
        wait_until(lambda: routable() == {engines[1].url})
        assert served_by() == {engines[1].url}
        assert api.lists == 1
    finally:
        server_loop.call(api.end_watches)
        server_loop.run(runner.cleanup())


# --------------------------------------------------------------------------- slices


async def as_slice(obj: dict[str, Any]) -> Any:
    """The library's V1EndpointSlice for an API object, decoded as its watch decodes events."""
    async with ApiClient() as client:
        return client.deserialize(SimpleNamespace(data=json.dumps(obj)), "V1EndpointSlice")


async def test_slice_urls_ports_and_address_types() -> None:
    ipv4 = await as_slice(
        endpoint_slice(
            "a",
            [
                endpoint("10.0.0.1", "p0"),
                endpoint("10.0.0.2", "p1", ready=None),
                endpoint("10.0.0.3", "p2", ready=False),
            ],
            port=8080,
        )
    )
    assert k8s.slice_backend_urls(ipv4, None) == {"http://10.0.0.1:8080", "http://10.0.0.2:8080"}
    assert k8s.slice_backend_urls(ipv4, 9000) == {"http://10.0.0.1:9000", "http://10.0.0.2:9000"}

    ipv6 = await as_slice({**endpoint_slice("b", [endpoint("fd00:10:244::5", "p0")]), "addressType": "IPv6"})
    assert k8s.slice_backend_urls(ipv6, None) == {"http://[fd00:10:244::5]:8000"}

    named = endpoint_slice("c", [endpoint("10.0.0.4", "p0")])
    named["ports"] = [
        {"name": "metrics", "protocol": "TCP", "port": 9090},
        {"name": "http", "protocol": "TCP", "port": 8000},
    ]
    assert k8s.slice_backend_urls(await as_slice(named), None) == {"http://10.0.0.4:8000"}

    portless = {**endpoint_slice("d", [endpoint("10.0.0.5", "p0")]), "ports": None}
    assert k8s.slice_backend_urls(await as_slice(portless), None) == frozenset()
    # A Service with no pods: the API writes ``endpoints: null``.
    no_endpoints = {**endpoint_slice("e", []), "endpoints": None}
    assert k8s.slice_backend_urls(await as_slice(no_endpoints), None) == frozenset()
