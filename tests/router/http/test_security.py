"""Security: who gets in, how fast, what reaches the engines, and what never reaches the logs."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
from typing import Any

import httpx
import openai
import pytest

from kvroute.router.http.security import SecretRedactor, TokenBucketLimiter
from tests.helpers import assert_openai_error
from tests.servers import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the token bucket ---------------------------------------------------------------------
def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    clock = Clock()
    limiter = TokenBucketLimiter(rate=2.0, clock=clock)
    assert [limiter.take("a") for _ in range(2)] == [0.0, 0.0]  # burst: one second's worth
    wait = limiter.take("a")
    assert wait == pytest.approx(0.5)
    assert limiter.take("b") == 0.0, "buckets are per client"
    clock.now += 0.5
    assert limiter.take("a") == 0.0
    assert limiter.take("a") > 0
    clock.now += 100.0
    assert [limiter.take("a") for _ in range(3)][:2] == [0.0, 0.0], "an idle client gets only a full bucket"


def test_token_bucket_tracks_a_bounded_number_of_clients() -> None:
    limiter = TokenBucketLimiter(rate=1.0, max_keys=100, clock=Clock())
    for number in range(10_000):
        limiter.take(f"client-{number}")
    assert len(limiter) == 100


def test_a_slow_rate_still_allows_one_request() -> None:
    limiter = TokenBucketLimiter(rate=0.1, clock=Clock())
    assert limiter.take("a") == 0.0
    assert limiter.take("a") == pytest.approx(10.0)


# --- log redaction ------------------------------------------------------------------------
def _formatted(redactor: SecretRedactor, message: str, *args: Any, exc: BaseException | None = None) -> str:
    record = logging.LogRecord(
        "kvroute", logging.DEBUG, __file__, 1, message, args, (type(exc), exc, exc.__traceback__) if exc else None
    )
    assert redactor.filter(record)
    return logging.Formatter("%(message)s").format(record)


def test_redactor_blanks_secrets_tokens_and_url_credentials() -> None:
    redactor = SecretRedactor(["admin-s3cret-token", "sk-client-key-1", "x"])
    line = _formatted(
        redactor,
        "auth %s from %s to %s key=%s",
        "Bearer sk-unknown-token",
        "admin-s3cret-token",
        "http://user:pa55word@10.0.0.5:8000/v1",
        "sk-client-key-1",
    )
    for secret in ("sk-unknown-token", "admin-s3cret-token", "pa55word", "user:", "sk-client-key-1"):
        assert secret not in line, line
    assert "10.0.0.5:8000" in line and "***" in line
    assert _formatted(redactor, "the letter x stays") == "the letter x stays", "too short to be searched for"
    try:
        raise ValueError("api_key='sk-client-key-1' rejected")
    except ValueError as exc:
        text = _formatted(redactor, "failed", exc=exc)
    assert "Traceback" in text and "sk-client-key-1" not in text


def test_redactor_learns_secrets_added_later() -> None:
    redactor = SecretRedactor()
    redactor.add("engine-key-added-by-admin")
    assert "engine-key-added-by-admin" not in _formatted(redactor, "probe with %s", "engine-key-added-by-admin")


# --- through a running router ------------------------------------------------------------------
ADMIN_TOKEN = "admin-token-for-tests-0001"
CLIENT_KEYS = ["client-key-alpha-0001", "client-key-beta-0002"]
ENGINE_KEY = "engine-key-shared-0003"
MESSAGES = [{"role": "user", "content": "hi"}]


def _headers(received: list[tuple[dict[str, str], bytes]], path_hint: bytes = b"messages") -> dict[str, str]:
    """Lower-cased headers of the last chat request the recording engine saw."""
    for headers, body in reversed(received):
        if path_hint in body:
            return {key.lower(): value for key, value in headers.items()}
    raise AssertionError("the engine saw no chat request")


def test_admin_api_does_not_exist_without_a_token(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1))
    for method, path in (
        ("GET", "/admin/backends"),
        ("POST", "/admin/backends"),
        ("DELETE", "/admin/backends"),
        ("POST", "/admin/backends/drain"),
    ):
        response = httpx.request(method, router.url + path, headers={"Authorization": "Bearer x"}, timeout=30)
        assert_openai_error(response, 404)


def test_admin_api_needs_the_bearer_token(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1), admin_token=ADMIN_TOKEN)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": ADMIN_TOKEN},
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
        {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
    ):
        response = httpx.get(router.url + "/admin/backends", headers=headers, timeout=30)
        error = assert_openai_error(response, 401, "invalid_admin_token")
        assert error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    ok = httpx.get(router.url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["backends"]) == 1


def test_client_api_keys_guard_the_api_but_not_health_metrics_or_the_spec(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1), api_keys=CLIENT_KEYS)
    for key in (None, "wrong-key", CLIENT_KEYS[0] + "x"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(
            router.v1 + "/chat/completions", json={"model": "sim", "messages": MESSAGES}, headers=headers, timeout=30
        )
        assert_openai_error(response, 401, "invalid_api_key")
        assert_openai_error(httpx.get(router.v1 + "/models", headers=headers, timeout=30), 401)
    for key in CLIENT_KEYS:
        answer = router.client(api_key=key).chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
        assert answer.choices
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(router.url + path, timeout=30).status_code == 200
    spec = httpx.get(router.url + "/openapi.json", timeout=30).json()
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert router.metrics().value("kvroute_rejected_requests_total", reason="unauthorized") == 6


def test_backend_api_key_replaces_the_clients_authorization(recording_engine: Any, router_server: Any) -> None:
    url, received = recording_engine
    router = router_server([url], backend_api_key=ENGINE_KEY)
    httpx.post(
        router.v1 + "/chat/completions",
        json={"model": "rec", "messages": MESSAGES},
        headers={"Authorization": "Bearer the-clients-own-key"},
        timeout=30,
    )
    forwarded = _headers(received)
    assert forwarded["authorization"] == f"Bearer {ENGINE_KEY}"
    assert "the-clients-own-key" not in str(received)
    # The router's own probes of the engine (health, model list) carry the engine key too.
    probes = [headers for headers, body in received if not body]
    assert probes and all(h.get("Authorization") == f"Bearer {ENGINE_KEY}" for h in probes)


def test_a_backends_own_api_key_wins(recording_engine: Any, router_server: Any) -> None:
    url, received = recording_engine
    router = router_server([], backend_api_key=ENGINE_KEY, admin_token=ADMIN_TOKEN)
    added = httpx.post(
        router.url + "/admin/backends",
        json={"url": url, "api_key": "per-backend-key-0004"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    assert added.status_code == 201 and "api_key" not in added.json(), "the admin API never shows a key"
    httpx.post(router.v1 + "/chat/completions", json={"model": "rec", "messages": MESSAGES}, timeout=30)
    assert _headers(received)["authorization"] == "Bearer per-backend-key-0004"


def test_clients_cannot_spoof_routing_or_hop_by_hop_headers(recording_engine: Any, router_server: Any) -> None:
    url, received = recording_engine
    router = router_server([url], policy="round_robin")
    response = httpx.post(
        router.v1 + "/chat/completions",
        json={"model": "rec", "messages": MESSAGES},
        headers={
            "x-kvroute-policy": "random",
            "x-kvroute-backend": "http://evil.example:1",
            "X-KVRoute-Reason": "spoofed",
            "Connection": "keep-alive, X-Hop-Secret",
            "X-Hop-Secret": "private",
            "Keep-Alive": "timeout=5",
            "Upgrade": "h2c",
            "X-Kept": "yes",
        },
        timeout=30,
    )
    assert response.headers["x-kvroute-policy"] == "round_robin"
    assert response.headers["x-kvroute-backend"] == url
    forwarded = _headers(received)
    assert not [name for name in forwarded if name.startswith("x-kvroute-")]
    for name in ("x-hop-secret", "keep-alive", "upgrade"):
        assert name not in forwarded, name
    assert forwarded["x-kept"] == "yes"


def test_the_policy_header_works_only_when_allowed(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(2)
    allowed = router_server(sims, policy="round_robin", allow_policy_header=True)
    raw = allowed.client().chat.completions.with_raw_response.create(
        model="sim",
        messages=MESSAGES,
        max_tokens=2,
        extra_headers={"x-kvroute-policy": "least_load"},
    )
    assert raw.headers["x-kvroute-policy"] == "least_load"


def test_rate_limit_per_client_key(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1), api_keys=CLIENT_KEYS, rate_limit_rps=1.0)
    first, second = (router.client(api_key=key) for key in CLIENT_KEYS)
    assert first.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2).choices
    with pytest.raises(openai.RateLimitError) as limited:
        first.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
    assert limited.value.code == "rate_limit_exceeded"
    assert int(limited.value.response.headers["retry-after"]) >= 1
    # Another client's bucket is its own.
    assert second.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2).choices
    wait_until(lambda: _allowed(first), timeout=10, interval=0.3)
    assert router.metrics().value("kvroute_rejected_requests_total", reason="rate_limited") >= 1


def _allowed(client: openai.OpenAI) -> bool:
    try:
        client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
    except openai.RateLimitError:
        return False
    return True


@pytest.mark.parametrize(
    ("networks", "host", "status"),
    [
        (["10.0.0.0/8"], "127.0.0.1", 403),
        (["127.0.0.0/8"], "127.0.0.1", 201),
        (["127.0.0.0/8", "::1/128"], "localhost", 201),
        ([], "127.0.0.1", 201),
    ],
)
def test_admin_refuses_backends_outside_the_allowed_networks(
    sim_engines: Any, router_server: Any, networks: list[str], host: str, status: int
) -> None:
    (sim,) = sim_engines(1)
    router = router_server([], admin_token=ADMIN_TOKEN, admin_allowed_networks=networks)
    url = sim.url.replace("127.0.0.1", host)
    response = httpx.post(
        router.url + "/admin/backends",
        json={"url": url},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    )
    assert response.status_code == status, response.text
    if status == 403:
        assert_openai_error(response, 403, "backend_not_allowed")
        assert url not in router.state.pool


# --- secrets never reach the logs --------------------------------------------------------------
SECRETS = [ADMIN_TOKEN, *CLIENT_KEYS, ENGINE_KEY, "per-backend-key-0004", "presented-wrong-key-0005"]


def _exercise_every_path(router_url: str, sim_url: str, dead_url: str) -> None:
    """Requests that make the router log: successes, refusals, admin calls, failures."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    good = {"Authorization": f"Bearer {CLIENT_KEYS[0]}"}
    chat = {"model": "sim", "messages": MESSAGES, "max_tokens": 2}
    with httpx.Client(base_url=router_url, timeout=30) as client:
        client.post("/v1/chat/completions", json=chat, headers=good)
        client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=good)
        client.post("/v1/chat/completions", json=chat, headers={"Authorization": "Bearer presented-wrong-key-0005"})
        client.get("/admin/backends", headers={"Authorization": "Bearer presented-wrong-key-0005"})
        client.post("/admin/backends", json={"url": dead_url, "api_key": "per-backend-key-0004"}, headers=admin)
        client.post("/admin/backends", json={"url": sim_url, "api_key": "per-backend-key-0004"}, headers=admin)
        client.post("/admin/backends/drain", json={"url": dead_url}, headers=admin)
        for _ in range(3):  # some land on no backend / a dead one: error paths log
            client.post("/v1/chat/completions", json=chat, headers=good)
        client.get("/admin/backends", headers=admin)
        client.get("/metrics")
    # An oversized Authorization header: aiohttp's own log line would quote its bytes.
    host, port = router_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer presented-wrong-key-0005"
            + b"z" * 20_000
            + b"\r\n\r\n"
        )
        raw.recv(65536)


def test_secrets_are_not_logged_at_debug(
    sim_engines: Any, router_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """In-process, with no redaction filter: the code itself never logs a secret."""
    (sim, spare) = sim_engines(2)
    caplog.set_level(logging.DEBUG)
    router = router_server(
        [sim],
        admin_token=ADMIN_TOKEN,
        api_keys=CLIENT_KEYS,
        backend_api_key=ENGINE_KEY,
        decision_log=True,
        log_level="debug",
        max_header_bytes=8192,
    )
    spare.stop()
    _exercise_every_path(router.url, sim.url + "/", spare.url)
    text = caplog.text
    assert "kvroute" in text, "the router logged something"
    for secret in SECRETS:
        assert secret not in text, f"{secret} was logged"


def test_kvroute_serve_logs_no_secrets(sim_engines: Any, tmp_path: Any) -> None:
    """The real command at --log-level debug, with its redaction filter: its whole stderr."""
    (sim, spare) = sim_engines(2)
    spare.stop()
    port = _free_port()
    log_path = tmp_path / "kvroute.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvroute.router.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--backend",
                sim.url,
                "--policy",
                "round_robin",
                "--log-level",
                "debug",
                "--decision-log",
                "--admin-token",
                ADMIN_TOKEN,
                "--api-keys",
                ",".join(CLIENT_KEYS),
                "--backend-api-key",
                ENGINE_KEY,
                "--max-header-bytes",
                "8192",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: _answers(url + "/health"), timeout=60, interval=0.2)
            _exercise_every_path(url, sim.url + "/", spare.url)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    text = log_path.read_text(errors="replace")
    assert "kvroute listening" in text and "DEBUG" in text
    for secret in SECRETS:
        assert secret not in text, f"{secret} was logged"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
