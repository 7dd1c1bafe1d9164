"""The seam between an HTTP server and the proxy: a client's request as the proxy reads it,
and the sink its answer goes to.

Two servers serve the proxied endpoints: aiohttp (``kvroute.router.http.app``) and the lean
llhttp server (``kvroute.router.http.lean_server``). Each turns its own request into a
:class:`ClientRequest` and implements :class:`ResponseSink`, so the proxy's logic (gate,
body, routing, retries, relay) exists once and does not know which server it runs under.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvroute.router.errors import RouterError

RawHeaders = Sequence[tuple[bytes, bytes]]
#: A response's header fields, as bytes: the engine's are relayed without decoding them.
ResponseHeaders = list[tuple[bytes, bytes]]
#: Reads a body that had not fully arrived with the request head (size limit and read
#: timeout applied: :func:`body_too_large` or :func:`body_timeout` are raised).
BodyReader = Callable[[], Awaitable[bytes]]


class Headers(Mapping[str, str]):
    """A request's header fields with case-insensitive lookups; the first of repeated names wins
    (as ``CIMultiDict.get``). Values are decoded as aiohttp decodes them (UTF-8, surrogateescape)."""

    __slots__ = ("_by_name",)

    def __init__(self, raw: RawHeaders) -> None:
        by_name: dict[str, str] = {}
        for name, value in reversed(raw):  # reversed: the first occurrence is written last and wins
            by_name[name.decode("latin-1").lower()] = value.decode("utf-8", "surrogateescape")
        self._by_name = by_name

    def __getitem__(self, name: str) -> str:
        return self._by_name[name.lower()]

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return self._by_name.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


@dataclass(slots=True)
class ClientRequest:
    """One request to a proxied endpoint, as the proxy reads it, whichever server received it."""

    method: str
    #: The request target as sent (path and query), forwarded to the engine unchanged.
    raw_path: str
    #: Case-insensitive ``get`` and ``in`` (aiohttp's ``CIMultiDictProxy`` or :class:`Headers`).
    headers: Mapping[str, str]
    #: The header fields as received, for forwarding byte for byte.
    raw_headers: RawHeaders
    #: The peer's address (rate limiting by address), if known.
    remote: str | None
    #: The whole body when it arrived with the head (nearly always), else how to read it.
    body: bytes | BodyReader


class ResponseSink(Protocol):
    """Where the proxy's answer to one request goes: either one :meth:`send`, or
    :meth:`start`, any number of :meth:`write` and :meth:`end`.

    The server adds what HTTP/1.1 framing needs (``Content-Length`` or chunked coding,
    ``Date``, ``Server``, ``Connection``, a default ``Content-Type``) as aiohttp does.
    """

    def send(self, status: int, headers: ResponseHeaders, body: bytes, *, close: bool = False) -> None:
        """A whole answer; ``close``: close the connection after it (the request was not read whole)."""

    async def start(self, status: int, headers: ResponseHeaders) -> None:
        """The head of a streamed answer (it may go out with the first chunk)."""

    async def write(self, chunk: bytes) -> None:
        """One chunk of a streamed answer; waits while the client reads slower than the engine
        sends. Raises ``ConnectionResetError`` once the client is gone."""

    async def end(self) -> None:
        """The end of a streamed answer."""


def send_error(sink: ResponseSink, error: RouterError, *, request_id: str | None = None) -> None:
    """Answer ``error`` as OpenAI-style JSON (closing the connection if it says so)."""
    headers = error.answer_headers()
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    sink.send(error.status, headers, error.body(), close=error.close)


def body_too_large(limit: int, length: int | None = None) -> RouterError:
    """413 for a body over ``max_body_bytes``; the connection closes rather than read the rest."""
    if length is not None:
        message = f"request body of {length} bytes is over the limit of {limit}"
    else:
        message = f"request body is over the limit of {limit} bytes"
    return RouterError(413, message, code="request_too_large", close=True)


def body_timeout(timeout_s: float) -> RouterError:
    """408 for a body that did not arrive within ``request_read_timeout_s``."""
    return RouterError(
        408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout", close=True
    )
