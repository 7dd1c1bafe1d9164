"""The fleet's key pair for the peer exchange, derived from a shared secret file."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from kvroute.router.config import ConfigError, load_settings
from kvroute.router.peer_key import MIN_SECRET_CHARS, PeerKey

SECRET = "q2Vx7RkN0pLr9TgH4sWm1ZcYb8FdJ6Ua"


def test_the_same_text_gives_every_router_the_same_curve_pair() -> None:
    key = PeerKey.from_text(SECRET)
    assert PeerKey.from_text(f"  {SECRET}\n") == key  # a Secret's file may end in a newline
    assert PeerKey.from_text(SECRET + "x") != key
    assert len(key.public) == len(key.secret) == 40  # Z85 of 32 bytes, as ZMQ's CURVE options take them
    assert zmq.curve_public(key.secret) == key.public


def test_a_short_or_unreadable_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_CHARS} characters"):
        PeerKey.from_text("x" * (MIN_SECRET_CHARS - 1) + "\n")
    with pytest.raises(ValueError, match="cannot read the peer secret file"):
        PeerKey.read(tmp_path / "missing")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe" * 40)
    with pytest.raises(ValueError, match="cannot read"):
        PeerKey.read(binary)


def test_the_secret_never_shows_in_its_repr() -> None:
    key = PeerKey.from_text(SECRET)
    assert key.secret.decode() not in repr(key) and SECRET not in repr(key)
    assert key.public.decode() in repr(key)


def test_settings_check_the_secret_file_at_start(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("too short\n")
    with pytest.raises(ConfigError, match="at least 32 characters"):
        load_settings({"backends": ["http://127.0.0.1:9"], "peer_secret_file": short})
    good = tmp_path / "secret"
    good.write_text(SECRET)
    assert load_settings({"backends": ["http://127.0.0.1:9"], "peer_secret_file": good}).peer_secret_file == good


def test_an_accepted_secret_needs_the_secret_and_is_checked_at_start(tmp_path: Path) -> None:
    good = tmp_path / "secret"
    good.write_text(SECRET)
    other = tmp_path / "next"
    other.write_text(SECRET[::-1])
    with pytest.raises(ConfigError, match="needs peer_secret_file"):
        load_settings({"backends": ["http://127.0.0.1:9"], "peer_accepted_secret_file": other})
    short = tmp_path / "short"
    short.write_text("too short\n")
    with pytest.raises(ConfigError, match="at least 32 characters"):
        load_settings(
            {"backends": ["http://127.0.0.1:9"], "peer_secret_file": good, "peer_accepted_secret_file": short}
        )
    settings = load_settings(
        {"backends": ["http://127.0.0.1:9"], "peer_secret_file": good, "peer_accepted_secret_file": other}
    )
    assert settings.peer_accepted_key() == PeerKey.from_text(SECRET[::-1]) != settings.peer_key()
