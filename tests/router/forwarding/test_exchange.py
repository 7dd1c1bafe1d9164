"""The lean server's request headers (:class:`Headers`): lookups as aiohttp's ``CIMultiDictProxy``."""

from __future__ import annotations

import pytest

from kvroute.router.forwarding.exchange import Headers

RAW = [
    (b"Host", b"router:8000"),
    (b"X-Session-Id", b"first"),
    (b"x-session-id", b"second"),
    (b"X-Note", "caf\u00e9".encode()),
    (b"X-Raw", b"\xff\xfe"),
]


@pytest.mark.parametrize(
    "headers",
    [
        Headers(RAW),
        Headers.from_lowered(
            {b"host": b"router:8000", b"x-session-id": b"first", b"x-note": "caf\u00e9".encode(), b"x-raw": b"\xff\xfe"}
        ),
    ],
)
def test_lookups_ignore_case_and_the_first_repeated_field_wins(headers: Headers) -> None:
    assert headers.get("x-session-id") == headers.get("X-SESSION-ID") == headers["X-Session-Id"] == "first"
    assert headers.get("X-Note") == "caf\u00e9"  # UTF-8, as aiohttp decodes values
    assert headers.get("x-raw") == b"\xff\xfe".decode("utf-8", "surrogateescape")
    assert "HOST" in headers and "authorization" not in headers and 42 not in headers
    assert headers.get("authorization") is None and headers.get("authorization", "none") == "none"
    with pytest.raises(KeyError):
        headers["authorization"]
    assert list(headers) == ["host", "x-session-id", "x-note", "x-raw"] and len(headers) == 4
    assert dict(headers.items())["host"] == "router:8000"


def test_names_no_field_can_have_are_absent() -> None:
    headers = Headers(RAW)
    # Not encodable as latin-1 (no HTTP token has such characters): absent, not an error.
    assert headers.get("x-\u20ac") is None and "x-\u20ac" not in headers
    with pytest.raises(KeyError):
        headers["x-\u20ac"]
    # str.lower maps the Kelvin sign to an ASCII "k", as the lookups before did.
    assert Headers([(b"k", b"v")]).get("\u212a") == "v"
