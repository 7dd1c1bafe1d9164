"""``kvroute serve`` configuration: flags, environment, YAML file, precedence and errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.router.config import ConfigError, Settings
from kvroute.router.serve import build_parser, main, settings_from_args
from tests.paths import REPO


def settings_for(argv: list[str]) -> Settings:
    return settings_from_args(build_parser().parse_args(argv))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVROUTE_* variable of the developer's shell leaks into these tests."""
    import os

    for key in list(os.environ):
        if key.startswith("KVROUTE_"):
            monkeypatch.delenv(key)


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvroute.yaml"
    path.write_text(text)
    return path


def test_precedence_is_flags_then_env_then_file_then_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, "port: 1001\npolicy: random\nhealth-interval-s: 7\n")
    assert settings_for([]).port == 8000
    assert settings_for(["--config", str(config)]).port == 1001
    monkeypatch.setenv("KVROUTE_PORT", "1002")
    from_env = settings_for(["--config", str(config)])
    assert from_env.port == 1002
    assert from_env.policy == "random"  # untouched by env: still the file's
    from_flags = settings_for(["--config", str(config), "--port", "1003"])
    assert from_flags.port == 1003
    assert from_flags.health_interval_s == 7.0
    assert from_flags.policy == "random"  # a flag not given does not override the file


def test_backends_flags_and_per_backend_kv_events_endpoints() -> None:
    settings = settings_for(
        [
            "--backend",
            "http://a:8000/",
            "--backend",
            "http://b:8000",
            "--kv-events-endpoint",
            "http://b:8000=tcp://b:5557",
            "--kv-events-replay-endpoint",
            "http://b:8000=tcp://b:5558",
        ]
    )
    assert [b.url for b in settings.backends] == ["http://a:8000", "http://b:8000"]
    assert [b.kv_events_endpoint for b in settings.backends] == [None, "tcp://b:5557"]
    assert [b.kv_events_replay_endpoint for b in settings.backends] == [None, "tcp://b:5558"]


def test_kv_events_endpoint_of_an_unknown_backend_is_an_error() -> None:
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        settings_for(["--backend", "http://a:8000", "--kv-events-endpoint", "http://zzz:1=tcp://z:1"])


def test_typed_flags_are_converted_by_the_settings_model() -> None:
    settings = settings_for(
        [
            "--allow-policy-header",
            "--no-decision-log",
            "--ab",
            "cache_aware=80,round_robin=20",
            "--api-keys",
            "k1, k2",
            "--drain-timeout-s",
            "2.5",
            "--block-size",
            "32",
            "--admin-token",
            "secret",
            "--backend-api-key",
            "engine-key",
            "--log-level",
            "debug",
            "--kv-events",
            "--kv-events-port",
            "5557",
            "--tokenizer",
            "/models/x",
            "--chat-template",
            "/models/x/tool_use.jinja",
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--trust-request-chat-template",
        ]
    )
    assert settings.allow_policy_header is True
    assert settings.decision_log is False
    assert settings.ab == {"cache_aware": 80, "round_robin": 20}
    assert settings.api_keys == ["k1", "k2"]
    assert settings.drain_timeout_s == 2.5
    assert settings.block_size == 32
    assert settings.admin_token == "secret"
    assert settings.backend_api_key == "engine-key"
    assert settings.log_level == "debug"
    assert settings.kv_events is True and settings.kv_events_port == 5557
    assert settings.tokenizer == "/models/x"
    assert settings.chat_template == "/models/x/tool_use.jinja"
    assert settings.default_chat_template_kwargs == {"enable_thinking": False}
    assert settings.trust_request_chat_template is True


def test_every_tunable_settings_field_has_a_kebab_case_flag() -> None:
    options = {option for action in build_parser()._actions for option in action.option_strings}
    for name in Settings.model_fields:
        if name in ("backends", "models"):
            continue
        assert "--" + name.replace("_", "-") in options, name
    assert {"--backend", "--config", "--kv-events-endpoint"} <= options


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--port", "70000"], "port"),
        (["--health-interval-s", "-1"], "health_interval_s"),
        (["--ab", "cache_aware=x"], "ab"),
        (["--backend", "ftp://nope"], "backends"),
        (["--unhealthy-after", "zero"], "unhealthy_after"),
    ],
)
def test_invalid_config_exits_2_naming_the_field(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert field in capsys.readouterr().err


def test_invalid_value_in_the_file_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "overload_factor: 0.5\n")
    assert main(["--config", str(config)]) == 2
    assert "overload_factor" in capsys.readouterr().err


def test_unknown_key_in_the_file_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, "no_such_setting: 1\n")
    assert main(["--config", str(config)]) == 2
    assert "no_such_setting" in capsys.readouterr().err


def test_invalid_env_value_names_the_field(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVROUTE_MAX_BODY_BYTES", "lots")
    assert main([]) == 2
    assert "max_body_bytes" in capsys.readouterr().err


def test_the_installed_command_fails_fast_on_bad_config() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvroute.router.cli", "serve", "--port", "-5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "port" in result.stderr
    assert "Traceback" not in result.stderr


def test_readme_configuration_reference_is_current() -> None:
    """The README's settings table is ``python -m kvroute.router.config``: regenerate it when a
    setting changes, so the documented flags, variables and defaults never drift."""

    from kvroute.router.config import reference_markdown

    readme = (REPO / "README.md").read_text()
    assert reference_markdown() in readme
