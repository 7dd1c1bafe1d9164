"""Security: who gets in, how fast, what reaches the engines, and what never reaches the logs."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from router.security import SecretRedactor, TokenBucketLimiter


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
    record = logging.LogRecord("kvroute", logging.DEBUG, __file__, 1, message, args,
                               (type(exc), exc, exc.__traceback__) if exc else None)
    assert redactor.filter(record)
    return logging.Formatter("%(message)s").format(record)


def test_redactor_blanks_secrets_tokens_and_url_credentials() -> None:
    redactor = SecretRedactor(["admin-s3cret-token", "sk-client-key-1", "x"])
    line = _formatted(
        redactor, "auth %s from %s to %s key=%s", "Bearer sk-unknown-token", "admin-s3cret-token",
        "http://user:pa55word@10.0.0.5:8000/v1", "sk-client-key-1",
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
