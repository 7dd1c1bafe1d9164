"""vLLM's OpenAI-compatible request fields and response shapes, as the simulator speaks them.

Parsing turns a JSON body into a small dataclass or raises :class:`APIError` (rendered as
vLLM's error body). Streaming chunks are assembled from per-request byte templates and
per-token JSON pieces, so a token costs two concatenations rather than a ``json.dumps``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Endpoint = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``."""

    _TYPES = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> bytes:
        error_type = self._TYPES.get(self.status, "APIError")
        return orjson.dumps(
            {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.status}}
        )


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """The fields of a chat or completion request that shape the simulation."""

    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    cache_salt: str | None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, else a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is int):
        raise APIError(400, f"'{name}' has the wrong type", param=name)
    return value


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' must be a non-empty string", param="model")
    return model


def parse_generation(body: dict[str, Any], endpoint: Endpoint) -> GenerationParams:
    """Validate the sampling-independent fields of a generation request."""
    model = require_model(body)
    stream = _optional(body, "stream", bool) or False
    options = _optional(body, "stream_options", dict) or {}
    include_usage = options.get("include_usage") is True
    max_tokens = _optional(body, "max_tokens", int)
    if endpoint == "chat":
        max_tokens = _optional(body, "max_completion_tokens", int) or max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
    n = _optional(body, "n", int)
    if n is not None and n != 1:
        raise APIError(400, "the simulator generates a single choice (n must be 1)", param="n")
    cache_salt = _optional(body, "cache_salt", str)
    if cache_salt == "":
        raise APIError(400, "'cache_salt' must not be empty", param="cache_salt")
    return GenerationParams(endpoint, model, stream, include_usage, max_tokens, cache_salt)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_id(endpoint: Endpoint) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex


def full_response(
    endpoint: Endpoint, response_id: str, model: str, text: str, usage_body: dict[str, Any]
) -> bytes:
    """A non-streaming chat.completion / text_completion body."""
    if endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
        kind = "text_completion"
    return orjson.dumps(
        {
            "id": response_id,
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage_body,
        }
    )


class StreamFormatter:
    """SSE events of one streaming response, built from byte templates."""

    __slots__ = ("_head", "_prefix", "_usage_head", "_endpoint")

    _MIDDLE = b',"logprobs":null,"finish_reason":null}]}\n\n'
    _LAST = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'

    def __init__(self, endpoint: Endpoint, response_id: str, model: str) -> None:
        kind = b"chat.completion.chunk" if endpoint == "chat" else b"text_completion"
        head = (
            b'data: {"id":"' + response_id.encode() + b'","object":"' + kind
            + b'","created":' + str(int(time.time())).encode() + b',"model":' + orjson.dumps(model)
        )  # fmt: skip
        self._endpoint = endpoint
        self._usage_head = head
        if endpoint == "chat":
            self._head = head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""}' + self._MIDDLE
            self._prefix = head + b',"choices":[{"index":0,"delta":{"content":'
        else:
            self._head = b""
            self._prefix = head + b',"choices":[{"index":0,"text":'

    def opening(self) -> bytes:
        """What precedes the first token: the assistant role delta for chat, else nothing."""
        return self._head

    def tokens(self, pieces_json: Iterable[bytes], last_is_final: bool) -> bytes:
        """One event per token; the final token's event carries ``finish_reason``."""
        closing = b"}" if self._endpoint == "chat" else b""
        events = [self._prefix + piece + closing + self._MIDDLE for piece in pieces_json]
        if last_is_final and events:
            events[-1] = events[-1][: -len(self._MIDDLE)] + self._LAST
        return b"".join(events)

    def usage(self, usage_body: dict[str, Any]) -> bytes:
        """The ``include_usage`` chunk: empty choices and the usage object."""
        return self._usage_head + b',"choices":[],"usage":' + orjson.dumps(usage_body) + b"}\n\n"
