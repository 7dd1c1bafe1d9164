"""The Helm chart (deploy/helm/kvroute) rendered by Helm's own engine, and its rendered defaults.

No ``helm`` binary installs from the registries this project reaches (Debian has no helm
package; no PyPI package ships the CLI for Python 3.11), so the chart is rendered by
``helm-python-sdk``: a ctypes binding of Helm's Go SDK (``helm_c_version``/``helm_sdk_version``
name it), which runs the same template engine, values merge and ``values.schema.json``
check as ``helm template``. ``deploy/k8s/kvroute.yaml`` is the chart's rendered defaults,
for ``kubectl apply`` without Helm; regenerate it with ``python3 -m tests.deploy.chart_render``.

Imported by tests as ``from chart_render import ...`` (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from tests.paths import REPO

ROOT = REPO
CHART_DIR = ROOT / "deploy" / "helm" / "kvroute"
DEFAULTS_FILE = ROOT / "deploy" / "k8s" / "kvroute.yaml"
RELEASE = "kvroute"
NAMESPACE = "llm"

#: The static manifest names the replicas' exchange secret rather than carrying one: a
#: secret committed to a repository is no secret (the chart itself makes a random one).
PEER_SECRET = f"{RELEASE}-peer-secret"
STATIC_VALUES: dict[str, Any] = {"peers": {"existingSecret": PEER_SECRET}}

DEFAULTS_HEADER = f"""\
# GENERATED from deploy/helm/kvroute with the chart's default values (do not edit; change the
# chart and run `python3 -m tests.deploy.chart_render`). The same objects as
#   helm template {RELEASE} deploy/helm/kvroute --namespace {NAMESPACE} --set peers.existingSecret={PEER_SECRET}
# for clusters without Helm; the replicas' exchange secret comes first:
#   kubectl create namespace {NAMESPACE}
#   kubectl -n {NAMESPACE} create secret generic {PEER_SECRET} --from-literal=secret="$(head -c 36 /dev/urandom | base64)"
#   kubectl apply -f deploy/k8s/kvroute.yaml
"""


def render(values: dict[str, Any] | None = None, namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text, as ``helm template`` produces them (raises on a schema error)."""
    import helm_python as helm

    with helm.Chart.load(str(CHART_DIR)) as chart:
        return chart.render(values or {}, name=RELEASE, namespace=namespace)


def manifest(rendered: dict[str, str]) -> str:
    """One multi-document stream in ``helm template``'s layout (``# Source:`` per document)."""
    parts = []
    for path in sorted(rendered):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for document in rendered[path].split("\n---"):
            if yaml.safe_load(document):
                parts.append(f"---\n# Source: {path}\n{document.strip(chr(10))}\n")
    return "".join(parts)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object the render holds."""
    return [document for document in yaml.safe_load_all(manifest(rendered)) if document]


def rendered_defaults() -> str:
    return DEFAULTS_HEADER + manifest(render(STATIC_VALUES))


if __name__ == "__main__":
    DEFAULTS_FILE.write_text(rendered_defaults())
    print(f"wrote {DEFAULTS_FILE.relative_to(ROOT)}", file=sys.stderr)
