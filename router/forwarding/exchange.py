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

from kvroute.router.errors import OPENAI_ERRORS, ErrorTypes, RouterError

RawHeaders = Sequence[tuple[bytes, bytes]]
#: A response's header fields, as bytes: the engine's are relayed without decoding them.
ResponseHeaders = list[tuple[bytes, bytes]]
#: Reads a body that had not fully arrived with the request head (size limit and read
#: timeout applied: :func:`body_too_large` or :func:`body_timeout` are raised).
BodyReader = Callable[[], Awaitable[bytes]]


class Headers(Mapping[str, str]):
    """A request's header fields with case-insensitive lookups; the first of repeated names wins
    (as ``CIMultiDict.get``). Values are decoded as aiohttp decodes them (UTF-8, surrogateescape).

    Kept as the raw bytes, by lower-case name, and decoded when looked up: a proxied request's
    headers are read a few times (request id, session, policy header), mostly for names it
    does not have, so decoding every field up front is work nearly always thrown away.
    """

    __slots__ = ("_by_name",)

    def __init__(self, raw: RawHeaders) -> None:
        by_name: dict[bytes, bytes] = {}
        for name, value in raw:
            by_name.setdefault(name.lower(), value)
        self._by_name = by_name

    @classmethod
    def from_lowered(cls, by_name: dict[bytes, bytes]) -> Headers:
        """Headers from fields already collected by lower-case name (first occurrence kept);
        ``by_name`` is taken, not copied. Names are HTTP tokens (ASCII), as llhttp checks."""
        headers = cls.__new__(cls)
        headers._by_name = by_name
        return headers

    @staticmethod
    def _key(name: str) -> bytes | None:
        try:
            return name.lower().encode("latin-1")
        except UnicodeEncodeError:
            return None  # no field name (an HTTP token) has such a character

    def __getitem__(self, name: str) -> str:
        value = self._by_name.get(self._key(name))  # type: ignore[arg-type]
        if value is None:
            raise KeyError(name)
        return value.decode("utf-8", "surrogateescape")

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        try:  # _key inline: this is the lookup of every request
            key = name.lower().encode("latin-1")
        except UnicodeEncodeError:
            return default
        value = self._by_name.get(key)
        return default if value is None else value.decode("utf-8", "surrogateescape")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._key(name) in self._by_name

    def __iter__(self) -> Iterator[str]:
        return (name.decode("latin-1") for name in self._by_name)

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


def send_error(
    sink: ResponseSink, error: RouterError, *, request_id: str | None = None, types: ErrorTypes = OPENAI_ERRORS
) -> None:
    """Answer ``error`` as OpenAI-style JSON, its ``type`` one of ``types`` (closing the
    connection if it says so)."""
    headers = error.answer_headers()
    if request_id is not None:
        headers.append((b"x-request-id", request_id.encode()))
    sink.send(error.status, headers, error.body(types), close=error.close)


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
