"""Who may use the router, how fast, and keeping their secrets out of the logs.

* :class:`ClientGate` checks a client before any work is done for it: its bearer token
  against ``api_keys`` (when configured; compared in constant time with every key) and
  its request rate against ``rate_limit_rps`` (a token bucket per client key: the API key
  when clients authenticate, else the peer address). Failures are OpenAI-style 401 and
  429 (with ``Retry-After``). ``/health``, ``/metrics`` and ``/openapi.json`` never ask.
* :class:`SecretRedactor` is a logging filter that removes every configured secret (admin
  token, client API keys, engine API keys), bearer tokens and credentials in URLs from
  log records, tracebacks included, whatever the log level.

What reaches the engines is decided in :mod:`kvroute.router.forwarding.proxy`: hop-by-hop headers and
client ``x-kvroute-*`` headers are stripped there, and the client's ``Authorization`` is
replaced by the backend's API key when one is configured.
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kvroute.router.config import Settings
from kvroute.router.errors import RouterError

#: Buckets kept at most; the least recently seen client's is dropped first (it then
#: starts again with a full bucket, which is what an idle client would have anyway).
MAX_TRACKED_CLIENTS = 65_536
#: Configured secrets shorter than this are not searched for in log lines (a one-letter
#: "secret" would blank out every occurrence of that letter); bearer tokens still are.
MIN_REDACTED_SECRET_LEN = 6
REDACTED = "***"


class Client(Protocol):
    """What the gate reads of a request: aiohttp's ``web.Request`` and the proxy's
    ``ClientRequest`` (:mod:`kvroute.router.forwarding.exchange`) both have it."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def remote(self) -> str | None: ...


def bearer_token(request: Client) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if there is one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class TokenBucketLimiter:
    """Per-key token buckets: ``rate`` requests per second, bursts of one second's worth (at least one)."""

    def __init__(
        self,
        rate: float,
        *,
        max_keys: int = MAX_TRACKED_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        self.rate = rate
        self.burst = max(1.0, rate)
        self._max_keys = max_keys
        self._clock = clock
        # key -> (tokens left, when they were counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """Spend one token of ``key``'s bucket: 0.0 if allowed, else seconds until one is there."""
        now = self._clock()
        buckets = self._buckets
        entry = buckets.get(key)
        if entry is None:
            tokens = self.burst
            if len(buckets) >= self._max_keys:
                buckets.popitem(last=False)
        else:
            left, counted_at = entry
            tokens = min(self.burst, left + (now - counted_at) * self.rate)
            buckets.move_to_end(key)
        if tokens >= 1.0:
            buckets[key] = (tokens - 1.0, now)
            return 0.0
        buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate


class ClientGate:
    """Authentication and rate limiting of clients; one per application."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._api_keys = tuple(key.encode() for key in settings.api_keys)
        self._limiter = (
            TokenBucketLimiter(settings.rate_limit_rps, clock=clock) if settings.rate_limit_rps is not None else None
        )
        #: Requests turned away, by reason (for metrics).
        self.rejected = {"unauthorized": 0, "rate_limited": 0}

    @property
    def active(self) -> bool:
        """Whether there is anything to check."""
        return bool(self._api_keys) or self._limiter is not None

    @property
    def tracked_clients(self) -> int:
        """Clients with a rate-limit bucket now (bounded by ``MAX_TRACKED_CLIENTS``)."""
        return len(self._limiter) if self._limiter is not None else 0

    def check(self, request: Client) -> None:
        """Raise :class:`RouterError` 401 or 429 unless this client may go on."""
        token = bearer_token(request)
        if self._api_keys:
            self._authenticate(token)
        limiter = self._limiter
        if limiter is not None:
            # Authenticated clients are limited per key; otherwise per address, since an
            # unverified token is free to change with every request.
            key = "key:" + token if self._api_keys and token else "addr:" + (request.remote or "")
            wait_s = limiter.take(key)
            if wait_s:
                self.rejected["rate_limited"] += 1
                raise RouterError(
                    429,
                    f"rate limit of {limiter.rate:g} requests/s exceeded; retry in {wait_s:.2f} s",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
                )

    def _authenticate(self, token: str | None) -> None:
        presented = (token or "").encode()
        # Compare with every key without stopping at a match, so timing tells nothing.
        matched = False
        for key in self._api_keys:
            matched |= hmac.compare_digest(presented, key)
        if token is None or not matched:
            self.rejected["unauthorized"] += 1
            raise RouterError(
                401,
                "invalid or missing API key (expected 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )


# --- logs ------------------------------------------------------------------------------
_BEARER = re.compile(r"(?i)\b(bearer)\s+[^\s'\",;]+")
_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]+@")
_KEY_VALUE = re.compile(
    r"(?i)\b(api[_-]?key|admin[_-]?token|authorization|password|secret)(['\"]?\s*[=:]\s*['\"]?)[^\s'\",;}]+"
)


def settings_secrets(settings: Settings) -> list[str]:
    """Every secret in the configuration: admin token, client keys, engine keys."""
    secrets = [settings.admin_token, settings.backend_api_key, *settings.api_keys]
    secrets += [secret for backend in settings.backends for secret in backend.secrets()]
    return [secret for secret in secrets if secret]


class SecretRedactor(logging.Filter):
    """A logging filter that blanks secrets out of messages and tracebacks.

    Attach it to every log handler (:func:`install_redaction`). Secrets added later (an
    engine API key given to the admin API) can be registered with :meth:`add`.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._secrets: set[str] = set()
        for secret in secrets:
            self.add(secret)

    def add(self, secret: str | None) -> None:
        """Redact this value from now on (ignored when too short to search for)."""
        if secret and len(secret) >= MIN_REDACTED_SECRET_LEN:
            self._secrets.add(secret)

    def redact(self, text: str) -> str:
        """``text`` with secrets, bearer tokens, URL credentials and ``key=value`` secrets blanked."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        text = _BEARER.sub(r"\1 " + REDACTED, text)
        text = _URL_CREDENTIALS.sub(r"\1" + REDACTED + "@", text)
        return _KEY_VALUE.sub(r"\1\2" + REDACTED, text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        return True


def install_redaction(redactor: SecretRedactor) -> None:
    """Attach ``redactor`` to every handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if redactor not in handler.filters:
            handler.addFilter(redactor)
