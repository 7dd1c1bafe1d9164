"""A real Prometheus in the loop: the dashboard's PromQL and the alert rules, as shipped.

Prometheus is Debian's ``prometheus`` package (it ships ``promtool``); when it is missing,
the tier installs it with apt-get (as root) or skips, saying why. Then:

* ``promtool check rules`` and ``promtool test rules`` on ``deploy/prometheus/`` (every
  alert has unit tests there);
* a Prometheus (own temporary data directory, loopback port, 1 s scrapes and rule
  evaluation) scrapes a router in precise mode and two simulated engines under traffic
  from the ``openai`` client; every expression of ``deploy/grafana/kvroute.json`` is
  evaluated through Prometheus's HTTP API with the template variables resolved as
  Grafana resolves them, and must parse and return series; the alert rules, loaded into
  the same Prometheus, must evaluate without error on the real series.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_dashboard import all_panels, dashboard
from tests.paths import REPO
from tests.servers import RouterServer, SimServer, wait_until

pytestmark = pytest.mark.prometheus

ROOT = REPO
RULES = ROOT / "deploy" / "prometheus" / "kvroute-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "kvroute-alerts.test.yml"
COMPOSE_DIR = ROOT / "deploy" / "compose"
# Grafana's $__rate_interval is at least four scrape intervals; 1 s scrapes here.
RATE_INTERVAL = "10s"
# Seconds of traffic Prometheus must have scraped before the dashboard is evaluated.
TRAFFIC_S = 8.0


# --- the binaries -----------------------------------------------------------------------
@dataclass(frozen=True)
class PrometheusTools:
    prometheus: str
    promtool: str


def find_tools() -> PrometheusTools | None:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    return PrometheusTools(prometheus, promtool) if prometheus and promtool else None


def apt_install_prometheus() -> str:
    """Install Debian's prometheus package; returns apt's output (for the skip reason)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:  # a stale package list: refresh it once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600, check=False)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def tools() -> PrometheusTools:
    found = find_tools()
    if found is not None:
        return found
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.skip(
            "Prometheus is not installed and cannot be: installing it needs apt-get as root "
            "(apt-get install prometheus)"
        )
    output = apt_install_prometheus()
    found = find_tools()
    if found is None:
        last = output.strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"apt-get install prometheus did not provide prometheus and promtool: {last[0]}")
    return found


# --- promtool ---------------------------------------------------------------------------
def promtool(tools: PrometheusTools, *args: str) -> str:
    result = subprocess.run([tools.promtool, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert result.returncode == 0, f"promtool {' '.join(args)} failed:\n{result.stdout}{result.stderr}"
    return result.stdout


def test_alert_rules_are_valid(tools: PrometheusTools) -> None:
    output = promtool(tools, "check", "rules", str(RULES))
    assert "SUCCESS" in output


def test_alert_rule_unit_tests_pass_and_cover_every_alert(tools: PrometheusTools) -> None:
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert alerts == tested, f"alerts without a test: {sorted(alerts - tested)}; unknown: {sorted(tested - alerts)}"
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert fired == alerts, f"alerts never expected to fire: {sorted(alerts - fired)}"
    output = promtool(tools, "test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in output


def test_the_compose_prometheus_loads_the_alert_rules(tools: PrometheusTools, tmp_path: Path) -> None:
    """deploy/compose/prometheus.yml is a valid configuration whose rule files are the
    shipped rules, mounted by docker-compose.yml where it looks for them."""
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    service = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())["services"]["prometheus"]
    mounts = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = (COMPOSE_DIR / source).resolve()
    assert config["rule_files"], "the Compose Prometheus loads no rules"
    assert [mounts.get(path) for path in config["rule_files"]] == [RULES]
    # As the container sees it: the same configuration with the mounted files in place.
    config["rule_files"] = [str(mounts[path]) for path in config["rule_files"]]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    output = promtool(tools, "check", "config", str(checked))
    assert "SUCCESS" in output and f"{RULES}" in output, output


# --- a running Prometheus -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def host_port(url: str) -> str:
    return url.split("://", 1)[1]


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns ``data``, or raises with Prometheus's error message."""
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


class PromQLError(Exception):
    """Prometheus refused a query."""


def prometheus_config(router: RouterServer, engines: list[SimServer]) -> dict[str, Any]:
    """As deploy/compose/prometheus.yml, with these targets and 1 s intervals."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "kvroute", "static_configs": [{"targets": [host_port(router.url)]}]},
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [host_port(engine.url)], "labels": {"backend": engine.url}} for engine in engines
                ],
            },
        ],
    }


@pytest.fixture
def start_prometheus(tools: PrometheusTools, tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], Prometheus]]:
    started: list[Prometheus] = []

    def start(config: dict[str, Any]) -> Prometheus:
        config_file = tmp_path / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config))
        promtool(tools, "check", "config", str(config_file))
        port = free_port()
        log = tmp_path / "prometheus.log"
        process = subprocess.Popen(
            [
                tools.prometheus,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        server = Prometheus(f"http://127.0.0.1:{port}", process, log)
        started.append(server)

        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited:\n{server.log_tail()}"
            try:
                return httpx.get(server.url + "/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=60, interval=0.2)
        return server

    yield start
    for server in started:
        server.process.terminate()
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


# --- traffic ------------------------------------------------------------------------------
class Traffic:
    """Multi-turn chats through the router with the openai client, streamed and not, until stopped."""

    def __init__(self, router: RouterServer) -> None:
        self._client = router.client()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prometheus-traffic", daemon=True)
        self.requests = 0
        self.errors: list[str] = []

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        system = {"role": "system", "content": "You are a terse assistant for the kvroute test fleet. " * 8}
        histories: list[list[dict[str, str]]] = [[system] for _ in range(8)]
        turn = 0
        while not self._stop.is_set():
            session = turn % len(histories)
            history = histories[session]
            history.append({"role": "user", "content": f"Question {turn}: what happened in step {turn}?"})
            try:
                answer = self._ask(history, user=f"user-{session}", stream=turn % 2 == 0)
                history.append({"role": "assistant", "content": answer})
            except Exception as error:
                self.errors.append(repr(error))
                history.pop()
            turn += 1
            self.requests += 1

    def _ask(self, messages: list[dict[str, str]], *, user: str, stream: bool) -> str:
        """One turn; ``user`` is the session key (the A/B split keeps a session on one policy)."""
        create = self._client.chat.completions.create
        if not stream:
            response = create(model="sim", messages=messages, max_tokens=8, user=user)
            return response.choices[0].message.content or ""
        chunks = create(model="sim", messages=messages, max_tokens=8, user=user, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


# --- the dashboard's queries ---------------------------------------------------------------
@dataclass(frozen=True)
class Query:
    where: str  # panel title and legend, or the template variable
    expr: str


def panel_queries() -> list[Query]:
    return [
        Query(f"{panel['title']} [{target.get('legendFormat', '')}]", target["expr"])
        for panel in all_panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def events_applied(router: RouterServer) -> dict[str, bool]:
    """Per backend, whether the router applied events from its KV-event stream (the
    event-stream panels' counters are exported, as zeros, even when no event ever came)."""
    text = httpx.get(router.url + "/metrics", timeout=30).text
    return {
        sample.labels["backend"]: sample.value > 0
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvroute_kv_events_total" and sample.labels.get("event") == "events"
    }


def query_variables() -> list[dict[str, Any]]:
    """The dashboard's template variables of type query."""
    return [variable for variable in dashboard()["templating"]["list"] if variable["type"] == "query"]


def variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def resolve_variable(prometheus: Prometheus, query: str, start: float, end: float) -> list[str]:
    """Values of ``label_values(metric, label)``, fetched as Grafana fetches them."""
    match = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", query)
    assert match, f"not a label_values query: {query}"
    metric, label = match.groups()
    return sorted(prometheus.api(f"label/{label}/values", **{"match[]": metric, "start": start, "end": end}))


def regex_of(values: list[str]) -> str:
    """A multi-value variable as Grafana puts it in a PromQL regex matcher: escaped, alternated."""
    alternatives = "|".join(re.escape(value).replace("\\", "\\\\") for value in values)
    return f"({alternatives})"


def substitute(expr: str, values: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"unresolved variable ${name} in {expr}"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


@dataclass
class Evaluation:
    """What a set of dashboard queries gave under one choice of variable values."""

    selection: str
    failures: list[str]
    empty: list[str]


def evaluate(
    prometheus: Prometheus, queries: list[Query], values: dict[str, str], selection: str, start: float, end: float
) -> Evaluation:
    """Run every query as Grafana's panels do (a range query, 1 s steps over [start, end])."""
    result = Evaluation(selection, [], [])
    for query in queries:
        expr = substitute(query.expr, values | {"__rate_interval": RATE_INTERVAL})
        try:
            data = prometheus.api("query_range", query=expr, start=start, end=end, step="1s")
        except PromQLError as error:
            result.failures.append(f"{query.where} ({selection}): {error}\n    {expr}")
            continue
        if not data["result"]:
            result.empty.append(f"{query.where} ({selection}): {expr}")
    return result


def test_every_dashboard_query_runs_on_a_real_prometheus(
    sim_engines: Callable[..., list[SimServer]],
    router_server: Callable[..., RouterServer],
    start_prometheus: Callable[[dict[str, Any]], Prometheus],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Precise mode (KV events over ZeroMQ on loopback), so the event-stream panels have data too;
    # the events come after the answers, as vLLM's often do, so the lag panel has data.
    event_ports = [(free_port(), free_port()) for _ in range(2)]
    engines = [
        sim_engines(
            1,
            kv_events_endpoint=f"tcp://*:{events}",  # bound (a concrete address would connect)
            kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
            kv_events_delay_s=0.05,
        )[0]
        for events, replay in event_ports
    ]
    # An A/B split, so the per-policy panels and the policy variable have two values, and
    # round robin's half of the sessions reaches both engines whatever cache_aware prefers.
    router = router_server(
        policy="cache_aware",
        ab="cache_aware=50,round_robin=50",
        kv_events=True,
        engine_scrape_interval_s=0.5,
        backends=[
            {
                "url": engine.url,
                "kv_events_endpoint": f"tcp://127.0.0.1:{events}",
                "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
            for engine, (events, replay) in zip(engines, event_ports, strict=True)
        ],
    )
    prometheus = start_prometheus(prometheus_config(router, engines))
    with Traffic(router) as traffic:
        wait_until(lambda: targets_up(prometheus) == 3, timeout=30, interval=0.2)
        time.sleep(TRAFFIC_S)
        end = time.time()
        start = end - TRAFFIC_S
        variables = query_variables()
        resolved = {
            variable["name"]: resolve_variable(prometheus, variable_query(variable), start, end)
            for variable in variables
        }
        queries = panel_queries()
        # Every value ticked, and "All" (the dashboard's default: the variable's allValue).
        evaluations = [
            evaluate(
                prometheus,
                queries,
                {name: regex_of(found) for name, found in resolved.items()},
                "each value",
                start,
                end,
            ),
            evaluate(
                prometheus,
                queries,
                {variable["name"]: variable["allValue"] for variable in variables},
                "All",
                start,
                end,
            ),
        ]
        rules = rule_problems(prometheus)
        applied = events_applied(router)
    assert not traffic.errors, traffic.errors[:5]
    assert applied == dict.fromkeys(sorted(engine.url for engine in engines), True), (
        f"KV events applied per backend: {applied}"
    )
    failures = [line for evaluation in evaluations for line in evaluation.failures]
    empty = [line for evaluation in evaluations for line in evaluation.empty]
    with capsys.disabled():
        print(
            f"\n{len(queries)} dashboard expressions x {len(evaluations)} variable selections evaluated on "
            f"Prometheus after {traffic.requests} requests; template variables: "
            + ", ".join(f"{name}={len(found)} values" for name, found in resolved.items())
            + f"; rejected: {len(failures)}, empty: {len(empty)}"
            + "".join(f"\n  empty: {line}" for line in empty)
        )
    assert resolved == {
        "backend": sorted(engine.url for engine in engines),
        "policy": ["cache_aware", "round_robin"],
    }, "template variables"
    assert not failures, "Prometheus rejected dashboard queries:\n" + "\n".join(failures)
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    assert not rules, "alert rules that failed on real series:\n" + "\n".join(rules)


def targets_up(prometheus: Prometheus) -> int:
    data = prometheus.api("query", query="sum(up)")
    return int(float(data["result"][0]["value"][1])) if data["result"] else 0


def rule_problems(prometheus: Prometheus) -> list[str]:
    """Rules Prometheus could not evaluate (or has not yet), with its error."""
    groups = prometheus.api("rules")["groups"]
    names = {rule["name"] for group in groups for rule in group["rules"]}
    shipped = {
        rule.get("alert") or rule.get("record")
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    problems = [f"{name}: not loaded" for name in sorted(shipped - names)]
    problems += [
        f"{rule['name']}: {rule['health']} {rule.get('lastError', '')}"
        for group in groups
        for rule in group["rules"]
        if rule["health"] != "ok"
    ]
    return problems
