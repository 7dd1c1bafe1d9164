"""Backend URLs as written: path prefixes, credentials, extra headers and TLS, per backend.

Every test drives the real router with real clients against real servers: simulated vLLM
replicas, a small path-prefix gateway in front of them (an aiohttp server that strips its
prefix and forwards, recording what it was asked), a replica started with vLLM's
``--api-key``, and a replica serving HTTPS with a certificate made for the test.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import logging
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvroute.router.backend_url import offset_endpoint_port, parse_backend_url, rank_name, split_rank_name
from kvroute.router.config import BackendConfig, ConfigError, load_settings
from kvroute.router.routing.precise_index import events_endpoint_for
from kvroute.router.serve import build_parser, settings_from_args
from tests.servers import ServerLoop, SimServer, wait_until

MESSAGES = [{"role": "user", "content": "hello there"}]
PREFIX = "/serving/llama"
ENGINE_KEY = "engine-key-for-tests-0005"
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te"})


# --- a real path-prefix gateway ----------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """One request as the gateway received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Gateway:
    """``url`` is the gateway's base URL with its prefix: what an operator writes."""

    root: str
    url: str
    seen: list[Seen]

    def paths(self, method: str | None = None) -> list[str]:
        return [s.path for s in self.seen if method is None or s.method == method]

    def last(self, path_end: str) -> Seen:
        return next(s for s in reversed(self.seen) if s.path.endswith(path_end))


@pytest.fixture
def gateway(server_loop: ServerLoop) -> Iterator[Callable[..., Gateway]]:
    """Factory: ``gateway(target_url, prefix=PREFIX, require=None)``: strips ``prefix``
    and forwards to ``target_url`` (streaming the answer back); anything outside the prefix
    is a 404, as at a real gateway's root. ``require``: the exact ``Authorization`` the
    gateway itself demands (401 otherwise); it is not passed on."""
    from tests.servers import start_server

    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    def start(target: str, prefix: str = PREFIX, require: str | None = None) -> Gateway:
        seen: list[Seen] = []

        async def forward(request: web.Request) -> web.StreamResponse:
            data = await request.read()
            seen.append(Seen(request.method, request.path_qs, dict(request.headers), data))
            if require is not None and request.headers.get("Authorization") != require:
                return web.json_response({"error": "gateway: unauthorized"}, status=401)
            if request.path != prefix and not request.path.startswith(prefix + "/"):
                return web.json_response({"error": f"gateway: no route for {request.path}"}, status=404)
            if not sessions:
                sessions.append(aiohttp.ClientSession(auto_decompress=False))
            skip = _HOP | ({"authorization"} if require is not None else set())
            headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
            async with sessions[0].request(
                request.method, target + request.path_qs[len(prefix) :], headers=headers, data=data
            ) as upstream:
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        runner, root = server_loop.run(start_server(app))
        runners.append(runner)
        return Gateway(root=root, url=root + prefix, seen=seen)

    yield start
    for runner in runners:
        server_loop.run(runner.cleanup())
    for session in sessions:
        server_loop.run(session.close())


def _chat(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)


# --- parsing and configuration -----------------------------------------------------------
def test_a_url_keeps_its_prefix_and_loses_its_credentials() -> None:
    parsed = parse_backend_url("http://user:p%40ss@gw.example:8080/serving/llama/")
    assert (parsed.host, parsed.port, parsed.prefix) == ("gw.example", 8080, "/serving/llama")
    assert parsed.authority == "gw.example:8080"
    assert (parsed.username, parsed.password) == ("user", "p@ss")
    assert parsed.base == "http://gw.example:8080/serving/llama"
    assert parse_backend_url("https://[::1]/").base == "https://[::1]"
    assert parse_backend_url("https://[::1]").port == 443
    config = BackendConfig(url="http://user:p%40ss@gw.example:8080/serving/llama/")
    assert config.url == "http://gw.example:8080/serving/llama", "the backend's name carries no credentials"
    assert (config.username, config.password) == ("user", "p@ss")
    # KV-event discovery uses the backend's host, prefix and credentials notwithstanding.
    assert events_endpoint_for(config.url, 5557) == "tcp://gw.example:5557"


def test_the_backend_flag_takes_a_prefixed_url() -> None:
    args = build_parser().parse_args(["--backend", "http://127.0.0.1:8000/serving/llama", "--backend", "http://h:1/"])
    assert [b.url for b in settings_from_args(args).backends] == ["http://127.0.0.1:8000/serving/llama", "http://h:1"]


# --- data-parallel ranks ------------------------------------------------------------------
def test_a_data_parallel_rank_is_named_by_its_engines_url() -> None:
    assert rank_name("http://h:8000/p", 1) == "http://h:8000/p#dp1"
    assert rank_name("http://h:8000", None) == "http://h:8000"
    assert split_rank_name("http://h:8000/p#dp12") == ("http://h:8000/p", 12)
    assert split_rank_name("http://h:8000") == ("http://h:8000", None)
    assert split_rank_name("http://h:8000/#dpx") == ("http://h:8000/#dpx", None)
    assert offset_endpoint_port("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint_port("tcp://[::1]:5557", 3) == "tcp://[::1]:5560"
    with pytest.raises(ValueError, match="PORT"):
        offset_endpoint_port("ipc:///tmp/events", 1)


def test_each_rank_of_a_data_parallel_engine_is_a_backend() -> None:
    """vLLM's rank r publishes its KV events r ports above the configured ones."""
    args = build_parser().parse_args(
        [
            "--backend",
            "http://a:8000",
            "--backend",
            "http://b:8000",
            "--data-parallel-size",
            "2",
            "--kv-events-endpoint",
            "http://a:8000=tcp://a:5557",
            "--kv-events-replay-endpoint",
            "http://a:8000=tcp://a:5567",
        ]
    )
    ranks = settings_from_args(args).backend_ranks()
    assert [rank.name for rank in ranks] == [
        "http://a:8000#dp0",
        "http://a:8000#dp1",
        "http://b:8000#dp0",
        "http://b:8000#dp1",
    ]
    assert [(rank.kv_events_endpoint, rank.kv_events_replay_endpoint) for rank in ranks[:2]] == [
        ("tcp://a:5557", "tcp://a:5567"),
        ("tcp://a:5558", "tcp://a:5568"),
    ]
    unix = ["--backend", "http://a:8000", "--data-parallel-size", "2", "--kv-events-endpoint", "http://a:8000=ipc:///e"]
    with pytest.raises(ConfigError, match="PORT"):
        settings_from_args(build_parser().parse_args(unix))
    # An entry's own size wins over the router-wide one; an entry may name one rank itself.
    settings = load_settings(
        {
            "data_parallel_size": 2,
            "backends": [
                {"url": "http://a:8000", "data_parallel_size": 1},
                {"url": "http://b:8000", "data_parallel_size": 4, "data_parallel_rank": 3},
            ],
        }
    )
    assert [rank.name for rank in settings.backend_ranks()] == ["http://a:8000", "http://b:8000#dp3"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"url": "http://h?x=1"}, "query"),
        ({"url": "http://h", "data_parallel_size": 2, "data_parallel_rank": 2}, "below data_parallel_size"),
        ({"url": "http://h", "data_parallel_size": 2, "kv_events_endpoint": "ipc:///e"}, "PORT"),
        ({"url": "http://h", "data_parallel_size": 0}, "data_parallel_size"),
        ({"url": "http://h:99999"}, "port"),
        ({"url": "http://h", "headers": {"Host": "evil"}}, "cannot be set"),
        ({"url": "http://h", "headers": {"Authorization": "x"}}, "cannot be set"),
        ({"url": "http://h", "headers": {"X-Ok": "a\r\nInjected: 1"}}, "one line"),
        ({"url": "http://u:pw@h", "api_key": "k"}, "not both"),
        ({"url": "http://h", "verify": False}, "https:// backends only"),
        ({"url": "https://h", "ca_file": "/nonexistent/ca.pem"}, "ca_file"),
        ({"url": "http://h", "api_key_on_proxy": "sometimes"}, "api_key_on_proxy"),
    ],
)
def test_bad_backend_entries_are_named_at_start(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings({"backends": [entry]})
    assert message in str(error.value)
    assert "pw" not in str(error.value), "a rejected entry's credentials are not echoed"


# --- a path prefix, for every call --------------------------------------------------------
def test_every_call_keeps_the_backends_path_prefix(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    sim = sim_engines(1)[0]
    gw = gateway(sim.url)
    router = router_server([gw.url], engine_scrape_interval_s=0.2)
    client = router.client()
    answer = client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=3)
    assert answer.parse().choices[0].message.content
    assert answer.headers["x-kvroute-backend"] == gw.url
    chunks = list(client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=3, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert client.completions.create(model="sim", prompt="hi", max_tokens=2).choices
    wait_until(lambda: f"{PREFIX}/metrics" in gw.paths("GET"))
    assert gw.paths("POST") == [f"{PREFIX}/v1/chat/completions"] * 2 + [f"{PREFIX}/v1/completions"]
    assert {f"{PREFIX}/health", f"{PREFIX}/v1/models", f"{PREFIX}/metrics"} <= set(gw.paths("GET"))
    assert all(path.startswith(PREFIX + "/") for path in gw.paths()), gw.paths()
    # The scrape through the prefix reached the engine: its stats are the router's.
    wait_until(
        lambda: (
            router.metrics().value("kvroute_engine_requests_waiting", backend=gw.url) == 0
            and router.metrics().label_values("kvroute_engine_requests_waiting", "backend") == {gw.url}
        )
    )


def test_two_backends_behind_one_gateway_differ_by_prefix(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    first, second = sim_engines(2)
    gw_a, gw_b = gateway(first.url, prefix="/a"), gateway(second.url, prefix="/b")
    router = router_server([gw_a.url, gw_b.url], policy="round_robin")
    backends = {
        router.client()
        .chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2)
        .headers["x-kvroute-backend"]
        for _ in range(4)
    }
    assert backends == {gw_a.url, gw_b.url}
    assert gw_a.paths("POST") == ["/a/v1/chat/completions"] * 2 and gw_b.paths("POST") == ["/b/v1/chat/completions"] * 2


# --- credentials in the URL ---------------------------------------------------------------
def test_url_credentials_become_basic_auth_and_never_reach_host_or_names(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    sim = sim_engines(1)[0]
    basic = "Basic " + base64.b64encode(b"gw-user:s3cret@pw").decode()
    gw = gateway(sim.url, require=basic)
    written = gw.url.replace("http://", "http://gw-user:s3cret%40pw@")
    router = router_server([written], admin_token="admin-token-0006")
    raw = router.client().chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2)
    assert raw.parse().choices, "the gateway accepted the router's Basic credentials"
    assert raw.headers["x-kvroute-backend"] == gw.url
    host = gw.root.removeprefix("http://")
    assert {s.headers["Host"] for s in gw.seen} == {host}
    assert {s.headers["Authorization"] for s in gw.seen} == {basic}, "probes and proxied requests alike"
    assert {s.path for s in gw.seen} >= {f"{PREFIX}/health", f"{PREFIX}/v1/models", f"{PREFIX}/v1/chat/completions"}
    admin = {"Authorization": "Bearer admin-token-0006"}
    listing = httpx.get(router.url + "/admin/backends", headers=admin, timeout=30)
    exported = listing.text + httpx.get(router.url + "/metrics", timeout=30).text
    assert "s3cret" not in exported and "gw-user" not in exported
    assert listing.json()["backends"][0]["url"] == gw.url


# --- an engine started with --api-key -----------------------------------------------------
def test_the_sim_engine_checks_an_api_key_as_vllm_does(sim_engines: Callable[..., list[SimServer]]) -> None:
    sim = sim_engines(1, api_key=ENGINE_KEY)[0]
    body = {"model": "sim", "messages": MESSAGES, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ENGINE_KEY}):
        refused = httpx.post(sim.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        assert httpx.get(sim.url + "/v1/models", headers=headers, timeout=30).status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(sim.url + path, timeout=30).status_code == 200, path
    sdk = openai.OpenAI(base_url=sim.url + "/v1", api_key=ENGINE_KEY, max_retries=0)
    assert _chat(sdk).choices


def test_an_engine_key_goes_with_probes_and_fills_in_for_clients_without_one(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    sim = sim_engines(1, api_key=ENGINE_KEY)[0]
    gw = gateway(sim.url)
    router = router_server([{"url": gw.url, "api_key": ENGINE_KEY}], engine_scrape_interval_s=0.2)
    wait_until(lambda: f"{PREFIX}/metrics" in gw.paths())
    for path in ("/health", "/v1/models", "/metrics"):
        assert gw.last(path).headers["Authorization"] == f"Bearer {ENGINE_KEY}", path
    assert [card["id"] for card in httpx.get(router.v1 + "/models", timeout=30).json()["data"]] == ["sim"], (
        "the model list, guarded by the key, was read"
    )
    # No Authorization from the client: the engine's key goes instead (if_absent).
    plain = httpx.post(
        router.v1 + "/chat/completions", json={"model": "sim", "messages": MESSAGES, "max_tokens": 2}, timeout=30
    )
    assert plain.status_code == 200 and gw.last("/chat/completions").headers["Authorization"] == f"Bearer {ENGINE_KEY}"
    # A client with its own key is passed through as it is: the engine decides.
    with pytest.raises(openai.AuthenticationError):
        _chat(router.client(api_key="the-clients-own-key"))
    assert gw.last("/chat/completions").headers["Authorization"] == "Bearer the-clients-own-key"
    assert _chat(router.client(api_key=ENGINE_KEY)).choices


def test_api_key_on_proxy_always_and_never(sim_engines: Callable[..., list[SimServer]], router_server: Any) -> None:
    sim = sim_engines(1, api_key=ENGINE_KEY)[0]
    always = router_server([{"url": sim.url, "api_key": ENGINE_KEY, "api_key_on_proxy": "always"}])
    assert _chat(always.client(api_key="anything")).choices
    never = router_server([{"url": sim.url, "api_key": ENGINE_KEY, "api_key_on_proxy": "never"}])
    assert [card["id"] for card in httpx.get(never.v1 + "/models", timeout=30).json()["data"]] == ["sim"]
    refused = httpx.post(never.v1 + "/chat/completions", json={"model": "sim", "messages": MESSAGES}, timeout=30)
    assert refused.status_code == 401, "the key stayed with the router's own calls"


def test_router_checked_client_keys_are_replaced_by_the_engines(
    sim_engines: Callable[..., list[SimServer]], router_server: Any
) -> None:
    sim = sim_engines(1, api_key=ENGINE_KEY)[0]
    router = router_server([{"url": sim.url, "api_key": ENGINE_KEY}], api_keys=["router-client-key-0007"])
    sdk = router.client(api_key="router-client-key-0007")
    assert _chat(sdk).choices


def test_extra_headers_go_with_every_call_and_replace_the_clients(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    sim = sim_engines(1)[0]
    gw = gateway(sim.url)
    router = router_server([{"url": gw.url, "headers": {"X-Gateway-Tenant": "team-a"}}], engine_scrape_interval_s=0.2)
    answer = router.client().chat.completions.create(
        model="sim",
        messages=MESSAGES,
        max_tokens=2,
        extra_headers={"x-gateway-tenant": "spoofed", "X-Other": "kept"},
    )
    assert answer.choices
    wait_until(lambda: f"{PREFIX}/metrics" in gw.paths())
    for path in ("/health", "/v1/models", "/metrics", "/v1/chat/completions"):
        lowered = {k.lower(): v for k, v in gw.last(path).headers.items()}
        assert lowered["x-gateway-tenant"] == "team-a", path
    chat = {k.lower(): v for k, v in gw.last("/v1/chat/completions").headers.items()}
    assert chat["x-other"] == "kept"


def test_requests_reach_a_data_parallel_rank_by_vllms_header(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    """Two ranks of one engine URL: the router's own calls go to the URL, each proxied
    request names its rank (a client's own rank header is replaced), and the answer says
    which rank took it."""
    gw = gateway(sim_engines(1)[0].url)
    router = router_server([{"url": gw.url, "data_parallel_size": 2}], engine_scrape_interval_s=0.2)
    assert sorted(backend.url for backend in router.state.pool) == [gw.url + "#dp0", gw.url + "#dp1"]
    chosen = []
    for _ in range(4):
        raw = router.client().chat.completions.with_raw_response.create(
            model="sim", messages=MESSAGES, max_tokens=2, extra_headers={"X-Data-Parallel-Rank": "7"}
        )
        assert raw.parse().choices
        chosen.append(raw.headers["x-kvroute-backend"])
    assert sorted(set(chosen)) == [gw.url + "#dp0", gw.url + "#dp1"]  # round robin: both ranks
    ranks = [
        {k.lower(): v for k, v in seen.headers.items()}["x-data-parallel-rank"]
        for seen in gw.seen
        if seen.path.endswith("/v1/chat/completions")
    ]
    assert ranks == [name.rpartition("#dp")[2] for name in chosen]
    wait_until(lambda: f"{PREFIX}/metrics" in gw.paths())
    for path in ("/health", "/v1/models", "/metrics"):
        assert "x-data-parallel-rank" not in {k.lower() for k in gw.last(path).headers}, path


def test_sglangs_generate_names_its_rank_in_the_body(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any
) -> None:
    """SGLang's native /generate reads the rank from the body: each request to a rank
    carries ``routed_dp_rank`` (a client's own replaced), the rest of the body as sent."""
    gw = gateway(sim_engines(1, api="sglang")[0].url)
    router = router_server([{"url": gw.url, "data_parallel_size": 2}], engine_scrape_interval_s=0.2)
    bodies = [
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}},
        {"routed_dp_rank": 7, "input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 2}},
        {"text": ["a batch", "of two"], "sampling_params": {"max_new_tokens": 1}},
    ]
    chosen = []
    for body in bodies:
        answer = httpx.post(router.url + "/generate", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        chosen.append(int(answer.headers["x-kvroute-backend"].rpartition("#dp")[2]))
    sent = [json.loads(seen.body) for seen in gw.seen if seen.path.endswith("/generate")]
    assert [body.pop("routed_dp_rank") for body in sent] == chosen
    assert sent == [{k: v for k, v in body.items() if k != "routed_dp_rank"} for body in bodies]


# --- TLS ----------------------------------------------------------------------------------
def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute test engine")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "engine.pem", directory / "engine.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


@pytest.fixture
def tls_engine(server_loop: ServerLoop, sim_tokenizer: Any, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A sim engine serving HTTPS on 127.0.0.1; yields its URL and the CA file that trusts it."""
    from kvroute.benchmarks.sim_engine.config import SimEngineConfig
    from kvroute.benchmarks.sim_engine.server import build_app

    cert_file, key_file = _self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    app = build_app(SimEngineConfig(port=0, time_scale=1000.0), sim_tokenizer)

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        return runner

    runner = server_loop.run(start())
    yield f"https://127.0.0.1:{runner.addresses[0][1]}", cert_file
    server_loop.run(runner.cleanup())


def test_a_tls_engine_with_its_ca_file(tls_engine: tuple[str, Path], router_server: Any) -> None:
    url, ca_file = tls_engine
    router = router_server([{"url": url, "ca_file": str(ca_file)}], engine_scrape_interval_s=0.2)
    client = router.client()
    assert _chat(client).choices
    assert list(client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2, stream=True))
    assert [card["id"] for card in httpx.get(router.v1 + "/models", timeout=30).json()["data"]] == ["sim"]
    wait_until(lambda: router.metrics().label_values("kvroute_engine_requests_waiting", "backend") == {url})


def test_a_tls_engine_is_not_trusted_without_its_ca(tls_engine: tuple[str, Path], router_server: Any) -> None:
    url, _ = tls_engine
    router = router_server([url])
    assert router.metrics().value("kvroute_backend_healthy", backend=url) == 0
    with pytest.raises(openai.APIStatusError) as refused:
        router.client().chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 503


def test_verify_false_works_and_says_so_loudly(
    tls_engine: tuple[str, Path], router_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = tls_engine
    with caplog.at_level(logging.WARNING, logger="kvroute.backends"):
        router = router_server([{"url": url, "verify": False}])
    assert _chat(router.client()).choices
    warnings = [r.getMessage() for r in caplog.records if "verification is OFF" in r.getMessage()]
    assert warnings and url in warnings[0]


def test_discovered_urls_keep_their_prefix_and_credentials(
    sim_engines: Callable[..., list[SimServer]], gateway: Callable[..., Gateway], router_server: Any, tmp_path: Path
) -> None:
    first, second = sim_engines(2)
    basic = "Basic " + base64.b64encode(b"fleet:pw-0008").decode()
    gw_a, gw_b = gateway(first.url, prefix="/a", require=basic), gateway(second.url, prefix="/b", require=basic)
    listing = tmp_path / "backends.txt"
    listing.write_text(gw_a.url.replace("http://", "http://fleet:pw-0008@") + "/\n")
    router = router_server([], discovery="file", backends_file=str(listing))
    pool = router.state.pool
    wait_until(lambda: [b.url for b in pool] == [gw_a.url] and pool.get(gw_a.url).healthy)
    assert _chat(router.client()).choices
    listing.write_text(gw_b.url.replace("http://", "http://fleet:pw-0008@") + "\n")
    wait_until(lambda: [b.url for b in pool] == [gw_b.url] and pool.get(gw_b.url).healthy)
    assert _chat(router.client()).choices
    assert gw_a.paths("POST") == ["/a/v1/chat/completions"] and gw_b.paths("POST") == ["/b/v1/chat/completions"]
    assert {s.headers["Authorization"] for s in gw_a.seen + gw_b.seen} == {basic}
