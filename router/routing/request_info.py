"""The one parse of a request body that routing needs (the endpoints: :mod:`kvroute.router.engines`).

The body is forwarded byte for byte; it is parsed once (orjson) only to learn what the
router needs: the model, whether the client streams and asked for usage, the expected
output length and a session key. Everything else is the engine's to validate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvroute.router.engines import ENDPOINTS, Endpoint
from kvroute.router.engines.openai import continued_response
from kvroute.router.errors import RouterError

# The proxied endpoints are the engine modules' (kvroute.router.engines); re-exported here, where
# the one parse of a body reads them.
__all__ = ["ENDPOINTS", "Endpoint", "ParsedRequest", "body_with_usage_requested", "parse_request"]

# An absurd max_tokens must not make one request look like the whole fleet's load.
MAX_EXPECTED_OUTPUT_TOKENS = 32_768
# Expected decode length when the client gives no max_tokens (vLLM's own default is
# "up to the context length", which would overstate load by orders of magnitude).
DEFAULT_EXPECTED_OUTPUT_TOKENS = 256


@dataclass(slots=True)
class ParsedRequest:
    """What the router learned from one request body."""

    body: dict[str, Any]
    model: str | None
    stream: bool
    #: The client itself asked for ``stream_options.include_usage``.
    include_usage: bool
    expected_output_tokens: int
    session_key: str | None
    #: The stored Responses answer it continues (``previous_response_id``), if any.
    continues: str | None = None


def parse_request(raw: bytes, endpoint: Endpoint, headers: Mapping[str, str], session_header: str) -> ParsedRequest:
    """Parse a request body; raises :class:`RouterError` (400) when routing cannot use it."""
    if not raw:
        raise RouterError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object", code="invalid_json")

    model = body.get("model")
    if model is None:
        if endpoint.requires_model:
            raise RouterError(400, "'model' is required", code="missing_model")
    elif not isinstance(model, str) or not model:
        raise RouterError(400, "'model' must be a non-empty string", code="invalid_model")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise RouterError(400, "'stream' must be a boolean", code="invalid_stream")

    return ParsedRequest(
        body=body,
        model=model,
        stream=stream,
        include_usage=_asked_for_usage(body),
        expected_output_tokens=expected_output_tokens_of(body),
        session_key=session_key_of(body, headers, session_header),
        continues=continued_response(endpoint.path, body),
    )


def _asked_for_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def expected_output_tokens_of(body: Mapping[str, Any]) -> int:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        value = body.get("max_output_tokens")  # /v1/responses
    if value is None:
        # Token-in generation (vLLM's /inference/v1/generate, SGLang's /generate).
        sampling = body.get("sampling_params")
        if isinstance(sampling, Mapping):
            value = sampling.get("max_tokens", sampling.get("max_new_tokens"))
    # bool is an int subclass; neither it nor a negative number is a length.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return min(value, MAX_EXPECTED_OUTPUT_TOKENS)
    return DEFAULT_EXPECTED_OUTPUT_TOKENS


def brings_chat_template(body: Mapping[str, Any]) -> bool:
    """Whether a request brings its own chat template (its ``chat_template`` field, or the
    same key in ``chat_template_kwargs``), which vLLM renders only when trusted."""
    kwargs = body.get("chat_template_kwargs")
    return body.get("chat_template") is not None or (
        isinstance(kwargs, Mapping) and kwargs.get("chat_template") is not None
    )


def session_key_of(body: Mapping[str, Any], headers: Mapping[str, str], session_header: str) -> str | None:
    """The session header, else OpenAI's ``prompt_cache_key`` (its own hint for routing to
    a cache, which Codex fills per conversation), else the ``user`` field, else Anthropic's
    ``metadata.user_id`` (which Claude Code fills per session)."""
    key = headers.get(session_header)
    if key:
        return key
    for field in ("prompt_cache_key", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return value
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user_id if isinstance(user_id, str) and user_id else None


def body_with_usage_requested(body: dict[str, Any]) -> bytes:
    """The body re-serialised with ``stream_options.include_usage`` set.

    The router rewrites a body in two cases: here, since it needs the engine's usage chunk
    to learn the cached tokens (it strips that chunk again before the client sees it), and
    to name a data-parallel rank where the engine reads it from the body
    (:func:`body_with_rank`).
    """
    options = body.get("stream_options")
    merged = dict(options) if isinstance(options, dict) else {}
    merged["include_usage"] = True
    return orjson.dumps({**body, "stream_options": merged})


def body_with_rank(raw: bytes, body: Mapping[str, Any], field: str, rank: int) -> bytes:
    """``raw`` (the JSON object ``body``) with ``field`` set to ``rank``, replacing a
    client's own: appended as the object's last member, without re-serialising the rest
    (a huge prompt's body costs a copy, not a parse), unless the client set the field."""
    if field in body:
        return orjson.dumps({**body, field: rank})
    head = raw[: raw.rindex(b"}")].rstrip()
    separator = b"" if head.endswith(b"{") else b","
    return b"%s%s%s:%d}" % (head, separator, orjson.dumps(field), rank)
