"""vLLM's OpenAI-compatible error and response shapes, as the simulator speaks them.

Requests are validated in :mod:`.validation`. Streaming chunks are assembled from
per-request byte templates and per-token JSON pieces, so a token costs two concatenations
rather than a ``json.dumps``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal

import orjson

#: The OpenAI generation API a request came in on: /v1/chat/completions or /v1/completions.
GenerationApi = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"
MAX_ECHOED_CHARS = 200


class APIError(Exception):
    """An error the client gets as ``{"error": {"message", "type", "param", "code"}}``.

    ``type`` follows the status (``BadRequestError`` for 400...) unless ``error_type`` says
    otherwise: vLLM answers a request that fails its pydantic model with ``"Bad Request"``.
    """

    _TYPES: ClassVar[dict[int, str]] = {
        400: "BadRequestError",
        404: "NotFoundError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type or self._TYPES.get(status, "APIError")

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}
        )


def summarize(value: Any) -> str:
    """A size-bounded stand-in for an offending value: a huge input is never echoed back."""
    if isinstance(value, list | tuple | dict | set):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= MAX_ECHOED_CHARS else text[:MAX_ECHOED_CHARS] + "...[truncated]"


def field_error(loc: str, kind: str, text: str, value: Any) -> APIError:
    """vLLM's answer to a body failing its request model at one place: ``"Bad Request"``, param ``loc``."""
    entry = {"type": kind, "loc": loc, "msg": text, "input": summarize(value)}
    return APIError(400, f"1 validation error:\n  {entry}", param=loc, error_type="Bad Request")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, else vLLM's 400 for a body that is no JSON object."""
    if not raw:
        raise field_error("body", "missing", "Field required", None)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise field_error(f"body.{exc.pos}", "json_invalid", f"JSON decode error: {exc.msg}", {}) from None
    if not isinstance(body, dict):
        raise field_error(
            "body", "model_attributes_type", "Input should be a valid dictionary or object to extract fields from", body
        )
    return body


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sglang_usage(cache_report: bool) -> Callable[[int, int, int], dict[str, Any]]:
    """SGLang's OpenAI usage (``openai/usage_processor.py``): ``prompt_tokens_details`` only
    with ``--enable-cache-report`` and cached tokens > 0, else null."""

    def report(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        body = usage(prompt_tokens, completion_tokens, cached_tokens)
        if not (cache_report and cached_tokens > 0):
            body["prompt_tokens_details"] = None
        return body

    return report


def new_id(endpoint: GenerationApi) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex


def full_response(
    endpoint: GenerationApi, response_id: str, model: str, texts: Iterable[str], usage_body: dict[str, Any]
) -> bytes:
    """A non-streaming chat.completion / text_completion body, one choice per text."""
    if endpoint == "chat":
        choices: list[dict[str, Any]] = [
            {
                "index": index,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            for index, text in enumerate(texts)
        ]
        kind = "chat.completion"
    else:
        choices = [
            {"index": index, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            for index, text in enumerate(texts)
        ]
        kind = "text_completion"
    return orjson.dumps(
        {
            "id": response_id,
            "object": kind,
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage_body,
        }
    )


class StreamFormatter:
    """SSE events of one streaming response, built from byte templates.

    Each event carries one choice (vLLM streams the choices of ``n > 1`` or of a prompt
    batch as separate events, told apart by ``index``); templates are built per index on
    first use.
    """

    __slots__ = ("_endpoint", "_head", "_openings", "_prefixes")

    _MIDDLE = b',"logprobs":null,"finish_reason":null}]}\n\n'
    _LAST = b',"logprobs":null,"finish_reason":"length","stop_reason":null}]}\n\n'

    def __init__(self, endpoint: GenerationApi, response_id: str, model: str) -> None:
        kind = b"chat.completion.chunk" if endpoint == "chat" else b"text_completion"
        self._head = (
            b'data: {"id":"' + response_id.encode() + b'","object":"' + kind
            + b'","created":' + str(int(time.time())).encode() + b',"model":' + orjson.dumps(model)
        )  # fmt: skip
        self._endpoint = endpoint
        self._openings: dict[int, bytes] = {}
        self._prefixes: dict[int, bytes] = {}

    def opening(self, index: int = 0) -> bytes:
        """What precedes a choice's first token: the assistant role delta for chat, else nothing."""
        if self._endpoint != "chat":
            return b""
        opening = self._openings.get(index)
        if opening is None:
            opening = self._openings[index] = (
                self._head + b',"choices":[{"index":' + str(index).encode()
                + b',"delta":{"role":"assistant","content":""}' + self._MIDDLE
            )  # fmt: skip
        return opening

    def tokens(self, pieces_json: Iterable[bytes], last_is_final: bool, index: int = 0) -> bytes:
        """One event per token of choice ``index``; the final token's event carries ``finish_reason``."""
        prefix = self._prefixes.get(index)
        if prefix is None:
            field = b',"delta":{"content":' if self._endpoint == "chat" else b',"text":'
            prefix = self._prefixes[index] = self._head + b',"choices":[{"index":' + str(index).encode() + field
        closing = b"}" if self._endpoint == "chat" else b""
        events = [prefix + piece + closing + self._MIDDLE for piece in pieces_json]
        if last_is_final and events:
            events[-1] = events[-1][: -len(self._MIDDLE)] + self._LAST
        return b"".join(events)

    def usage(self, usage_body: dict[str, Any]) -> bytes:
        """The ``include_usage`` chunk: empty choices and the usage object."""
        return self._head + b',"choices":[],"usage":' + orjson.dumps(usage_body) + b"}\n\n"
