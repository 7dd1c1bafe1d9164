"""Engine responses, well-formed and malformed, and a differential check of kvroute's parser.

One generator serves the hypothesis test (``tests/router/forwarding/test_upstream_differential.py``, 10^4
cases) and the fuzz run (``benchmarks/fuzz_upstream.py``, 10^6): it draws through a
:class:`Draw`, which hypothesis or a seeded ``random.Random`` implements.

:func:`check` feeds a case's bytes, cut at its random boundaries, to the response side of
``kvroute.router.forwarding.upstream._Connection`` (the parser is the subject: its ``data_received`` is driven
directly, over a stand-in transport) and to h11, the reference, and compares the verdicts:
accepted or rejected and, when accepted, the status, the headers, the body bytes delivered
and whether the connection may carry the next request.

Where the issue asks for more than RFC 9112 makes h11 enforce, kvroute is stricter on
purpose; a case that carries such a feature (:data:`STRICTER`) must be rejected by kvroute,
whatever h11 says. Cases with random byte flips are checked one way only: kvroute never
accepts what h11 rejects, and agrees with it on whatever both accept.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Protocol, TypeVar

import h11

from kvroute.router.forwarding.upstream import MAX_HEAD_BYTES, UpstreamError, _Connection

T = TypeVar("T")

#: Features kvroute rejects on purpose although h11 accepts (some of) them.
STRICTER = {
    "content-length with chunked": "RFC 9112 6.3: 'ought to be handled as an error' (smuggling)",
    "repeated content-length": "llhttp refuses any second Content-Length, even an equal one",
    "content-length list": "llhttp refuses '3, 3' (h11 folds equal values)",
    "http version": "only HTTP/1.0 and 1.1 (h11 takes any digit.digit)",
    "obs-fold": "obsolete line folding, deprecated by RFC 9112 5.2",
    "bare LF": "line ends without CR (h11 accepts them)",
    "control character": "CTL bytes in a field value (h11 accepts all but NUL, CR, LF)",
    "chunk extension": "a chunk extension outside the RFC grammar (h11 skips anything after ';')",
    "chunk size whitespace": "whitespace after a chunk size without an extension (h11 allows it)",
}

_SAFE = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.~!#$%&'*+^`|/=:;,()[]{}<>?@ "
_TO_SAFE = bytes(_SAFE[byte % len(_SAFE)] for byte in range(256))  # any octet -> a field-value character
_NAMES = (b"Content-Type", b"Server", b"Date", b"X-Request-Id", b"Cache-Control", b"Vary", b"x-empty")
_INTERIMS = (100, 102, 103)
_STATUSES = (200, 200, 200, 201, 204, 304, 400, 404, 429, 500, 503, 999)
_REASONS = (b" OK", b" ", b"", b" Some Reason", b" Gr\xfc\xdfe")
_CONNECTION = (None, None, None, b"close", b"keep-alive", b"Keep-Alive", b"CLOSE", b"keep-alive, close", b"upgrade")
_EXTENSIONS = (b";a", b";a=b", b';name="quoted value"', b";a=1;b=2")


class Draw(Protocol):
    """A source of choices: hypothesis (it shrinks) or a seeded ``random.Random`` (it is fast)."""

    def integer(self, low: int, high: int) -> int: ...

    def octets(self, size: int) -> bytes: ...


def choice(draw: Draw, options: Sequence[T]) -> T:
    return options[draw.integer(0, len(options) - 1)]


def chance(draw: Draw, percent: int) -> bool:
    return draw.integer(0, 99) < percent


class RandomDraw:
    """:class:`Draw` over ``random.Random`` (the fuzz run)."""

    def __init__(self, seed: int) -> None:
        self._random = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self._random.randint(low, high)

    def octets(self, size: int) -> bytes:
        return self._random.randbytes(size)


@dataclass
class Case:
    raw: bytes
    cuts: tuple[int, ...]
    tags: list[str] = field(default_factory=list)  # what went in, for the fuzz report
    stricter: list[str] = field(default_factory=list)  # STRICTER keys present
    flipped: bool = False

    def pieces(self) -> list[bytes]:
        size = len(self.raw)
        bounds = [0, *sorted({cut for cut in self.cuts if 0 < cut < size}), size]
        return [self.raw[a:b] for a, b in pairwise(bounds) if b > a]


class _Builder:
    """Collects the tags of a case while it is drawn."""

    def __init__(self, draw: Draw) -> None:
        self.draw = draw
        self.tags: list[str] = []
        self.stricter: list[str] = []

    def maybe(self, percent: int, tag: str, *, stricter: str | None = None) -> bool:
        if not chance(self.draw, percent):
            return False
        self.tags.append(tag)
        if stricter is not None:
            self.stricter.append(stricter)
        return True


def draw_case(draw: Draw) -> Case:
    """One engine response (after zero or more interim ones), as bytes and cut points."""
    b = _Builder(draw)
    eol = b"\n" if b.maybe(2, "bare LF", stricter="bare LF") else b"\r\n"
    out = bytearray()
    if b.maybe(2, "leading blank line"):
        out += b"\r\n"
    for _ in range(draw.integer(1, 2) if b.maybe(10, "interim") else 0):
        out += b"HTTP/1.1 %d Interim" % choice(draw, _INTERIMS) + eol
        if chance(draw, 50):
            out += b"Link: </style.css>; rel=preload" + eol
        out += eol
    status_line, status = _status_line(b, eol)
    out += status_line
    body = _body(draw)
    headers, payload = _framing(b, body, status, eol)
    headers += _other_headers(b, eol)
    order = sorted(range(len(headers)), key=lambda _: draw.integer(0, 1000))
    for index in order:
        out += headers[index]
    out += eol + payload
    out += _after(b)
    raw = bytes(out)
    if b.maybe(8, "truncated") and raw:
        raw = raw[: draw.integer(0, len(raw) - 1)]
    flipped = b.maybe(5, "flipped")
    if flipped and raw:
        mutable = bytearray(raw)
        for _ in range(draw.integer(1, 3)):
            mutable[draw.integer(0, len(mutable) - 1)] = draw.integer(0, 255)
        raw = bytes(mutable)
    cuts = tuple(draw.integer(0, len(raw)) for _ in range(draw.integer(0, 6)))
    return Case(raw, cuts, b.tags, b.stricter, flipped)


def _status_line(b: _Builder, eol: bytes) -> tuple[bytes, int]:
    draw = b.draw
    version = b"1.1"
    if b.maybe(10, "HTTP/1.0"):
        version = b"1.0"
    elif b.maybe(2, "HTTP/2.0", stricter="http version"):
        version = b"2.0"
    status = choice(draw, _STATUSES)
    code = b"%d" % status
    if b.maybe(2, "status 0xx"):
        code = b"099"
    elif b.maybe(2, "two-digit status"):
        code = b"20"
    elif b.maybe(1, "garbage status line"):
        return draw.octets(draw.integer(0, 20)) + eol, status
    return b"HTTP/" + version + b" " + code + choice(draw, _REASONS) + eol, status


def _body(draw: Draw) -> bytes:
    size = draw.integer(0, 64) if chance(draw, 70) else draw.integer(0, 3000)
    return draw.octets(size)


def _framing(b: _Builder, body: bytes, status: int, eol: bytes) -> tuple[list[bytes], bytes]:
    """The framing headers and the payload that follows the head."""
    draw = b.draw
    kind = choice(draw, ("length", "length", "chunked", "chunked", "close"))
    if kind == "close":
        b.tags.append("close-delimited")
        return [], body
    if kind == "length":
        b.tags.append("content-length")
        return _content_length(b, body, eol)
    b.tags.append("chunked")
    headers = [b"Transfer-Encoding: " + _codings(b) + eol]
    if b.maybe(3, "content-length with chunked", stricter="content-length with chunked"):
        headers.append(b"Content-Length: %d" % len(body) + eol)
    if status in (204, 304):
        return headers, b""
    return headers, _chunks(b, body, eol)


def _content_length(b: _Builder, body: bytes, eol: bytes) -> tuple[list[bytes], bytes]:
    draw = b.draw
    length = b"%d" % len(body)
    if b.maybe(3, "content-length too long"):
        length = b"%d" % (len(body) + draw.integer(1, 10))
    elif b.maybe(3, "content-length too short"):
        length = b"%d" % max(0, len(body) - draw.integer(1, 10))
    elif b.maybe(3, "content-length leading zeros"):
        length = b"00" + length
    elif b.maybe(5, "bad content-length"):
        length = choice(draw, (b"+" + length, b"-1", b"0x1", length + b"a", b"", b"1" * 25, length + b" " + length))
    headers = [b"Content-Length: " + length + eol]
    if b.maybe(3, "repeated content-length", stricter="repeated content-length"):
        headers.append(b"Content-Length: " + length + eol)
    elif b.maybe(3, "conflicting content-length"):
        headers.append(b"Content-Length: " + length + b"1" + eol)  # never the same value
    elif b.maybe(2, "content-length list", stricter="content-length list"):
        headers[0] = b"Content-Length: " + length + b", " + length + eol
    return headers, body


def _codings(b: _Builder) -> bytes:
    draw = b.draw
    if b.maybe(6, "other transfer coding"):
        return choice(draw, (b"gzip", b"chunked, gzip", b"gzip, chunked", b"identity", b"chunked, chunked", b"x"))
    return choice(draw, (b"chunked", b"chunked", b"Chunked", b"CHUNKED", b"  chunked  "))


def _chunks(b: _Builder, body: bytes, eol: bytes) -> bytes:
    draw = b.draw
    out = bytearray()
    position = 0
    while position < len(body):
        size = min(len(body) - position, draw.integer(1, 700))
        out += _chunk_size(b, size)
        if b.maybe(5, "chunk extension"):
            out += choice(draw, _EXTENSIONS)
        if b.maybe(1, "bad chunk extension", stricter="chunk extension"):
            out += b";a\x01"
        out += eol + body[position : position + size]
        position += size
        if b.maybe(1, "no CRLF after chunk data"):
            out += choice(draw, (b"", b"XY", b"\r", b"\n\r"))
        else:
            out += eol
    out += b"0" * draw.integer(1, 3)
    if b.maybe(5, "last-chunk extension"):
        out += choice(draw, _EXTENSIONS)
    out += eol
    if b.maybe(8, "trailers"):
        out += b"X-Trailer: done" + eol
        if chance(draw, 30):
            out += b"Server-Timing: total;dur=12" + eol
    if b.maybe(1, "bad trailer"):
        out += b"Bad Trailer Line" + eol
    out += eol
    return bytes(out)


def _chunk_size(b: _Builder, size: int) -> bytes:
    draw = b.draw
    if b.maybe(1, "negative chunk size"):
        return b"-%x" % size
    if b.maybe(1, "bad chunk size"):
        return choice(draw, (b"%xg" % size, b"0x%x" % size, b" %x" % size, b"", b"f" * 17))
    if b.maybe(1, "chunk size whitespace", stricter="chunk size whitespace"):
        return b"%x " % size
    digits = b"%X" % size if chance(draw, 20) else b"%x" % size
    return b"0" * draw.integer(0, 2) + digits


def _other_headers(b: _Builder, eol: bytes) -> list[bytes]:
    draw = b.draw
    headers = []
    for _ in range(draw.integer(0, 5)):
        name = choice(draw, _NAMES)
        value = draw.octets(draw.integer(0, 20)).translate(_TO_SAFE).strip()
        spaces = choice(draw, (b" ", b"", b"  ", b"\t"))
        headers.append(name + b":" + spaces + value + choice(draw, (b"", b" ", b"\t ")) + eol)
    connection = choice(draw, _CONNECTION)
    if connection is not None:
        b.tags.append("connection header")
        headers.append(b"Connection: " + connection + eol)
    if b.maybe(2, "obs-fold", stricter="obs-fold"):
        headers.append(b"X-Folded: one" + eol + b" two" + eol)
    if b.maybe(2, "control character", stricter="control character"):
        headers.append(b"X-Ctl: a" + bytes([choice(draw, (1, 8, 27, 127))]) + b"b" + eol)
    if b.maybe(1, "NUL in a field value"):
        headers.append(b"X-Nul: a\x00b" + eol)
    if b.maybe(1, "header line without colon"):
        headers.append(b"no colon here" + eol)
    if b.maybe(1, "space before colon"):
        headers.append(b"X-Space : a" + eol)
    if b.maybe(2, "obs-text field value"):
        headers.append(b"X-Latin: caf\xe9" + eol)
    return headers


def _after(b: _Builder) -> bytes:
    """What follows the response on the wire: nothing, mostly."""
    draw = b.draw
    if b.maybe(3, "blank lines after"):
        return choice(draw, (b"\r\n", b"\r\n\r\n", b"\n"))
    if b.maybe(3, "unsolicited 408 after"):
        return b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    if b.maybe(3, "garbage after"):
        return draw.octets(draw.integer(1, 30))
    return b""


# --- the two parsers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    status: int = 0
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    reusable: bool = False
    reason: str = ""


class _Pending:
    """A future nobody resolves: awaiting it means the read would wait for more bytes."""

    def done(self) -> bool:
        return False

    def set_result(self, result: object) -> None:
        pass

    def __await__(self) -> Any:
        yield self


class _Handle:
    def cancel(self) -> None:
        pass


class _StillLoop:
    """What ``_Connection`` asks of its loop, with time standing still (no timer ever fires)."""

    def time(self) -> float:
        return 0.0

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Handle:
        return _Handle()

    def create_future(self) -> _Pending:
        return _Pending()


class Wire:
    """The transport: records writes, closes, and pauses."""

    def __init__(self) -> None:
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


STILL_LOOP = _StillLoop()
_REQUEST_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Length: 2\r\n\r\n"


def read_now(connection: _Connection) -> bytes | None:
    """``read_available`` when it would not wait: the bytes (b"" at the end), or None."""
    reading = connection.read_available()
    try:
        reading.send(None)
    except StopIteration as done:
        return done.value
    reading.close()
    return None


def kvroute_verdict(case: Case) -> Verdict:
    connection = _Connection(STILL_LOOP)  # type: ignore[arg-type]
    wire = Wire()
    connection.connection_made(wire)  # type: ignore[arg-type]
    connection.send(_REQUEST_HEAD, b"{}", 60.0)
    body = bytearray()
    ended = False
    reusable = False
    try:
        for piece in case.pieces():
            if wire.closed:
                break  # the loop delivers nothing more to a closed transport
            connection.data_received(piece)
            while data := read_now(connection):
                body += data
            if data == b"":
                ended = True
        reusable = connection.reusable()
        if not wire.closed:
            connection.eof_received()
        connection.connection_lost(None)
        while not ended:
            data = read_now(connection)
            assert data is not None, "a closed connection must never leave a read waiting"
            if not data:
                ended = True
            body += data
    except UpstreamError as error:
        return Verdict(False, reason=str(error))
    headers = tuple(
        (name, value.lower() if name.lower() == b"transfer-encoding" else value) for name, value in connection.headers
    )
    return Verdict(True, connection.status, headers, bytes(body), reusable)


def h11_verdict(case: Case) -> Verdict:
    client = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    client.send(
        h11.Request(method="POST", target="/v1/chat/completions", headers=[("Host", "engine"), ("Content-Length", "2")])
    )
    client.send(h11.Data(data=b"{}"))
    client.send(h11.EndOfMessage())
    response: h11.Response | None = None
    body = bytearray()
    done = False
    clean_end = False  # nothing after the message but blank lines, within its last piece
    later = False  # bytes in a later piece
    try:
        for piece in case.pieces():
            if done:
                later = True
                continue
            client.receive_data(piece)
            done, response = _pump(client, body, response)
            if done:
                clean_end = not client.trailing_data[0].strip(b"\r\n")
        reusable = done and clean_end and not later and client.their_state is h11.DONE
        if not done:
            client.receive_data(b"")
            done, response = _pump(client, body, response)
    except h11.RemoteProtocolError as error:
        return Verdict(False, reason=str(error))
    if not done or response is None:
        return Verdict(False, reason="incomplete")
    # h11 lower-cases the Transfer-Encoding value it checked; kvroute relays it as sent.
    headers = tuple(
        (name, value.lower() if name.lower() == b"transfer-encoding" else value)
        for name, value in response.headers.raw_items()
    )
    return Verdict(True, response.status_code, headers, bytes(body), reusable)


def _pump(client: h11.Connection, body: bytearray, response: h11.Response | None) -> tuple[bool, h11.Response | None]:
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            return False, response
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return True, response


def check(case: Case) -> str | None:
    """None when kvroute's verdict is the one required, else what differs."""
    return judge(case)[1]


def judge(case: Case) -> tuple[Verdict, str | None]:
    """kvroute's verdict, and what differs from the required one (None when nothing)."""
    ours = kvroute_verdict(case)
    return ours, _difference(case, ours, h11_verdict(case))


def _difference(case: Case, ours: Verdict, reference: Verdict) -> str | None:
    if case.stricter and not case.flipped and ours.accepted:
        return f"accepted despite {case.stricter}: {ours}"
    if ours.accepted and not reference.accepted:
        return f"kvroute accepted what h11 rejects ({reference.reason}): {ours}"
    if ours.accepted and ours != reference:
        return f"both accepted, but kvroute {ours} != h11 {reference}"
    if not (case.stricter or case.flipped) and reference.accepted and not ours.accepted:
        return f"kvroute rejected ({ours.reason}) what h11 accepts: {reference}"
    return None
