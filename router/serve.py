"""``kvroute serve``: command-line flags -> :class:`~kvroute.router.config.Settings` -> the running router.

The flags are generated from the ``Settings`` model, so the two never drift apart: each
field in kebab case (booleans also get ``--no-``), except the few written by hand below.
Flags not given stay out of the parsed namespace (``argparse.SUPPRESS``), so the
environment and the config file can still supply those fields.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from kvroute.router.config import BackendConfig, ConfigError, Settings, load_settings
from kvroute.router.http.security import SecretRedactor, install_redaction, settings_secrets
from kvroute.router.routing.decisions import DECISION_LOGGER

if TYPE_CHECKING:
    from kvroute.router.http.workers import WorkerGroup

# Fields whose flag is written by hand below, or that only a config file can express.
_CUSTOM_FLAGS = {"backends", "models"}

# Per-backend endpoints given as ``--flag BACKEND_URL=ENDPOINT`` (field -> example endpoint).
_PER_BACKEND_ENDPOINTS = {
    "kv_events_endpoint": "tcp://h:5557",
    "kv_events_replay_endpoint": "tcp://h:5558",
    "engine": "sglang",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``kvroute serve`` argument parser (one flag per tunable Settings field)."""
    parser = argparse.ArgumentParser(
        prog="kvroute serve",
        description="Run the cache-aware reverse proxy in front of vLLM / SGLang replicas. "
        "Every flag can also be set as KVROUTE_<FIELD> in the environment or in --config.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", type=Path, help="YAML file with settings (field names as keys)")
    parser.add_argument(
        "--backend",
        dest="backends",
        action="append",
        metavar="URL",
        help="an engine's base URL, e.g. http://10.0.0.5:8000 (repeatable)",
    )
    for field, example in _PER_BACKEND_ENDPOINTS.items():
        parser.add_argument(
            "--" + field.replace("_", "-"),
            dest=field + "s",
            action="append",
            metavar="BACKEND_URL=" + field.rsplit("_", 1)[-1].upper(),
            help=f"{BackendConfig.model_fields[field].description}, for one backend: "
            f"e.g. http://h:8000={example} (repeatable)",
        )
    for name, info in Settings.model_fields.items():
        if name not in _CUSTOM_FLAGS:
            _add_field_flag(parser, name, info)
    return parser


def _add_field_flag(parser: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    flag = "--" + name.replace("_", "-")
    default = info.get_default(call_default_factory=True)
    help_text = f"{info.description} (default: {default})"
    annotation = info.annotation
    if annotation is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        return
    choices = _literal_choices(annotation)
    # Values stay strings: pydantic converts and validates them, naming the field on error.
    metavar = None if choices else name.upper()
    parser.add_argument(flag, dest=name, metavar=metavar, choices=choices, help=help_text)


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(value) for value in typing.get_args(annotation)]
    return None


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed flags, the environment and the config file; raises ConfigError."""
    flags = vars(args).copy()
    config_file = flags.pop("config", None)
    per_backend = {field: flags.pop(field + "s", None) for field in _PER_BACKEND_ENDPOINTS}
    settings = load_settings(flags, config_file)
    for field, pairs in per_backend.items():
        if pairs:
            settings = _with_backend_field(settings, field, pairs)
    try:
        settings.backend_ranks()  # as Settings checks it, with the per-backend flags applied
    except ValueError as exc:
        raise ConfigError(f"backends: {exc}") from None
    return settings


def _with_backend_field(settings: Settings, field: str, pairs: list[str]) -> Settings:
    """Set one per-backend field from ``BACKEND_URL=VALUE`` flags."""
    by_url: dict[str, str] = {}
    for pair in pairs:
        url, sep, value = pair.rpartition("=")
        if not sep or not url or not value:
            raise ConfigError(f"{field}: expected BACKEND_URL=ENDPOINT, got {pair!r}")
        by_url[url.rstrip("/")] = value
    unknown = sorted(set(by_url) - {backend.url for backend in settings.backends})
    if unknown:
        raise ConfigError(f"{field}: {unknown} are not configured backends")
    try:  # validated again: e.g. --engine http://h:8000=sglang must name a known engine
        backends: list[BackendConfig] = [
            BackendConfig.model_validate({**backend.model_dump(), field: by_url[backend.url]})
            if backend.url in by_url
            else backend
            for backend in settings.backends
        ]
    except ValidationError as exc:
        raise ConfigError(f"{field}: {exc.errors()[0]['msg']}") from None
    return settings.model_copy(update={"backends": backends})


def main(argv: list[str]) -> int:
    """Entry point of ``kvroute serve``."""
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        from kvroute.router.workers import supervise

        configure_logging(settings)
        return supervise(settings)
    return run_router(settings)


def configure_logging(settings: Settings, name: str = "") -> SecretRedactor:
    """Log to stderr at ``log_level``, with every secret of ``settings`` redacted.

    ``name`` (e.g. ``worker 1``) prefixes each line, so workers' lines can be told apart.
    """
    prefix = f"[{name}] " if name else ""
    logging.basicConfig(
        level=settings.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s",
    )
    if settings.decision_log:  # asked for by name: written whatever the level of the rest
        logging.getLogger(DECISION_LOGGER).setLevel(logging.INFO)
    redactor = SecretRedactor(settings_secrets(settings))
    install_redaction(redactor)
    return redactor


def run_router(
    settings: Settings,
    *,
    workers: WorkerGroup | None = None,
    on_listening: Callable[[], None] | None = None,
) -> int:
    """Build the router and serve it until SIGTERM (one process, or one worker of several)."""
    redactor = configure_logging(settings, f"worker {workers.index}" if workers is not None else "")

    from prometheus_client import disable_created_metrics

    from kvroute.router.http.app import build_app, run

    # *_created series double the exposition size and say nothing a dashboard uses.
    disable_created_metrics()
    try:
        app = build_app(settings, redactor=redactor, workers=workers)
    except (ConfigError, ValueError, OSError) as exc:
        who = f"worker {workers.index}: " if workers is not None else ""
        print(f"kvroute serve: {who}cannot start: {exc}", file=sys.stderr)
        return 2
    settle_garbage_collector()
    run(settings, app, workers=workers, on_listening=on_listening)
    return 0


#: Tracked allocations (net) between young-generation collections; CPython's default is 700.
GC_YOUNG_THRESHOLD = 10_000


def settle_garbage_collector() -> None:
    """Keep the cycle collector off the hot path once the router is built.

    What exists now (modules, the tokenizer, compiled templates and kernels) lives as long
    as the process: frozen, no collection walks it again. A request's objects die by
    reference counting, yet the requests merely in flight together cross CPython's young
    trigger of 700 net allocations every few dozen requests; 10,000 rarely. Cycles are
    still collected, in batches of at most that many objects.
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
