"""kvroute's configuration: one pydantic-settings model, filled from four layers.

Precedence, highest first: command-line flags > ``KVROUTE_*`` environment variables >
the YAML file given by ``--config`` > the defaults below. An invalid value in any layer
fails at start with a message that names the field (see :func:`load_settings`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, Field, FilePath, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvroute.router.backend_url import offset_endpoint_port, parse_backend_url, rank_name
from kvroute.router.dns_name import DnsName
from kvroute.router.peer_key import PeerKey
from kvroute.router.policy_catalog import POLICY_NAMES

if TYPE_CHECKING:
    PolicyName = str
else:  # the registered names, as choices pydantic checks and the CLI lists
    PolicyName = Literal[POLICY_NAMES]


class ConfigError(ValueError):
    """Raised when the configuration is invalid; the message names the offending field."""


def _json_object(value: Any) -> Any:
    """A JSON object given as text (a flag's value) decoded; anything else unchanged."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"expected a JSON object, got {value!r}") from exc
    return value


class ModelConfig(BaseModel):
    """Per-model settings (``models:`` section of the YAML file); the chat template ones as
    :class:`Settings` describes them, for this model's engines."""

    tokenizer: str | None = None
    block_size: int | None = Field(default=None, gt=0)
    chat_template: str | None = None
    default_chat_template_kwargs: dict[str, Any] | None = None

    _decode_kwargs = field_validator("default_chat_template_kwargs", mode="before")(_json_object)


ProxyCredential = Literal["if_absent", "always", "never"]

# Request headers an operator may not set per backend: the router frames each hop itself,
# and a credential belongs in api_key or the URL (one place, redacted from logs).
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
        "expect",
        "authorization",
    }
)


class BackendConfig(BaseModel):
    """One statically configured backend (``backends:`` section, or ``--backend URL``).

    ``url`` is kept as written, path prefix included; credentials written into it
    (``http://user:pw@host``) move to ``username`` / ``password`` and become
    ``Authorization: Basic``, so the URL itself (the backend's name in metrics, headers and
    logs) never carries them.
    """

    url: str
    api_key: str | None = Field(default=None, description="bearer token sent to this engine")
    username: str | None = Field(default=None, description="HTTP Basic user (or user:password@ in the URL)")
    password: str | None = Field(default=None, description="HTTP Basic password")
    api_key_on_proxy: ProxyCredential | None = Field(
        default=None,
        description="when proxied requests carry this engine's credential: if_absent (the client sent no"
        " Authorization), always (replacing the client's), never (only health, model and metrics calls);"
        " default if_absent; always for URL credentials, with --api-keys, or for --backend-api-key",
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="extra request headers on every call to this engine (the client's"
        " header of the same name is replaced)",
    )
    ca_file: FilePath | None = Field(
        default=None, description="CA bundle (PEM) that signs this https engine's certificate"
    )
    verify: bool = Field(
        default=True, description="verify this https engine's certificate (false: logged as a warning)"
    )
    kv_events_endpoint: str | None = Field(default=None, description="the KV-event ZMQ endpoint")
    kv_events_replay_endpoint: str | None = Field(
        default=None,
        description="the KV-event replay endpoint (default: the events host with --kv-events-replay-port)",
    )
    capacity_tokens: int | None = Field(default=None, gt=0, description="KV cache size in tokens")
    engine: Literal["auto", "vllm", "sglang", "generic"] = Field(
        default="auto",
        description="the engine API it speaks (kvroute.router.engines); auto: probe /server_info (SGLang), /metrics, /version",
    )
    data_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="data-parallel ranks of the vLLM engine at this URL (vllm serve --data-parallel-size):"
        " each rank becomes a backend of its own (default: --data-parallel-size)",
    )
    data_parallel_rank: int | None = Field(
        default=None,
        ge=0,
        description="this entry is one rank of a data-parallel engine: requests carry X-data-parallel-rank,"
        " its name is URL#dp<rank> (set for each rank of data_parallel_size, or written per rank)",
    )

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_url(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        try:
            parsed = parse_backend_url(data["url"])
        except ValueError:
            return data  # the url validator names the problem
        if parsed.username is None:
            return data
        if data.get("username") is not None or data.get("password") is not None:
            raise ValueError("credentials are given both in the URL and as username/password")
        return {**data, "url": parsed.base, "username": parsed.username, "password": parsed.password}

    @field_validator("url")
    @classmethod
    def _as_written(cls, url: str) -> str:
        return parse_backend_url(url).base

    @field_validator("headers")
    @classmethod
    def _plain_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if not name or not all(char.isalnum() or char in "!#$%&'*+-.^_`|~" for char in name) or not name.isascii():
                raise ValueError(f"not a header name: {name!r}")
            if name.lower() in _RESERVED_HEADERS:
                raise ValueError(f"header {name!r} cannot be set per backend (use api_key or the URL for credentials)")
            if any(char in value for char in "\r\n\0"):
                raise ValueError(f"header {name!r}: value must be one line")
        return headers

    @model_validator(mode="after")
    def _consistent(self) -> BackendConfig:
        if self.api_key is not None and self.username is not None:
            raise ValueError("give either api_key (Bearer) or a user and password (Basic), not both")
        if self.password is not None and self.username is None:
            raise ValueError("password without username")
        if not self.url.startswith("https://") and (self.ca_file is not None or not self.verify):
            raise ValueError("ca_file and verify apply to https:// backends only")
        rank, size = self.data_parallel_rank, self.data_parallel_size
        if rank is not None and size is not None and rank >= size:
            raise ValueError("data_parallel_rank must be below data_parallel_size")
        return self

    @property
    def name(self) -> str:
        """The backend's name (pool key, metrics label): its URL, ``#dp<rank>`` for a rank."""
        return rank_name(self.url, self.data_parallel_rank)

    def secrets(self) -> list[str]:
        """The credentials in this entry (for log redaction)."""
        return [secret for secret in (self.api_key, self.password) if secret]

    def ranks(self, default_size: int = 1) -> list[BackendConfig]:
        """The backends this entry stands for: itself, or one per data-parallel rank, each
        with the KV-event endpoints that rank publishes on (vLLM adds the rank to the port)."""
        size = self.data_parallel_size or default_size
        if self.data_parallel_rank is not None or size == 1:
            return [self]
        return [
            self.model_copy(
                update={
                    "data_parallel_rank": rank,
                    "kv_events_endpoint": _rank_endpoint(self.kv_events_endpoint, rank),
                    "kv_events_replay_endpoint": _rank_endpoint(self.kv_events_replay_endpoint, rank),
                }
            )
            for rank in range(size)
        ]


def _rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    return None if endpoint is None else offset_endpoint_port(endpoint, rank)


def _key_in(path: Path | None) -> PeerKey | None:
    """The key pair derived from the secret in ``path`` (None without a file)."""
    return PeerKey.read(path) if path is not None else None


class Settings(BaseSettings):
    """Every setting of ``kvroute serve``. Environment: ``KVROUTE_<FIELD>`` (upper case)."""

    model_config = SettingsConfigDict(
        env_prefix="KVROUTE_", extra="forbid", env_nested_delimiter="__", validate_default=True
    )

    # --- listening -------------------------------------------------------------------
    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on (0: any free port)")
    workers: int = Field(
        default=1,
        ge=1,
        description="router processes sharing the port (SO_REUSEPORT); over 1 they exchange placements, "
        "sum their metrics and apply admin writes to all; see Workers",
    )

    # --- backends and discovery ------------------------------------------------------
    backends: list[BackendConfig] = Field(
        default_factory=list,
        description="engine base URLs (--backend URL, repeatable; env: comma-separated; file: list of {url, api_key, api_key_on_proxy, headers, ca_file, verify, kv_events_endpoint, kv_events_replay_endpoint, capacity_tokens, engine, data_parallel_size, data_parallel_rank}; see Backends)",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        description="data-parallel ranks of every engine that does not give its own (vllm serve"
        " --data-parallel-size N): each rank is routed to as a backend of its own; see Backends",
    )
    discovery: Literal["static", "file", "k8s"] = Field(
        default="static",
        description="where backends come from: static (--backend), file (--backends-file, reloaded on change) or k8s (EndpointSlices)",
    )
    backends_file: Path | None = Field(
        default=None, description="file of backend URLs (YAML list or one URL per line) for --discovery file"
    )
    k8s_selector: str = Field(
        default="app=vllm", description="label selector of the engines' EndpointSlices for --discovery k8s"
    )
    k8s_namespace: str = Field(default="default", description="namespace watched by --discovery k8s")
    k8s_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="engine port for --discovery k8s (default: the slice's port named http, else its first)",
    )
    k8s_api_url: str | None = Field(
        default=None,
        description="Kubernetes API URL, overriding the server of the in-cluster service account "
        "or of the kubeconfig ($KUBECONFIG, ~/.kube/config) used outside a pod",
    )

    # --- routing ---------------------------------------------------------------------
    policy: PolicyName = Field(default="cache_aware", description="routing policy")
    ab: dict[str, int] | None = Field(
        default=None,
        description='A/B split of policies by weight, e.g. "cache_aware=80,round_robin=20" (stable per session)',
    )
    allow_policy_header: bool = Field(
        default=False, description="let clients force a policy with the x-kvroute-policy request header"
    )
    session_header: str = Field(
        default="x-session-id",
        description="request header carrying the session key (sticky policy, A/B assignment)",
    )
    tokenizer: str | None = Field(
        default=None,
        description="tokenizer: local directory or hub id (default: the shipped offline BPE tokenizer)",
    )
    chat_template: str | None = Field(
        default=None,
        description="the chat template the engines were started with (vllm serve --chat-template): a file or "
        "Jinja source, used instead of the tokenizer's own",
    )
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="the engines' default chat template keywords, a JSON object (vllm serve "
        "--default-chat-template-kwargs, e.g. '{\"enable_thinking\": false}'); a request's own take precedence",
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="render a request's own chat_template, as engines started with --trust-request-chat-template "
        "do (vLLM refuses such requests without it, and so they are routed without a prefix match)",
    )
    conversation_memo_mb: int = Field(
        default=128,
        ge=0,
        description="memory per tokenizer and worker for long conversations' last turns (rendered text and "
        "token ids, half each), so a turn renders and tokenizes only its new messages: ~240 KB per "
        "conversation of 200 agent messages; 0: none",
    )
    models: dict[str, ModelConfig] = Field(
        default_factory=dict,
        description="per-model settings (config file only): {model: {tokenizer, block_size, chat_template, "
        "default_chat_template_kwargs}}",
    )
    block_size: int | None = Field(
        default=None,
        gt=0,
        description="prefix index block size in tokens (default: the engines' own, else 16)",
    )
    default_capacity_tokens: int | None = Field(
        default=None,
        gt=0,
        description="KV cache size per backend in tokens when neither configured nor scraped",
    )
    load_weight: float = Field(
        default=0.5,
        ge=0,
        description=(
            "cache_aware: prompt tokens of prefill that one token of queued work costs (divided by 1 + the mean"
            " in-flight requests per backend when a backend holds most of the prompt)"
        ),
    )
    overload_factor: float = Field(
        default=2.0,
        gt=1.0,
        description="cache_aware, sticky: skip a backend with more in-flight requests than this "
        "multiple of the other backends' mean (+4 for cache_aware, +2 for sticky)",
    )
    index_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="forget index entries not touched for this long (default: never; capacity bounds memory)",
    )
    decision_log: bool = Field(default=False, description="log one JSON line per request with the routing decision")

    # --- precise mode ----------------------------------------------------------------
    kv_events: bool = Field(
        default=False, description="precise mode: keep the index exact from the engines' KV events (ZMQ)"
    )
    kv_events_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="precise mode: events port on each backend's host (instead of per-backend endpoints)",
    )
    kv_events_replay_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="precise mode: replay port on each backend's host, for gap recovery",
    )
    kv_events_topic: str = Field(default="kv-events", description="precise mode: ZMQ topic of the engines' events")
    kv_events_silence_s: float = Field(
        default=30.0,
        gt=0,
        description="precise mode: a backend's stream silent this long while it gets traffic falls back to approximate",
    )
    stored_responses: int = Field(
        default=65_536,
        ge=0,
        description="Responses API: how many answer ids the router remembers with the backend storing each "
        "(vLLM's store, VLLM_ENABLE_RESPONSES_API_STORE=1); a continuation of one it forgot searches the "
        "backends, one 404 each; ~180 bytes an id",
    )
    speculative_ttl_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "precise mode: how long a routed request's blocks count before the engine's events confirm them, "
            "from the routing and again from the engine's answer (events can come after it)"
        ),
    )

    # --- health and timeouts ---------------------------------------------------------
    health_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="seconds between active /health checks of a healthy backend "
        "(an unhealthy one is retried after 0.25 s, doubling up to this)",
    )
    health_timeout_s: float = Field(default=2.0, gt=0, description="timeout of one active health check")
    unhealthy_after: int = Field(
        default=3, ge=1, description="consecutive failed checks before a backend is marked unhealthy"
    )
    healthy_after: int = Field(
        default=2, ge=1, description="consecutive good checks before an unhealthy backend is used again"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="timeout to connect to a backend")
    first_byte_timeout_s: float = Field(
        default=600.0, gt=0, description="timeout until a backend's first response byte (504 after)"
    )
    idle_timeout_s: float = Field(
        default=300.0, gt=0, description="longest silence between two chunks of a streamed response"
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    engine_scrape_interval_s: float = Field(
        default=5.0, gt=0, description="seconds between scrapes of each engine's /metrics"
    )

    # --- limits and admission --------------------------------------------------------
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0, description="largest request body accepted (413 above)")
    max_header_bytes: int = Field(
        default=16 * 1024, gt=0, description="largest request header field accepted (431 above)"
    )
    # A client's whole request body (408 after), and a connection's request head (closed after).
    request_read_timeout_s: float = Field(
        default=60.0, gt=0, description="time a client has to send its whole request (408 after)"
    )
    # Why a second server: aiohttp's costs ~70-90 us of CPU per request above llhttp on
    # uvloop (benchmarks/README.md, round 8); "aiohttp" serves everything with aiohttp.
    http_server: Literal["lean", "aiohttp"] = Field(
        default="lean",
        description="server of the proxied POSTs: lean (llhttp; the rest handed to aiohttp) or aiohttp",
    )
    max_concurrency: int | None = Field(
        default=None,
        gt=0,
        description="requests in flight through the router at once (queued above; default: unlimited)",
    )
    max_backend_concurrency: int | None = Field(
        default=None,
        gt=0,
        description="requests in flight per backend at once (queued above; default: unlimited)",
    )
    queue_size: int = Field(default=1024, ge=0, description="requests that may wait for a free slot (429 above)")
    queue_timeout_s: float = Field(
        default=30.0, gt=0, description="longest wait for a free slot (429 with Retry-After after)"
    )
    rate_limit_rps: float | None = Field(
        default=None,
        gt=0,
        description="requests per second per client key (token bucket; 429 above; default: off)",
    )
    breaker_failures: int = Field(
        default=5, ge=1, description="consecutive failures that eject a backend for a cooldown"
    )
    breaker_cooldown_s: float = Field(
        default=10.0, gt=0, description="first ejection length; doubles while recovery probes fail"
    )

    # --- several router replicas -------------------------------------------------------
    peer_bind: str | None = Field(
        default=None,
        description="publish this router's placements to its peer routers on this endpoint: ZMQ (e.g. tcp://0.0.0.0:5600) or, on one host, unix://PATH",
    )
    peers: list[str] = Field(
        default_factory=list,
        description="comma-separated endpoints of the other routers' --peer-bind (ZMQ or unix://PATH); their placements enter this index",
    )
    peers_dns: str | None = Field(
        default=None,
        description="NAME:PORT resolved every 5 s (e.g. a headless Service over the router pods); every address but this router's own is a peer at tcp://ADDRESS:PORT",
    )
    peer_secret_file: Path | None = Field(
        default=None,
        description="a file of at least 32 characters every router of the fleet shares: the exchange's ZMQ sockets then use CurveZMQ (encrypted; only holders of the secret hear or are heard)",
    )
    peer_accepted_secret_file: Path | None = Field(
        default=None,
        description="a second secret, for rotating peer_secret_file's: peers holding either are heard and hear this router (deploy/README.md, 'Rotating the peer secret')",
    )
    peer_max_bytes_per_s: int = Field(
        default=16 * 1024 * 1024,
        gt=0,
        description="bandwidth budget of published placements (bytes/s; over it they drop)",
    )

    # --- security --------------------------------------------------------------------
    admin_token: str | None = Field(
        default=None, description="enable the admin API (/admin/backends) with this bearer token"
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="comma-separated API keys clients must present as Bearer tokens (default: open)",
    )
    backend_api_key: str | None = Field(
        default=None, description="bearer token sent to the engines instead of the client's Authorization"
    )
    admin_allowed_networks: list[str] = Field(
        default_factory=list, description="comma-separated CIDRs the admin API may add backends from"
    )

    # --- logging ---------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")

    def peer_key(self) -> PeerKey | None:
        """The fleet's CURVE key pair from ``peer_secret_file`` (None without one)."""
        return _key_in(self.peer_secret_file)

    def backend_ranks(self) -> list[BackendConfig]:
        """The configured backends as the pool holds them: a data-parallel engine as its ranks."""
        return [rank for backend in self.backends for rank in backend.ranks(self.data_parallel_size)]

    def peer_accepted_key(self) -> PeerKey | None:
        """The pair of the second secret (``peer_accepted_secret_file``), if any."""
        return _key_in(self.peer_accepted_secret_file)

    _decode_kwargs = field_validator("default_chat_template_kwargs", mode="before")(_json_object)

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_from_urls(cls, value: Any) -> Any:
        """Accept bare URLs (``--backend URL``, ``KVROUTE_BACKENDS=a,b``) as well as objects."""
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [{"url": item.strip()} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("api_keys", "admin_allowed_networks", "peers", mode="before")
    @classmethod
    def _split_csv(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("peers_dns")
    @classmethod
    def _check_peers_dns(cls, value: str | None) -> str | None:
        if value is not None:
            DnsName.parse(value)  # ValueError names the expected form
        return value

    @field_validator("ab", mode="before")
    @classmethod
    def _parse_ab(cls, value: Any) -> Any:
        """``"cache_aware=80,round_robin=20"`` -> ``{"cache_aware": 80, "round_robin": 20}``."""
        if isinstance(value, str):
            split: dict[str, int] = {}
            for part in value.split(","):
                name, sep, weight = part.partition("=")
                if not sep:
                    raise ValueError(f"expected POLICY=WEIGHT, got {part!r}")
                split[name.strip()] = int(weight)
            return split
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.ab is not None:
            unknown = sorted(set(self.ab) - set(POLICY_NAMES))
            if unknown:
                raise ValueError(f"ab: unknown policies {unknown}; known: {list(POLICY_NAMES)}")
            if any(weight < 0 for weight in self.ab.values()) or sum(self.ab.values()) <= 0:
                raise ValueError("ab: weights must be >= 0 and sum to more than 0")
        self.backend_ranks()  # a ValueError names a data-parallel engine's endpoint without a port
        if self.discovery == "file" and self.backends_file is None:
            raise ValueError("discovery 'file' needs backends_file (--backends-file)")
        self.peer_key()  # a ValueError names the secret file and what is wrong with it
        if self.peer_accepted_secret_file is not None and self.peer_secret_file is None:
            raise ValueError("peer_accepted_secret_file needs peer_secret_file (it is a second secret)")
        self.peer_accepted_key()
        if self.workers > 1 and self.peer_bind is not None and self.peer_bind.startswith("unix://"):
            # The supervisor relays the workers' messages to other routers over ZMQ only.
            raise ValueError("peer_bind: with workers > 1 it must be a ZMQ endpoint (e.g. tcp://0.0.0.0:5600)")
        return self


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return {key.replace("-", "_"): value for key, value in data.items()}


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "config"
        lines.append(f"{field}: {error['msg']}")
    return "invalid configuration: " + "; ".join(lines)


def _env_values() -> dict[str, Any]:
    """The ``KVROUTE_*`` variables, keyed by field name; JSON values are decoded."""
    values: dict[str, Any] = {}
    for key, raw in os.environ.items():
        if not key.startswith("KVROUTE_"):
            continue
        field = key[len("KVROUTE_") :].lower()
        if field not in Settings.model_fields:
            continue
        if raw[:1] in "[{":
            try:
                values[field] = json.loads(raw)
                continue
            except json.JSONDecodeError:
                pass
        values[field] = raw
    return values


def load_settings(flags: dict[str, Any] | None = None, config_file: Path | None = None) -> Settings:
    """Build :class:`Settings` from flags > env > YAML file > defaults.

    ``flags`` holds only the options the user actually gave on the command line (``None``
    values are ignored). Raises :class:`ConfigError` naming the invalid field.
    """
    merged = _read_yaml(config_file) if config_file else {}
    merged.update(_env_values())
    merged.update({key: value for key, value in (flags or {}).items() if value is not None})
    try:
        # model_validate skips BaseSettings' own source loading: the layering is done above.
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from exc


def reference_markdown() -> str:
    """The configuration reference as a Markdown table (``python -m kvroute.router.config``).

    The README's table is this output, so flags, variables and defaults are documented
    from the one place they are defined.
    """
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        shown = "—" if default in (None, [], {}) else f"`{default}`"
        flag = "`--backend`" if name == "backends" else f"`--{name.replace('_', '-')}`"
        if name == "models":
            flag = "(file only)"
        rows.append(f"| {flag} | `KVROUTE_{name.upper()}` | {shown} | {info.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
