"""kvroute's configuration: one pydantic-settings model, filled from four layers.

Precedence, highest first: command-line flags > ``KVROUTE_*`` environment variables >
the YAML file given by ``--config`` > the defaults below. An invalid value in any layer
fails at start with a message that names the field (see :func:`load_settings`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PolicyName = Literal["round_robin", "least_load", "random", "power_of_two", "sticky", "cache_aware"]
POLICY_NAMES: tuple[str, ...] = PolicyName.__args__  # type: ignore[attr-defined]


class ConfigError(ValueError):
    """Raised when the configuration is invalid; the message names the offending field."""


class ModelConfig(BaseModel):
    """Per-model settings (``models:`` section of the YAML file)."""

    tokenizer: str | None = None
    block_size: int | None = Field(default=None, gt=0)


class BackendConfig(BaseModel):
    """One statically configured backend (``backends:`` section, or ``--backend URL``)."""

    url: str
    api_key: str | None = None
    kv_events_endpoint: str | None = None
    # Default: the events endpoint's host with --kv-events-replay-port.
    kv_events_replay_endpoint: str | None = None
    capacity_tokens: int | None = Field(default=None, gt=0)

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {url!r}")
        return url.rstrip("/")


class Settings(BaseSettings):
    """Every setting of ``kvroute serve``. Environment: ``KVROUTE_<FIELD>`` (upper case)."""

    model_config = SettingsConfigDict(
        env_prefix="KVROUTE_", extra="forbid", env_nested_delimiter="__", validate_default=True
    )

    # --- listening -------------------------------------------------------------------
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=0, le=65535)

    # --- backends and discovery ------------------------------------------------------
    backends: list[BackendConfig] = Field(default_factory=list)
    discovery: Literal["static", "file", "k8s"] = "static"
    backends_file: Path | None = None
    k8s_selector: str = "app=vllm"
    k8s_namespace: str = "default"
    k8s_port: int | None = Field(default=None, ge=1, le=65535)
    k8s_api_url: str | None = None  # default: in-cluster https://kubernetes.default.svc

    # --- routing ---------------------------------------------------------------------
    policy: PolicyName = "cache_aware"
    ab: dict[str, int] | None = None  # policy name -> weight, from --ab "a=80,b=20"
    allow_policy_header: bool = False
    session_header: str = "x-session-id"
    tokenizer: str | None = None  # None: the offline default tokenizer
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    block_size: int | None = Field(default=None, gt=0)  # None: the engine's, else 16
    default_capacity_tokens: int | None = Field(default=None, gt=0)
    load_weight: float = Field(default=1.0, ge=0)
    overload_factor: float = Field(default=2.0, gt=1.0)
    index_ttl_s: float | None = Field(default=None, gt=0)
    decision_log: bool = False

    # --- precise mode ----------------------------------------------------------------
    kv_events: bool = False
    kv_events_port: int | None = Field(default=None, ge=1, le=65535)
    kv_events_replay_port: int | None = Field(default=None, ge=1, le=65535)
    kv_events_topic: str = "kv-events"
    kv_events_silence_s: float = Field(default=30.0, gt=0)
    speculative_ttl_s: float = Field(default=2.0, gt=0)

    # --- health and timeouts ---------------------------------------------------------
    health_interval_s: float = Field(default=5.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    unhealthy_after: int = Field(default=3, ge=1)
    healthy_after: int = Field(default=2, ge=1)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    first_byte_timeout_s: float = Field(default=600.0, gt=0)
    idle_timeout_s: float = Field(default=300.0, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    engine_scrape_interval_s: float = Field(default=5.0, gt=0)

    # --- limits and admission --------------------------------------------------------
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    max_header_bytes: int = Field(default=16 * 1024, gt=0)
    # A client's whole request body (408 after), and a connection's request head (closed after).
    request_read_timeout_s: float = Field(default=60.0, gt=0)
    max_concurrency: int | None = Field(default=None, gt=0)
    max_backend_concurrency: int | None = Field(default=None, gt=0)
    queue_size: int = Field(default=1024, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    rate_limit_rps: float | None = Field(default=None, gt=0)  # per client key
    breaker_failures: int = Field(default=5, ge=1)
    breaker_cooldown_s: float = Field(default=10.0, gt=0)

    # --- security --------------------------------------------------------------------
    admin_token: str | None = None
    api_keys: list[str] = Field(default_factory=list)
    backend_api_key: str | None = None
    admin_allowed_networks: list[str] = Field(default_factory=list)

    # --- logging ---------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_from_urls(cls, value: Any) -> Any:
        """Accept bare URLs (``--backend URL``, ``KVROUTE_BACKENDS=a,b``) as well as objects."""
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [{"url": item.strip()} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("api_keys", "admin_allowed_networks", mode="before")
    @classmethod
    def _split_csv(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
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
        if self.discovery == "file" and self.backends_file is None:
            raise ValueError("discovery 'file' needs backends_file (--backends-file)")
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
