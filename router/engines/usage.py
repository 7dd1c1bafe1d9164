"""Reading the engine's ``usage`` (prompt and cached tokens) out of responses.

Where an answer reports them is the endpoint's :class:`UsageFormat`: the OpenAI
endpoints' ``usage`` object (:data:`OPENAI_USAGE`, here) or SGLang's native
``meta_info`` (:mod:`kvroute.router.engines.sglang`). Non-streaming responses carry it in their JSON body. Streams carry it in a final
usage-only chunk (``"choices": []``) when ``stream_options.include_usage`` is set; when
the router set that option itself, :class:`StreamTap` removes that chunk so the client
receives exactly the stream it asked for.

The hot path is :meth:`StreamTap.feed`, called once per upstream chunk: in pass-through
mode it only keeps a reference to the last few KB; in strip mode it cuts the data at the
last event boundary and looks for ``"usage"`` with one substring search (a JSON string
value cannot contain the unescaped ``"usage"``, so only a key matches). Only the rare
events that contain it are parsed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

_USAGE_KEY = b'"usage"'
# Enough to hold a final usage chunk and [DONE] however the stream was cut into reads.
_TAIL_BYTES = 16 * 1024
# An "event" this long without a blank line is not SSE: stop holding it back.
_MAX_PENDING_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts an engine reported for one request (and, for the Responses API, the id
    it answered under, which a later request may continue: ``previous_response_id``)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    response_id: str | None = None


def usage_from_object(obj: Any) -> Usage | None:
    """The usage of a decoded response or stream chunk (OpenAI chat/completions or responses shape)."""
    if not isinstance(obj, dict):
        return None
    answer: Any = obj  # the object the usage belongs to
    usage = obj.get("usage")
    if not isinstance(usage, dict) and obj.get("object") != "response":
        answer = obj.get("response")  # a /v1/responses stream event: the response it reports on
        if not isinstance(answer, dict):
            return None
        usage = answer.get("usage")
    response_id = answer.get("id") if answer.get("object") == "response" else None
    if not isinstance(response_id, str):
        response_id = None
    if not isinstance(usage, dict):
        # A response without usage yet (a background one, queued; a stream's
        # response.created): which replica stores it is still worth knowing.
        return None if response_id is None else Usage(None, None, response_id)
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=prompt if is_count(prompt) else None,
        cached_tokens=cached if is_count(cached) else None,
        response_id=response_id,
    )


@dataclass(frozen=True, slots=True)
class UsageFormat:
    """Where one endpoint's answers report usage.

    ``key`` is the JSON key (quoted, as bytes) present in every event or body that carries
    it: events without it are never parsed. ``read`` turns a decoded body or event into
    :class:`Usage`.
    """

    key: bytes
    read: Callable[[Any], Usage | None]


#: The OpenAI endpoints' ``usage`` object (vLLM, SGLang with ``--enable-cache-report``, others).
OPENAI_USAGE = UsageFormat(_USAGE_KEY, usage_from_object)


def usage_from_body(body: bytes, usage_format: UsageFormat = OPENAI_USAGE) -> Usage | None:
    """The usage of a complete JSON response body; None when it has none or is not JSON."""
    if usage_format.key not in body:
        return None
    try:
        return usage_format.read(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def is_count(value: Any) -> TypeGuard[int]:
    """A token count: a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _event_data(event: bytes) -> Any:
    """The decoded JSON of an SSE event's ``data:`` lines, or None."""
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


def _last_event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in ``data``; -1 when there is none."""
    end = data.rfind(b"\n\n")
    if end >= 0:
        return end + 2
    end = data.rfind(b"\r\n\r\n")
    return end + 4 if end >= 0 else -1


def _split_events(data: bytes) -> list[bytes]:
    """Complete events of ``data``, each with its terminating blank line kept."""
    separator = b"\n\n" if b"\n\n" in data else b"\r\n\r\n"
    parts = data.split(separator)
    events = [part + separator for part in parts[:-1]]
    if parts[-1]:
        events.append(parts[-1])
    return events


class StreamTap:
    """Watches an SSE stream on its way to the client and picks up the engine's usage.

    ``strip_usage_chunk=True`` when the router injected ``include_usage``: complete events
    are forwarded as they arrive, minus the usage-only chunk. Otherwise every chunk passes
    through untouched and the usage is read from the stream's tail at the end (SGLang's
    native streams repeat ``meta_info`` in every event: the last one counts).
    """

    __slots__ = ("_format", "_key", "_pending", "_strip", "_tail", "_tail_bytes", "usage")

    def __init__(self, *, strip_usage_chunk: bool, usage_format: UsageFormat = OPENAI_USAGE) -> None:
        self._strip = strip_usage_chunk
        self._format = usage_format
        self._key = usage_format.key
        self._pending = b""
        self._tail: deque[bytes] = deque()
        self._tail_bytes = 0
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to forward for this upstream chunk (possibly empty)."""
        if not self._strip:
            self._remember(chunk)
            return chunk
        data = self._pending + chunk if self._pending else chunk
        end = _last_event_end(data)
        if end < 0:
            if len(data) > _MAX_PENDING_BYTES:
                self._pending = b""
                return data
            self._pending = data
            return b""
        if end == len(data):
            complete, self._pending = data, b""
        else:
            complete, self._pending = data[:end], data[end:]
        if self._key not in complete:
            return complete
        return self._without_usage_chunk(complete)

    def finish(self) -> bytes:
        """Call at the end of the stream: returns what is still held back to forward."""
        if self._strip:
            rest, self._pending = self._pending, b""
            return rest
        self._usage_from_tail()
        return b""

    def _remember(self, chunk: bytes) -> None:
        tail = self._tail
        tail.append(chunk)
        self._tail_bytes += len(chunk)
        while self._tail_bytes - len(tail[0]) >= _TAIL_BYTES:
            self._tail_bytes -= len(tail.popleft())

    def _usage_from_tail(self) -> None:
        data = b"".join(self._tail)
        self._tail.clear()
        key = self._key
        if key not in data:
            return
        for event in reversed(_split_events(data)):
            if key in event:
                usage = self._format.read(_event_data(event))
                if usage is not None:
                    self.usage = usage
                    return

    def _without_usage_chunk(self, complete: bytes) -> bytes:
        kept: list[bytes] = []
        for event in _split_events(complete):
            if self._key in event:
                payload = _event_data(event)
                usage = self._format.read(payload)
                if usage is not None:
                    self.usage = usage
                    if payload.get("choices") == []:
                        continue  # the chunk the router asked for: not the client's
            kept.append(event)
        return b"".join(kept)
