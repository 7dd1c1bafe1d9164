"""Backend discovery against a local Kubernetes-API look-alike and real files.

The fake API server below answers the EndpointSlice list and watch requests with the
response shapes of the Kubernetes API reference (discovery.k8s.io/v1): an
``EndpointSliceList`` with ``metadata.resourceVersion`` / ``continue``, watch streams of
``{"type": ..., "object": ...}`` lines, BOOKMARK events, and 410 Gone both as an HTTP
status and as an ERROR event carrying a ``Status`` object.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from router.config import load_settings
from router.discovery import (
    EndpointSlice,
    FileDiscovery,
    KubernetesAccess,
    KubernetesDiscovery,
    StaticDiscovery,
    build_discovery,
    parse_backends_file,
    slice_backend_urls,
)

NAMESPACE = "llm"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-service-account-token"
WAIT_S = 15.0


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


def endpoint_slice(name: str, endpoints: list[dict[str, Any]], *, port: int = 8000, service: str = "vllm",
                   labels: dict[str, str] | None = None) -> dict[str, Any]:
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
            "labels": labels if labels is not None else {
                "app": "vllm",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": service,
            },
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Service", "name": service, "uid": f"uid-svc-{service}",
                 "controller": True, "blockOwnerDeletion": True}
            ],
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "protocol": "TCP", "port": port}],
    }


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


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
        event = {"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                                "metadata": {"resourceVersion": version}}}
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
        return [obj for obj in self.slices.values()
                if all(obj["metadata"]["labels"].get(key) == value for key, value in wanted.items())]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        params = dict(request.query)
        self.requests.append(params)
        self.auth_headers.append(request.headers.get("Authorization", ""))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response(status_object(401, "Unauthorized", "Unauthorized"), status=401)
        if self.fail_next:
            code, reason = self.fail_next.pop(0)
            message = ('endpointslices.discovery.k8s.io is forbidden: User "system:serviceaccount:llm:kvroute" '
                       'cannot list resource "endpointslices"') if code == 403 else reason
            return web.json_response(status_object(code, reason, message), status=code)
        if params.get("watch") in ("1", "true"):
            return await self._watch(request, params)
        return self._list(params)

    def _list(self, params: dict[str, str]) -> web.Response:
        items = [{k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
                 for obj in self._selected(params.get("labelSelector", ""))]
        start = int(params.get("continue", "0"))
        limit = int(params.get("limit", "0")) or len(items) or 1
        page = items[start:start + limit]
        metadata: dict[str, Any] = {"resourceVersion": str(self.resource_version)}
        if start + limit < len(items):
            metadata["continue"] = str(start + limit)
            metadata["remainingItemCount"] = len(items) - start - limit
        return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                  "metadata": metadata, "items": page})

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


@pytest.fixture
async def kube_api() -> AsyncIterator[tuple[FakeKubeAPI, str]]:
    api = FakeKubeAPI()
    app = web.Application()
    app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices", api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield api, f"http://127.0.0.1:{port}"
    api.end_watches()
    await runner.cleanup()


@pytest.fixture
def service_account(tmp_path: Path) -> Path:
    directory = tmp_path / "serviceaccount"
    directory.mkdir()
    (directory / "token").write_text(TOKEN + "\n")
    (directory / "namespace").write_text(NAMESPACE)
    return directory


class Changes:
    """Collects ``on_change`` calls and waits for a wanted backend set."""

    def __init__(self) -> None:
        self.calls: list[set[str]] = []
        self._event = asyncio.Event()

    async def __call__(self, urls: set[str]) -> None:
        self.calls.append(urls)
        self._event.set()

    async def until(self, wanted: set[str]) -> None:
        async def wait() -> None:
            while not self.calls or self.calls[-1] != wanted:
                self._event.clear()
                await self._event.wait()

        try:
            await asyncio.wait_for(wait(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"backends never became {sorted(wanted)}; reported: {self.calls}")


async def running(source: Any, changes: Changes) -> asyncio.Task[None]:
    return asyncio.create_task(source.run(changes))


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def eventually(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def discovery(url: str, service_account: Path, **kwargs: Any) -> KubernetesDiscovery:
    access = KubernetesAccess.in_cluster(url, service_account_dir=service_account)
    return KubernetesDiscovery(access, NAMESPACE, "app=vllm", retry_initial_s=0.05, retry_max_s=0.2, **kwargs)


# --------------------------------------------------------------------------- Kubernetes


async def test_pods_coming_and_going(kube_api: tuple[FakeKubeAPI, str], service_account: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [
        endpoint("10.244.1.5", "vllm-0"),
        endpoint("10.244.2.7", "vllm-1"),
        endpoint("10.244.3.9", "vllm-2", ready=False),  # still loading the model
        endpoint("10.244.4.2", "vllm-3", ready=False, terminating=True),
    ]))
    api.put(endpoint_slice("other-abcde", [endpoint("10.244.9.9", "other-0")], labels={"app": "other"}))
    changes = Changes()
    task = await running(discovery(url, service_account), changes)
    try:
        await changes.until({"http://10.244.1.5:8000", "http://10.244.2.7:8000"})
        assert api.requests[0]["labelSelector"] == "app=vllm"
        assert set(api.auth_headers) == {f"Bearer {TOKEN}"}

        # vllm-2 becomes ready, a new slice brings vllm-4.
        api.put(endpoint_slice("vllm-7xk2p", [
            endpoint("10.244.1.5", "vllm-0"), endpoint("10.244.2.7", "vllm-1"), endpoint("10.244.3.9", "vllm-2"),
        ]))
        api.put(endpoint_slice("vllm-q9z4m", [endpoint("10.244.5.1", "vllm-4")]))
        await changes.until({"http://10.244.1.5:8000", "http://10.244.2.7:8000",
                             "http://10.244.3.9:8000", "http://10.244.5.1:8000"})

        # vllm-0 is terminating (ready false), then the second slice goes away.
        api.put(endpoint_slice("vllm-7xk2p", [
            endpoint("10.244.1.5", "vllm-0", ready=False, terminating=True),
            endpoint("10.244.2.7", "vllm-1"), endpoint("10.244.3.9", "vllm-2"),
        ]))
        api.delete("vllm-q9z4m")
        await changes.until({"http://10.244.2.7:8000", "http://10.244.3.9:8000"})
        assert api.lists == 1, "plain changes must arrive over the watch, without re-listing"
        # Each reported set differs from the one before it (no duplicate notifications).
        assert all(a != b for a, b in zip(changes.calls, changes.calls[1:]))
    finally:
        await stop(task)


async def test_error_event_410_relists(kube_api: tuple[FakeKubeAPI, str], service_account: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(url, service_account), changes)
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


async def test_http_410_on_watch_relists(kube_api: tuple[FakeKubeAPI, str], service_account: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(url, service_account), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        await eventually(lambda: len(api.watchers) == 1, "the watch to start")
        # History is compacted past the client's version while its stream is down.
        api.put(endpoint_slice("vllm-q9z4m", [endpoint("10.244.5.1", "vllm-4")]), deliver=False)
        api.end_watches()
        await changes.until({"http://10.244.1.5:8000", "http://10.244.5.1:8000"})
        assert api.lists == 2
    finally:
        await stop(task)


async def test_watch_resumes_without_relist(kube_api: tuple[FakeKubeAPI, str], service_account: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    changes = Changes()
    task = await running(discovery(url, service_account), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        await eventually(lambda: len(api.watchers) == 1, "the watch to start")
        version = api.bookmark()
        api.end_watches()  # the server's timeoutSeconds
        await eventually(lambda: len(api.watches) == 2, "the watch to resume")
        assert api.watches[1]["resourceVersion"] == version, "a BOOKMARK advances the resume point"
        assert api.watches[1]["allowWatchBookmarks"] == "true"
        api.put(endpoint_slice("vllm-q9z4m", [endpoint("10.244.5.1", "vllm-4")]))
        await changes.until({"http://10.244.1.5:8000", "http://10.244.5.1:8000"})
        assert api.lists == 1
    finally:
        await stop(task)


async def test_api_errors_retry_and_keep_backends(kube_api: tuple[FakeKubeAPI, str], service_account: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    api.fail_next = [(403, "Forbidden"), (500, "InternalError")]
    changes = Changes()
    task = await running(discovery(url, service_account), changes)
    try:
        await changes.until({"http://10.244.1.5:8000"})
        assert api.lists == 3
        assert changes.calls == [{"http://10.244.1.5:8000"}], "no empty set is reported while the API fails"
    finally:
        await stop(task)


async def test_paginated_list(kube_api: tuple[FakeKubeAPI, str], service_account: Path) -> None:
    api, url = kube_api
    for index in range(5):
        api.put(endpoint_slice(f"vllm-{index:05d}", [endpoint(f"10.244.0.{index + 1}", f"vllm-{index}")]))
    changes = Changes()
    task = await running(discovery(url, service_account, page_size=2), changes)
    try:
        await changes.until({f"http://10.244.0.{index + 1}:8000" for index in range(5)})
        list_requests = [params for params in api.requests if "watch" not in params]
        assert [params.get("continue") for params in list_requests] == [None, "2", "4"]
        assert changes.calls[0] == {f"http://10.244.0.{index + 1}:8000" for index in range(5)}
    finally:
        await stop(task)


async def test_missing_token_is_reported_not_fatal(kube_api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")]))
    empty = tmp_path / "no-serviceaccount"
    empty.mkdir()
    changes = Changes()
    task = await running(discovery(url, empty), changes)
    try:
        await eventually(lambda: api.lists >= 2, "retries after 401")
        assert changes.calls == []
        assert api.auth_headers[0] == ""
    finally:
        await stop(task)


def test_slice_urls_ports_and_address_types() -> None:
    ipv4 = EndpointSlice.model_validate(endpoint_slice("a", [
        endpoint("10.0.0.1", "p0"), endpoint("10.0.0.2", "p1", ready=None), endpoint("10.0.0.3", "p2", ready=False),
    ], port=8080))
    assert slice_backend_urls(ipv4, None) == {"http://10.0.0.1:8080", "http://10.0.0.2:8080"}
    assert slice_backend_urls(ipv4, 9000) == {"http://10.0.0.1:9000", "http://10.0.0.2:9000"}

    ipv6 = EndpointSlice.model_validate({**endpoint_slice("b", [endpoint("fd00:10:244::5", "p0")]), "addressType": "IPv6"})
    assert slice_backend_urls(ipv6, None) == {"http://[fd00:10:244::5]:8000"}

    named = endpoint_slice("c", [endpoint("10.0.0.4", "p0")])
    named["ports"] = [{"name": "metrics", "protocol": "TCP", "port": 9090},
                      {"name": "http", "protocol": "TCP", "port": 8000}]
    assert slice_backend_urls(EndpointSlice.model_validate(named), None) == {"http://10.0.0.4:8000"}

    portless = {**endpoint_slice("d", [endpoint("10.0.0.5", "p0")]), "ports": None}
    assert slice_backend_urls(EndpointSlice.model_validate(portless), None) == frozenset()
    no_endpoints = {**endpoint_slice("e", []), "endpoints": None}
    assert slice_backend_urls(EndpointSlice.model_validate(no_endpoints), None) == frozenset()


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


async def test_build_discovery_from_settings(tmp_path: Path, kube_api: tuple[FakeKubeAPI, str]) -> None:
    static = build_discovery(load_settings({"backends": ["http://127.0.0.1:8101/", "http://127.0.0.1:8102"]}))
    assert isinstance(static, StaticDiscovery)
    changes = Changes()
    await static.run(changes)
    assert changes.calls == [{"http://127.0.0.1:8101", "http://127.0.0.1:8102"}]

    backends_file = tmp_path / "b.txt"
    file_source = build_discovery(load_settings({"discovery": "file", "backends_file": str(backends_file)}))
    assert isinstance(file_source, FileDiscovery)

    api, url = kube_api
    api.put(endpoint_slice("vllm-7xk2p", [endpoint("10.244.1.5", "vllm-0")], labels={"app": "engine"}))
    k8s = build_discovery(load_settings({
        "discovery": "k8s", "k8s_api_url": url, "k8s_namespace": NAMESPACE,
        "k8s_selector": "app=engine", "k8s_port": 8001,
    }))
    assert isinstance(k8s, KubernetesDiscovery)
    task = await running(k8s, changes)
    try:
        # Outside a cluster there is no service-account token: the API answers 401.
        await eventually(lambda: api.lists >= 1, "the list request")
        assert api.requests[0]["labelSelector"] == "app=engine"
    finally:
        await stop(task)



# --------------------------------------------------------------------------- manifests


K8S_DIR = Path(__file__).resolve().parents[1] / "deploy" / "k8s"


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of deploy/k8s, keyed by (kind, name)."""
    objects = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document and "kind" in document and document["kind"] != "Kustomization":
                objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def test_k8s_manifests_grant_and_configure_discovery(tmp_path: Path) -> None:
    objects = manifests()
    role = objects[("Role", "kvroute-endpointslice-reader")]
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}
    binding = objects[("RoleBinding", "kvroute-endpointslice-reader")]
    assert binding["roleRef"]["name"] == "kvroute-endpointslice-reader"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvroute"}]

    router = objects[("Deployment", "kvroute")]
    assert router["spec"]["replicas"] >= 2
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kvroute"
    (container,) = pod["containers"]
    # Ready while some backend is healthy; alive while the process serves (an engine outage
    # takes routers out of the Service but does not restart them).
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"

    # The ConfigMap is a valid kvroute config whose selector picks the vLLM Service's slices.
    config_file = tmp_path / "config.yaml"
    config_file.write_text(objects[("ConfigMap", "kvroute")]["data"]["config.yaml"])
    settings = load_settings(None, config_file)
    assert settings.discovery == "k8s" and settings.kv_events
    vllm_service = objects[("Service", "vllm")]
    key, value = settings.k8s_selector.split("=")
    assert vllm_service["metadata"]["labels"][key] == value
    ports = {port["name"]: port["port"] for port in vllm_service["spec"]["ports"]}
    assert ports["http"] == settings.k8s_port
    assert ports["kv-events"] == settings.kv_events_port
    assert ports["kv-replay"] == settings.kv_events_replay_port

    engine = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]["containers"][0]
    args = engine["args"]
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    (events_arg,) = [arg for arg in args if arg.startswith("--kv-events-config=")]
    events = json.loads(events_arg.split("=", 1)[1])
    assert events["endpoint"] == f"tcp://*:{settings.kv_events_port}"
    assert events["replay_endpoint"] == f"tcp://*:{settings.kv_events_replay_port}"

    monitor = objects[("ServiceMonitor", "kvroute")]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["selector"]["matchLabels"] == objects[("Service", "kvroute")]["metadata"]["labels"]
    listed = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(path.name for path in K8S_DIR.glob("*.yaml") if path.name != "kustomization.yaml")
