"""Errors the router itself answers, always in OpenAI's JSON shape.

Every error a client can see from kvroute is ``{"error": {"message", "type", "code"}}``
(with ``"type": "error"`` beside it, which Anthropic's clients expect; on the Messages
API's paths ``error.type`` is Anthropic's, :data:`ANTHROPIC_ERRORS`) with a fitting HTTP status, whether it comes from the proxy (bad body, unknown model, no
backend, upstream timeout), from aiohttp's dispatcher (unknown path, wrong method, body too
large) or from an unexpected exception (500, logged with its traceback, never shown).
A stream that breaks after its headers were sent cannot change its status any more; it
ends with :func:`sse_error_event` instead. Requests aiohttp cannot even parse (a header
over ``max_header_bytes``: 431; garbage: 400) are answered by :class:`JsonErrorServer`'s
connection handlers, in the same JSON form, without echoing the offending bytes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("kvroute.errors")

JSON_CONTENT_TYPE = "application/json"


@dataclass(frozen=True, slots=True)
class ErrorTypes:
    """One API's ``error.type`` for each HTTP status the router answers."""

    by_status: Mapping[int, str]
    #: The type of a status not listed.
    otherwise: str

    def of(self, status: int) -> str:
        return self.by_status.get(status, self.otherwise)


# OpenAI's ``error.type`` per status (https://platform.openai.com/docs/guides/error-codes).
_OPENAI_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}
#: OpenAI's error types: every path but Anthropic's.
OPENAI_ERRORS = ErrorTypes(_OPENAI_TYPE_BY_STATUS, "server_error")
#: Anthropic's (https://docs.claude.com/en/api/errors, and its SDK's ``timeout_error``):
#: its clients read them on ``/v1/messages``. A backend the router cannot reach is its
#: ``api_error``, no healthy backend its ``overloaded_error`` (Anthropic's 529).
ANTHROPIC_ERRORS = ErrorTypes(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        408: "invalid_request_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
        504: "timeout_error",
    },
    "api_error",
)


class RouterError(Exception):
    """An error answered to the client as OpenAI-style JSON; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers
        #: Close the connection after answering (the rest of the request was not read).
        self.close = close

    def body(self, types: ErrorTypes = OPENAI_ERRORS) -> bytes:
        """The JSON error object's bytes, its ``type`` one of ``types``."""
        return status_error_body(self.status, self.message, self.code, types)

    def answer_headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's header fields as bytes (for a server other than aiohttp's)."""
        headers = [(b"Content-Type", JSON_CONTENT_TYPE.encode())]
        if self.headers:
            headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()]
        return headers

    def to_response(self) -> web.Response:
        """The JSON response for this error."""
        response = error_response(self.status, self.message, code=self.code, headers=self.headers)
        if self.close:
            response.force_close()
        return response


def error_body(message: str, *, error_type: str, code: str | int | None) -> bytes:
    """The JSON bytes of an OpenAI-style error object, in the envelope Anthropic's clients
    read too (``"type": "error"`` beside it: the router serves ``/v1/messages``)."""
    return orjson.dumps({"type": "error", "error": {"message": message, "type": error_type, "code": code}})


def status_error_body(status: int, message: str, code: str | None, types: ErrorTypes = OPENAI_ERRORS) -> bytes:
    """The JSON bytes of the error object answered with ``status`` (its ``type`` follows the status)."""
    return error_body(message, error_type=types.of(status), code=code)


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style JSON error response (its ``type`` follows the status)."""
    body = status_error_body(status, message, code)
    return web.Response(status=status, body=body, content_type=JSON_CONTENT_TYPE, headers=headers)


def sse_error_event(message: str, *, code: str = "upstream_stream_error", types: ErrorTypes = OPENAI_ERRORS) -> bytes:
    """The end of a stream cut short: an SSE ``error`` event, then ``data: [DONE]``.

    The ``data`` line carries the usual error object, which the ``openai`` SDK raises as
    ``APIError`` (and, in its envelope, is Anthropic's ``error`` event); ``[DONE]`` lets any
    other SSE client stop reading instead of hanging.
    """
    payload = error_body(message, error_type=types.of(502), code=code)
    return b"event: error\ndata: " + payload + b"\n\ndata: [DONE]\n\n"


# aiohttp's own HTTP errors (raised by the dispatcher before any handler runs) -> code.
_CODE_BY_STATUS: dict[int, str] = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure of a handler or of the dispatcher into an OpenAI-style JSON error."""
    try:
        return await handler(request)
    except RouterError as exc:
        return exc.to_response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like are not errors
        message = _http_exception_message(request, exc)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, message, code=_CODE_BY_STATUS.get(exc.status), headers=headers)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal router error", code="internal_error")


def _http_exception_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route for {request.method} {request.path}"
    if exc.status == 405:
        return f"method {request.method} not allowed on {request.path}"
    if exc.status == 413:
        return "request body too large"
    return str(exc.reason)


def json_response(payload: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response serialised with orjson (dataclasses included)."""
    return web.Response(status=status, body=orjson.dumps(payload), content_type=JSON_CONTENT_TYPE, headers=headers)


# --- requests that cannot be parsed ------------------------------------------------------
class _JsonErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering unparsable requests in OpenAI's JSON form.

    aiohttp's own answer is plain text and its log line quotes the offending bytes, which
    may hold a client's credentials; this one names only the kind of problem.
    """

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response was already started; the connection is closed instead")
        if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "too many headers" in str(exc).lower()):
            status, text, code = 431, "request line or header fields too large", "headers_too_large"
        elif status < 500:
            text, code = f"malformed HTTP request ({type(exc).__name__ if exc else 'unknown'})", "bad_request"
        else:
            log.error("unhandled error serving %s", request.path, exc_info=exc)
            text, code = "internal router error", "internal_error"
        if status < 500:
            log.debug("unparsable request from %s: %s", request.remote, type(exc).__name__ if exc else status)
        response = error_response(status, text, code=code)
        response.force_close()
        return response


class JsonErrorServer(web.Server):
    """aiohttp's low-level server, with a :class:`_JsonErrorRequestHandler` for each connection.

    It serves what ``serving`` serves (its request handler and request factory, both public
    attributes of :class:`aiohttp.web.Server`); ``connection_options`` are the keyword
    arguments of aiohttp's ``RequestHandler`` (timeouts, size limits, access log).
    """

    def __init__(self, serving: web.Server, **connection_options: Any) -> None:
        super().__init__(
            serving.request_handler,
            request_factory=serving.request_factory,
            handler_cancellation=serving.handler_cancellation,
            **connection_options,
        )
        # Kept here rather than read back from aiohttp's private attributes.
        self._connection_loop = asyncio.get_running_loop()
        self._connection_options = connection_options

    def __call__(self) -> RequestHandler:
        """A connection's protocol (a server is the protocol factory of ``loop.create_server``)."""
        return _JsonErrorRequestHandler(self, loop=self._connection_loop, **self._connection_options)
