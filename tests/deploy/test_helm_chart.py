"""The Helm chart: rendered by Helm's engine, validated against the Kubernetes OpenAPI schemas.

Rendering goes through Helm's Go SDK (see ``chart_render.py`` for why not the ``helm``
binary); every rendered built-in object is validated by ``kubernetes-validate`` (the
Kubernetes OpenAPI schemas, offline, strict: unknown fields fail) for the oldest and the
newest Kubernetes release the chart supports. The Prometheus Operator's ServiceMonitor is a
CRD with no schema in that package: its fields are checked here against what the operator
reads (selector, port name, path); the PrometheusRule must carry exactly the rule groups of
deploy/prometheus/kvroute-alerts.yml, which promtool checks in tests/deploy/test_prometheus.py.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (test extra) is not installed")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (test extra) is not installed"
)

from kvroute.router.config import POLICY_NAMES, load_settings  # noqa: E402
from kvroute.router.peer_key import PeerKey  # noqa: E402
from tests.deploy.chart_render import CHART_DIR, DEFAULTS_FILE, NAMESPACE, objects, render, rendered_defaults  # noqa: E402

# autoscaling/v2, policy/v1 and discovery.k8s.io/v1 are all GA well before the oldest.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

EVERYTHING = {
    "autoscaling": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    "vllm": {"enabled": True},
    "extraEnv": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "extraConfig": {"max_concurrency": 256},
    "imagePullSecrets": [{"name": "registry"}],
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "router", "effect": "NoSchedule"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
}
STATIC = {"discovery": {"enabled": False}, "backends": ["http://10.0.0.11:8000", "http://10.0.0.12:8000"]}


def by_kind(items: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        kinds.setdefault(item["kind"], []).append(item)
    return kinds


def one(items: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (item,) = by_kind(items)[kind]
    return item


def router_deployment(items: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [item for item in by_kind(items)["Deployment"] if item["metadata"]["name"] == "kvroute"]
    return deployment


def router_settings(items: list[dict[str, Any]], tmp_path: Path) -> Any:
    """The ConfigMap's config.yaml, loaded as ``kvroute serve --config`` loads it, with the
    peers' secrets mounted as the pod mounts them (under ``tmp_path``)."""
    config = yaml.safe_load(one(items, "ConfigMap")["data"]["config.yaml"])
    for setting in ("peer_secret_file", "peer_accepted_secret_file"):
        if setting in config:
            config[setting] = str(mounted_peer_secret(items, config[setting], tmp_path))
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    return load_settings(None, config_file)


def mounted_peer_secret(items: list[dict[str, Any]], path: str, tmp_path: Path) -> Path:
    """The file the router container sees at ``path``: a key of the chart's Secret, or a
    stand-in for one it names but does not create (``peers.existingSecret``: the key's name,
    repeated to 48 characters)."""
    spec = router_deployment(items)["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    (mount,) = [mount for mount in container["volumeMounts"] if path.startswith(mount["mountPath"] + "/")]
    (volume,) = [volume for volume in spec["volumes"] if volume["name"] == mount["name"]]
    (item,) = [item for item in volume["secret"]["items"] if path == f"{mount['mountPath']}/{item['path']}"]
    secrets = [
        secret
        for secret in by_kind(items).get("Secret", [])
        if secret["metadata"]["name"] == volume["secret"]["secretName"]
    ]
    value = base64.b64decode(secrets[0]["data"][item["key"]]).decode() if secrets else (item["key"] * 48)[:48]
    mounted = tmp_path / f"peer-{item['path']}"
    mounted.write_text(value)
    return mounted


def test_chart_lints_clean() -> None:
    result = helm.lint(str(CHART_DIR))
    assert result["errors"] == []
    # Severity 1 is INFO (e.g. "icon is recommended"); nothing at WARNING or above.
    assert [message for message in result["messages"] if message["severity"] > 1] == []


@pytest.mark.parametrize("values", [{}, EVERYTHING, STATIC], ids=["defaults", "everything", "static-backends"])
def test_rendered_objects_match_kubernetes_schemas(values: dict[str, Any]) -> None:
    items = objects(render(values))
    for item in items:
        assert item["metadata"]["namespace"] == NAMESPACE, item["metadata"]["name"]
        if item["kind"] in CRD_KINDS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(item, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{item['kind']}/{item['metadata']['name']} against Kubernetes {version}: {exc.message}")
    assert {"ConfigMap", "Deployment", "Service", "ServiceAccount"} <= {item["kind"] for item in items}


def test_defaults_discover_with_least_privilege(tmp_path: Path) -> None:
    items = objects(render())
    kinds = by_kind(items)
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds, "discovery reads one namespace only"
    role = one(items, "Role")
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    ]
    binding = one(items, "RoleBinding")
    account = one(items, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]

    pod = router_deployment(items)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] and pod["automountServiceAccountToken"] is True
    (container,) = pod["containers"]
    env = {entry["name"]: entry for entry in container["env"]}
    # Discovery watches the namespace the pod runs in, the one the Role covers.
    assert env["KVROUTE_K8S_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    settings = router_settings(items, tmp_path)
    assert settings.discovery == "k8s" and settings.k8s_selector == "app=vllm" and settings.k8s_port == 8000
    assert settings.kv_events and settings.policy == "cache_aware"


def test_static_backends_need_no_api_access(tmp_path: Path) -> None:
    items = objects(render(STATIC))
    kinds = by_kind(items)
    assert "Role" not in kinds and "RoleBinding" not in kinds
    assert one(items, "ServiceAccount")["automountServiceAccountToken"] is False
    assert router_deployment(items)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    settings = router_settings(items, tmp_path)
    assert settings.discovery == "static"
    assert [backend.url for backend in settings.backends] == STATIC["backends"]


def test_read_only_root_with_numba_cache_on_empty_dir() -> None:
    pod = router_deployment(objects(render()))["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    env = {entry["name"]: entry.get("value") for entry in container["env"]}

    def writable_volume(path: str) -> str:
        """The emptyDir volume that holds ``path`` (every write must land on one)."""
        (mount,) = [mount for mount in mounts if path == mount or path.startswith(mount.rstrip("/") + "/")]
        assert "emptyDir" in volumes[mounts[mount]], f"{path} is on {volumes[mounts[mount]]}"
        return mounts[mount]

    assert writable_volume(env["NUMBA_CACHE_DIR"]) == "cache"
    writable_volume(env["HF_HOME"])
    writable_volume("/tmp")
    # The init container seeds the emptyDir from the image's build-time cache (the
    # Dockerfile's NUMBA_CACHE_DIR) into the directory the router then uses.
    dockerfile = (CHART_DIR.parents[2] / "Dockerfile").read_text()
    (seed,) = pod["initContainers"]
    command = " ".join(seed["command"])
    assert "NUMBA_CACHE_DIR=/var/cache/kvroute/numba" in dockerfile and "'/var/cache/kvroute/numba'" in command
    assert f"'{env['NUMBA_CACHE_DIR']}'" in command
    assert seed["securityContext"]["readOnlyRootFilesystem"] is True
    assert {mount["name"] for mount in seed["volumeMounts"]} == {"cache"}


def test_replicas_pdb_and_cpu_autoscaling() -> None:
    items = objects(render({"replicaCount": 3}))
    deployment = router_deployment(items)
    assert deployment["spec"]["replicas"] == 3
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    budget = one(items, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "HorizontalPodAutoscaler" not in by_kind(items)

    items = objects(
        render(
            {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5, "targetCPUUtilizationPercentage": 60}}
        )
    )
    deployment = router_deployment(items)
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    scaler = one(items, "HorizontalPodAutoscaler")
    assert scaler["apiVersion"] == "autoscaling/v2"
    assert scaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (scaler["spec"]["minReplicas"], scaler["spec"]["maxReplicas"]) == (2, 5)
    assert scaler["spec"]["metrics"] == [
        {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 60}}}
    ]
    # Without CPU requests the HPA has no utilization to compute.
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"]

    assert "PodDisruptionBudget" not in by_kind(objects(render({"podDisruptionBudget": {"enabled": False}})))


def test_replicas_find_each_other_through_a_headless_service(tmp_path: Path) -> None:
    """By default every replica publishes on the peers port and resolves a headless Service
    over the router pods (not-ready ones too) to find the others, as they come and go."""
    items = objects(render())
    settings = router_settings(items, tmp_path)
    deployment = router_deployment(items)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    peers = next(item for item in by_kind(items)["Service"] if item["metadata"]["name"] == "kvroute-peers")
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert peers["spec"]["selector"].items() <= pod_labels.items()
    ((service_port,),) = [peers["spec"]["ports"]]
    assert service_port["targetPort"] == "peers" and ports["peers"] == service_port["port"] == 5600
    assert settings.peer_bind == "tcp://*:5600"  # IPv6 and IPv4
    assert settings.peers_dns == f"kvroute-peers.{NAMESPACE}.svc:5600"
    # Only router pods reach the exchange; every client reaches HTTP.
    policy = one(items, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    open_to_all, routers_only = policy["spec"]["ingress"]
    assert "from" not in open_to_all and open_to_all["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert routers_only["ports"] == [{"port": "peers", "protocol": "TCP"}]
    assert [peer["podSelector"]["matchLabels"] for peer in routers_only["from"]] == [
        policy["spec"]["podSelector"]["matchLabels"]
    ]
    assert "NetworkPolicy" not in by_kind(objects(render({"peers": {"networkPolicy": False}})))

    # A pod of several workers takes part as one router: its supervisor relays them on peer_bind.
    settings = router_settings(objects(render({"extraConfig": {"workers": 2}})), tmp_path)
    assert settings.workers == 2 and settings.peer_bind == "tcp://*:5600"
    items = objects(render({"peers": {"enabled": False}}))
    settings = router_settings(items, tmp_path)
    assert settings.peer_bind is None and settings.peers_dns is None
    assert [item["metadata"]["name"] for item in by_kind(items)["Service"]] == ["kvroute"]
    assert "NetworkPolicy" not in by_kind(items)
    (container,) = router_deployment(items)["spec"]["template"]["spec"]["containers"]
    assert [port["name"] for port in container["ports"]] == ["http"]


def test_replicas_share_a_random_exchange_secret(tmp_path: Path) -> None:
    """By default the chart makes a random 48-character secret every replica mounts
    (``peer_secret_file``), readable by the pod's non-root group only; ``existingSecret``
    names the operator's own instead, and ``auth: false`` leaves the exchange plain."""
    items = objects(render())
    settings = router_settings(items, tmp_path)
    (secret,) = by_kind(items)["Secret"]
    value = base64.b64decode(secret["data"]["secret"]).decode()
    assert len(value) == 48 and value.isalnum() and secret["metadata"]["name"] == "kvroute-peer-secret"
    assert PeerKey.read(settings.peer_secret_file) == PeerKey.from_text(value)
    spec = router_deployment(items)["spec"]["template"]["spec"]
    (volume,) = [volume for volume in spec["volumes"] if "secret" in volume]
    assert volume["secret"]["defaultMode"] == 0o440 and spec["securityContext"]["fsGroup"] == 10001
    assert value != base64.b64decode(one(objects(render()), "Secret")["data"]["secret"]).decode()  # no fixed value

    items = objects(render({"peers": {"existingSecret": "fleet-peers"}}))
    assert "Secret" not in by_kind(items)
    (volume,) = [
        volume for volume in router_deployment(items)["spec"]["template"]["spec"]["volumes"] if "secret" in volume
    ]
    assert volume["secret"]["secretName"] == "fleet-peers"
    assert router_settings(items, tmp_path).peer_secret_file is not None

    items = objects(render({"peers": {"auth": False}}))
    assert "Secret" not in by_kind(items) and router_settings(items, tmp_path).peer_secret_file is None
    assert router_settings(items, tmp_path).peer_accepted_secret_file is None
    assert not [
        volume for volume in router_deployment(items)["spec"]["template"]["spec"]["volumes"] if "secret" in volume
    ]


@pytest.mark.parametrize(
    ("secret_key", "accepted_key"), [("secret", "next"), ("next", "secret"), ("next", "")], ids=["add", "swap", "drop"]
)
def test_a_secret_rotation_is_three_value_changes(secret_key: str, accepted_key: str, tmp_path: Path) -> None:
    """``peers.secretKey`` and ``peers.acceptedSecretKey`` name the keys of one Secret the
    pods mount as ``peer_secret_file`` and ``peer_accepted_secret_file``."""
    values = {"peers": {"existingSecret": "fleet-peers", "secretKey": secret_key, "acceptedSecretKey": accepted_key}}
    settings = router_settings(objects(render(values)), tmp_path)
    assert settings.peer_key() == PeerKey.from_text((secret_key * 48)[:48])
    expected = PeerKey.from_text((accepted_key * 48)[:48]) if accepted_key else None
    assert settings.peer_accepted_key() == expected


def selects(selector: dict[str, Any], item: dict[str, Any]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions In/NotIn) selects ``item``."""
    labels = item["metadata"]["labels"]
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        inside = labels.get(expression["key"]) in expression["values"]
        if inside != {"In": True, "NotIn": False}[expression["operator"]]:
            return False
    return True


def test_service_monitor_on_and_off() -> None:
    assert "ServiceMonitor" not in by_kind(objects(render()))
    items = objects(render(EVERYTHING))
    monitors = {item["metadata"]["name"]: item for item in by_kind(items)["ServiceMonitor"]}
    services = {item["metadata"]["name"]: item for item in by_kind(items)["Service"]}
    for name, monitor in monitors.items():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
        # The operator scrapes the Services its selector matches, at the port of that name.
        (service,) = [service for service in services.values() if selects(monitor["spec"]["selector"], service)]
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}, name
    engines = monitors["kvroute-engines"]["spec"]["endpoints"][0]
    assert engines["relabelings"] == [
        {"sourceLabels": ["__address__"], "targetLabel": "backend", "replacement": "http://$1"}
    ]


def test_prometheus_rule_is_the_alert_rules_file() -> None:
    assert "PrometheusRule" not in by_kind(objects(render()))
    rule = one(objects(render(EVERYTHING)), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts_file = CHART_DIR.parents[1] / "prometheus" / "kvroute-alerts.yml"
    groups = yaml.safe_load(alerts_file.read_text())["groups"]
    assert rule["spec"]["groups"] == groups
    # Prometheus's own {{ $labels.x }} templates reach it untouched by Helm's templating.
    assert any(
        "{{ $labels." in rule_["annotations"]["summary"]
        for group in groups
        for rule_ in group["rules"]
        if "alert" in rule_
    )


def test_bundled_vllm_fleet_is_what_the_router_discovers(tmp_path: Path) -> None:
    items = objects(render({"vllm": {"enabled": True}}))
    settings = router_settings(items, tmp_path)
    assert settings.tokenizer == "Qwen/Qwen2.5-0.5B-Instruct", "the routing key is what the engine caches"
    engine_service = one([item for item in items if item["metadata"]["name"] == "kvroute-vllm"], "Service")
    # The EndpointSlice controller copies the Service's labels onto its slices.
    key, value = settings.k8s_selector.split("=")
    assert engine_service["metadata"]["labels"][key] == value
    ports = {port["name"]: port["port"] for port in engine_service["spec"]["ports"]}
    assert ports["http"] == settings.k8s_port
    assert (ports["kv-events"], ports["kv-replay"]) == (settings.kv_events_port, settings.kv_events_replay_port)
    (engine,) = [item for item in by_kind(items)["Deployment"] if item["metadata"]["name"] == "kvroute-vllm"]
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    (events_arg,) = [arg for arg in args if arg.startswith("--kv-events-config=")]
    events = json.loads(events_arg.split("=", 1)[1])
    assert events["endpoint"] == f"tcp://*:{settings.kv_events_port}"
    assert events["replay_endpoint"] == f"tcp://*:{settings.kv_events_replay_port}"


def test_config_values_reach_kvroute(tmp_path: Path) -> None:
    items = objects(
        render(
            {
                "policy": "power_of_two",
                "precise": {"enabled": False},
                "tokenizer": "/models/tok",
                "discovery": {"enabled": True, "selector": "kubernetes.io/service-name=engines", "port": None},
                "extraConfig": {"max_concurrency": 64, "policy": "sticky"},
            }
        )
    )
    settings = router_settings(items, tmp_path)
    assert settings.policy == "sticky", "extraConfig wins over the named keys"
    assert settings.max_concurrency == 64 and settings.tokenizer == "/models/tok" and not settings.kv_events
    assert settings.k8s_selector == "kubernetes.io/service-name=engines" and settings.k8s_port is None
    # A changed config changes the pod template, so the Deployment rolls.
    checksums = {
        router_deployment(objects(render(values)))["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        for values in ({}, {"policy": "sticky"})
    }
    assert len(checksums) == 2


def test_values_schema_rejects_what_kvroute_would_refuse() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert tuple(schema["properties"]["policy"]["enum"]) == POLICY_NAMES
    for values in (
        {"policy": "fastest"},
        {"discovery": {"enabled": False}},
        {"backends": ["10.0.0.1:8000"]},
        {"replicaCount": 0},
    ):
        with pytest.raises(helm.HelmError):
            render(values)


def test_rendered_defaults_file_is_the_chart() -> None:
    assert DEFAULTS_FILE.read_text() == rendered_defaults(), (
        "deploy/k8s/kvroute.yaml differs from the chart's render: run python3 -m tests.deploy.chart_render"
    )
    assert [path.name for path in DEFAULTS_FILE.parent.iterdir()] == ["kvroute.yaml"], "one source of truth"
    assert yaml.safe_load_all(DEFAULTS_FILE.read_text())
