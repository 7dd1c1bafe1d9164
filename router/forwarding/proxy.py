"""Forwarding one request to a backend and relaying its answer: the router's hot path.

Per request: read the body (size-limited), parse it once (``request_info``), ask the
``RoutingEngine`` for a backend among the eligible ones, send the body byte for byte over
the lean keep-alive client of ``kvroute.router.forwarding.upstream``, and relay the answer:

* non-streaming answers are read whole (they are small) and sent with the routing headers;
* SSE streams are written to the client chunk by chunk as they arrive, never buffered.

The proxy does not know which HTTP server received the request: it reads a
``ClientRequest`` and answers into a ``ResponseSink`` (``kvroute.router.forwarding.exchange``),
which aiohttp and the lean llhttp server (``kvroute.router.http.lean_server``) both provide.

Before any request is parsed, the client passes the HTTP room's gate (``check_client``: API key,
rate limit) and admission control (``kvroute.router.forwarding.admission``: concurrency limits, a bounded
wait queue, else 429); the body must arrive within ``request_read_timeout_s`` (408) and
within ``max_body_bytes`` (413), which the server's body reader enforces.

Until the first byte reaches the client, a failure is retried once on another healthy
backend: connection refused/reset, timeouts, 500/502/503/504 answers, a non-streaming
answer broken off mid-body, a stream that breaks before its first chunk. (A stream's
headers are sent to the client together with its first chunk, so the whole prefill is
inside that window.) After that nothing is retried: a stream broken by its engine ends
with an SSE error event and ``[DONE]``. A call on a stored Responses answer that this
process does not know the home of (``Proxy.forward``) goes on after each 404 as well, to
every backend in turn. Every attempt's outcome feeds the backend's
circuit breaker (``kvroute.router.fleet.breaker``). Every attempt holds the backend's in-flight
counters (one request, and the attempt's ``RoutePlan.work_tokens``: the load every policy,
the metrics and the admin API read) in a ``try/finally``, so a client hanging up (the
handler is cancelled, the upstream connection is closed at once so the engine aborts) or
any error returns them to zero.

The engine's ``usage`` (prompt and cached tokens) is read from every answer and fed to
``RoutingEngine.observe`` and the metrics; streams get ``include_usage`` injected when the
client did not ask for it, and the extra usage chunk is removed again (``kvroute.router.engines.usage``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson

from kvroute.router.config import Settings
from kvroute.router.engines.openai import RESPONSE_LOOKUP
from kvroute.router.engines.usage import OPENAI_USAGE, StreamTap, Usage, usage_from_body
from kvroute.router.errors import RouterError, sse_error_event
from kvroute.router.fleet.backends import Backend, BackendPool
from kvroute.router.fleet.breaker import BreakerState
from kvroute.router.forwarding.admission import AdmissionControl
from kvroute.router.forwarding.exchange import (
    ClientRequest,
    ResponseHeaders,
    ResponseSink,
    send_error,
)
from kvroute.router.forwarding.metrics import RouterMetrics
from kvroute.router.forwarding.turn_batch import TurnBatch
from kvroute.router.forwarding.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvroute.router.routing.decisions import AttemptOutcome
from kvroute.router.routing.policies.base import Decision, RouteRequest
from kvroute.router.routing.policies.simple import load_of
from kvroute.router.routing.request_info import (
    Endpoint,
    ParsedRequest,
    body_with_rank,
    body_with_usage_requested,
    parse_request,
)
from kvroute.router.routing.routing_engine import (
    STORED_RESPONSE_REASON,
    PendingInsert,
    PreparedPrompt,
    RoutePlan,
    RoutingEngine,
)

log = logging.getLogger("kvroute.proxy")

#: Request bodies at least this large are tokenized in a worker thread (~25K tokens of text):
#: below it, tokenizing inline costs less than the thread hand-off.
THREAD_PREPARE_BYTES = 100_000

# RFC 9110 7.6.1 hop-by-hop headers (lower-case bytes, as compared with raw header names).
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Recomputed for each hop, or set by the router itself.
_PER_HOP_REQUEST_HEADERS = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-request-id"}
_PER_HOP_RESPONSE_HEADERS = HOP_BY_HOP | {b"content-length", b"x-request-id"}
# The request headers not forwarded, by (the backend's credential goes instead of the
# client's, the router reads the stream and asks for it unencoded): the per-hop ones, and
# the client's Authorization / Accept-Encoding when the router sends its own.
_DROPPED_REQUEST_HEADERS = {
    (own_key, identity): _PER_HOP_REQUEST_HEADERS
    | ({b"authorization"} if own_key else frozenset())
    | ({b"accept-encoding"} if identity else frozenset())
    for own_key in (False, True)
    for identity in (False, True)
}
#: The longest client-chosen request id taken as given (``request_id_of``).
MAX_REQUEST_ID_CHARS = 128
# Answers that mean "this replica failed or cannot take it now": nothing reached the
# client yet and generation has no side effects, so another replica may answer instead.
_RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})
_STATUS_LABELS = {code: str(code) for code in range(100, 600)}
# A stored response's own calls have no body the router reads.
_NOTHING_PARSED = ParsedRequest(
    body={}, model=None, stream=False, include_usage=False, expected_output_tokens=0, session_key=None
)


@dataclass(slots=True)
class _Call:
    """One client request on its way through the proxy: what every attempt at it reads.

    Built once per request, after the body is parsed and tokenized, so the functions below
    take the call instead of a long tail of loose parameters; a retry reuses all of it.
    """

    request: ClientRequest
    #: Where the answer goes (the server's side of :mod:`kvroute.router.forwarding.exchange`).
    sink: ResponseSink
    endpoint: Endpoint
    parsed: ParsedRequest
    request_id: str
    #: ``request_id`` encoded once: it goes upstream and back to the client.
    request_id_bytes: bytes
    #: ``time.monotonic()`` when the request arrived: durations and TTFT count from here.
    started: float
    #: The prompt tokenized and hashed once per request (None when no policy reads prefixes).
    prepared: PreparedPrompt | None
    #: What goes upstream: the client's bytes, or the body re-serialised with
    #: ``include_usage`` set (decided once, not per attempt).
    body: bytes
    #: The router asked for the stream's usage chunk and removes it again.
    usage_injected: bool
    #: The stored response the call reaches (its ``previous_response_id``, or the id in a
    #: stored response's own path): a backend answering 404 may not be the one storing it.
    stored_id: str | None
    #: The request method, as sent upstream.
    method: bytes = b"POST"


@dataclass(slots=True)
class _Attempt:
    """One try of a call on one backend, and what it ended with (metrics, feedback)."""

    call: _Call
    plan: RoutePlan
    backend: Backend
    #: Another backend may still take over when this one fails before the client sees a byte.
    can_retry: bool
    #: Not known to store the call's response: its 404 sends the call on (with ``can_retry``).
    searching: bool
    status: str = "500"  # until known: an escaping exception becomes a 500
    ttft_s: float | None = None
    usage: Usage | None = None


class _Retry(Exception):
    """This attempt failed before anything reached the client; try another backend."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


def _forwarded(
    raw_headers: Sequence[tuple[bytes, bytes]], skip: frozenset[bytes], drop_prefix: bytes | None = None
) -> list[tuple[bytes, bytes]]:
    """The headers that go on to the next hop: not in ``skip`` (lower-case names), not
    starting with ``drop_prefix``, and not listed by a ``Connection`` header (RFC 9110 7.6.1).

    One pass that lower-cases each name once; ``Connection`` is in every ``skip`` set, and
    only when it lists more than ``keep-alive``/``close`` (rare) is the result filtered again.
    """
    kept: list[tuple[bytes, bytes]] = []
    connection: list[bytes] = []
    for name, value in raw_headers:
        lower = name.lower()
        if lower in skip or (drop_prefix is not None and lower.startswith(drop_prefix)):
            if lower == b"connection":
                connection.append(value)
            continue
        kept.append((name, value))
    if connection:
        listed = {token.strip().lower() for value in connection for token in value.split(b",")} - skip
        if listed:
            kept = [(name, value) for name, value in kept if name.lower() not in listed]
    return kept


def request_id_of(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id`` when it is a plain token, else a fresh random one.

    The id is echoed in the answer, sent to the engine and written to the decision log, so
    only visible ASCII of at most :data:`MAX_REQUEST_ID_CHARS` is taken as given: bytes that
    are not UTF-8 could not be encoded again (a 500 for the client, a traceback in the log),
    and other text would come back re-encoded.
    """
    given = headers.get("x-request-id")
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable() and " " not in given:
        return given
    return os.urandom(16).hex()


def _outgoing_body(endpoint: Endpoint, parsed: ParsedRequest, raw: bytes) -> tuple[bytes, bool]:
    """The body to send upstream, and whether it asks for the usage chunk the client did not.

    The router needs a stream's final usage (the engine's cached tokens) to learn from it.
    """
    if not (parsed.stream and endpoint.accepts_stream_options and not parsed.include_usage):
        return raw, False
    try:
        return body_with_usage_requested(parsed.body), True
    except orjson.JSONEncodeError:
        # Nested deeper than orjson writes (it reads deeper): forward it as sent.
        return raw, False


class Proxy:
    """Forwards requests of the proxied endpoints; one instance per application."""

    def __init__(
        self,
        settings: Settings,
        pool: BackendPool,
        routing: RoutingEngine,
        metrics: RouterMetrics,
        upstream: UpstreamClient,
        *,
        admission: AdmissionControl[Backend] | None = None,
        check_client: Callable[[ClientRequest], None] | None = None,
    ) -> None:
        self._pool = pool
        self._routing = routing
        # Prompts of one event-loop turn are prepared in a row, each with its code still cached.
        self._prepare_batch: TurnBatch[tuple[str, Mapping[str, Any]], PreparedPrompt | None] = TurnBatch(
            self._prepare_now
        )
        self._metrics = metrics
        self._upstream = upstream
        self._admission: AdmissionControl[Backend] = admission or AdmissionControl(
            max_concurrency=None, max_backend_concurrency=None, queue_size=0, queue_timeout_s=1.0
        )
        # Read once: the limits are fixed when admission control is built.
        self._admission_limited = self._admission.limited
        # The HTTP room's client gate (API keys, rate limits): raises RouterError to refuse.
        self._check_client = check_client
        # The first-byte timeout covers the wait for the answer's head and a stream's first
        # chunk (engines send SSE headers before the prefill); the idle timeout the rest.
        self._first_byte_timeout = settings.first_byte_timeout_s
        self._idle_timeout = settings.idle_timeout_s
        self._session_header = settings.session_header
        self._strip_kvroute_headers = not settings.allow_policy_header

    # --- entry -----------------------------------------------------------------------
    async def forward(
        self, request: ClientRequest, endpoint: Endpoint, sink: ResponseSink, stored_id: str | None = None
    ) -> None:
        """Handle one request to a proxied endpoint; its answer goes to ``sink``.

        With ``endpoint`` :data:`RESPONSE_LOOKUP`, a call on the stored response
        ``stored_id`` itself (read, cancel, delete; any method): the body goes as sent to the
        backend that stored it, or, where this router does not know which (another router
        or worker created it, or this one restarted), to each in turn until one does not
        answer 404. A ``/v1/responses`` request continuing an unknown response searches the
        same way: vLLM looks the stored response up before it generates anything.
        """
        started = time.monotonic()
        request_id = request_id_of(request.headers)
        try:
            if self._check_client is not None:
                self._check_client(request)
            raw = request.body
            if not isinstance(raw, bytes):
                # The server's reader applies max_body_bytes and request_read_timeout_s (413, 408).
                raw = await raw()
            if endpoint is RESPONSE_LOOKUP:
                parsed, prepared, body, usage_injected = _NOTHING_PARSED, None, raw, False
                method = request.method.encode()
            else:
                parsed = parse_request(raw, endpoint, request.headers, self._session_header)
                prepared = await self._prepare(endpoint, parsed, len(raw))
                body, usage_injected = _outgoing_body(endpoint, parsed, raw)
                stored_id = parsed.continues
                method = b"POST"
            call = _Call(
                request,
                sink,
                endpoint,
                parsed,
                request_id,
                request_id.encode(),
                started,
                prepared,
                body,
                usage_injected,
                stored_id,
                method,
            )
            await self._route(call)
        except RouterError as exc:
            send_error(sink, exc, request_id=request_id, types=endpoint.errors)

    # --- choosing backends -----------------------------------------------------------
    async def _route(self, call: _Call) -> None:
        """Try the call on a backend; once more elsewhere if that fails before the first byte
        (and on every other backend in turn while a search for a stored response finds 404)."""
        pool = self._pool
        model = call.parsed.model
        path = call.endpoint.path
        admission = self._admission
        failed: list[Backend] = []
        holds_request_slot = False
        last_error: RouterError | None = None
        try:
            for attempt in itertools.count():  # each retry has one candidate less
                if self._admission_limited:
                    # May wait for a turn (or raise 429); only backends with room come back.
                    eligible = partial(self._eligible, model, path, failed)
                    candidates = list(await admission.admit(eligible, holds_request_slot=holds_request_slot))
                    holds_request_slot = True
                    alternatives = len(eligible())
                else:
                    candidates = self._eligible(model, path, failed)
                    alternatives = len(candidates)
                if not candidates:
                    raise last_error or self._no_backend(model)
                plan = self._plan(call, candidates)
                backend = pool.get(plan.backend)
                if backend is None:
                    log.error("policy %s chose %s, which is not in the pool", plan.policy, plan.backend)
                    raise RouterError(500, "routing chose an unknown backend", code="internal_error")
                searching = call.stored_id is not None and plan.decision.reason != STORED_RESPONSE_REASON
                can_retry = alternatives > 1 and (attempt == 0 or searching)
                try:
                    await self._attempt(_Attempt(call, plan, backend, can_retry, searching))
                    return
                except _Retry as retry:
                    failed.append(backend)
                    last_error = retry.error
                    log.debug("retrying %s elsewhere after %s failed: %s", call.request_id, backend.url, retry)
            raise AssertionError("unreachable")
        finally:
            if holds_request_slot:
                admission.leave()

    def _eligible(self, model: str | None, path: str, failed: list[Backend]) -> list[Backend]:
        """The backends an attempt may go to: after a failure, not those that failed."""
        candidates = self._pool.candidates(model, path)
        if not failed:
            return candidates
        others = [backend for backend in candidates if backend not in failed]
        # The retry is the client's last chance: not on a backend still on probation.
        proven = [backend for backend in others if backend.breaker.state is BreakerState.CLOSED]
        return proven or others

    async def _prepare(self, endpoint: Endpoint, parsed: ParsedRequest, size: int) -> PreparedPrompt | None:
        """Tokenize and hash the prompt once per request, not per attempt.

        Long prompts are tokenized in a worker thread (the tokenizer releases the GIL), so
        a 100K-token first turn does not stall every other request's relay.
        """
        if not self._routing.tracks_prefixes:
            return None
        if size >= THREAD_PREPARE_BYTES:
            return await asyncio.to_thread(self._routing.prepare, endpoint.path, parsed.body)
        return await self._prepare_batch.run((endpoint.path, parsed.body))

    def _prepare_now(self, request: tuple[str, Mapping[str, Any]]) -> PreparedPrompt | None:
        endpoint, body = request
        return self._routing.prepare(endpoint, body)

    def _plan(self, call: _Call, candidates: list[Backend]) -> RoutePlan:
        parsed = call.parsed
        if call.endpoint is RESPONSE_LOOKUP:
            return self._routing.route_stored(call.stored_id or "", candidates)
        try:
            return self._routing.route(
                call.endpoint.path,
                parsed.body,
                call.request.headers,
                candidates,
                prepared=call.prepared,
                parsed=parsed,
                sliced=True,
            )
        except Exception:
            log.exception("routing failed; falling back to the least loaded backend")
            backend = min(candidates, key=load_of)
            request = RouteRequest(
                endpoint=call.endpoint.path,
                model=parsed.model,
                session_key=parsed.session_key,
                expected_output_tokens=parsed.expected_output_tokens,
            )
            return RoutePlan(decision=Decision(backend.url, "routing_error"), policy="fallback", request=request)

    def _no_backend(self, model: str | None) -> RouterError:
        if model is not None and self._pool.healthy_count() and not self._pool.any_serves(model):
            return RouterError(404, f"The model `{model}` does not exist.", code="model_not_found")
        which = f" serving model `{model}`" if model is not None else ""
        return RouterError(503, f"no healthy backend{which}", code="no_healthy_backend")

    # --- one attempt on one backend ----------------------------------------------------
    async def _attempt(self, attempt: _Attempt) -> None:
        """One exchange with one backend, its in-flight counters held until it ends, however it
        ends. (One coroutine for the counters, the request and the answer's status: each
        coroutine layer costs every request its creation and an await.)"""
        call = attempt.call
        backend = attempt.backend
        pool = self._pool
        work_tokens = attempt.plan.work_tokens
        pool.acquire(backend, work_tokens)
        try:
            try:
                if attempt.plan.pending_inserts:
                    await self._learn_in_slices(attempt.plan)
                body = call.body
                rank_field = call.endpoint.rank_field
                if rank_field is not None and backend.access.rank is not None:
                    body = body_with_rank(body, call.parsed.body, rank_field, backend.access.rank)
                upstream = await self._upstream.send(
                    call.method,
                    backend.access.origin,
                    call.request.raw_path.encode(),
                    self._upstream_headers(attempt),
                    body,
                    first_byte_timeout=self._first_byte_timeout,
                )
            except UpstreamError as exc:
                unreachable = isinstance(exc, (UpstreamConnectError, UpstreamDisconnected))
                pool.request_failed(backend, unreachable=unreachable)
                raise self._failed_before_first_byte(attempt, exc) from None
            completed = False
            try:
                status = upstream.status
                if status >= 500:
                    pool.request_failed(backend)
                else:
                    pool.request_succeeded(backend)
                if attempt.can_retry and (status in _RETRYABLE_STATUSES or (status == 404 and attempt.searching)):
                    attempt.status = _STATUS_LABELS[status]
                    raise _Retry(self._retry_error(backend, status))
                attempt.status = _STATUS_LABELS.get(status) or str(status)
                if upstream.is_event_stream:
                    await self._relay_stream(attempt, upstream)
                else:
                    await self._relay_body(attempt, upstream)
                completed = True
            finally:
                if completed:
                    upstream.release()
                else:
                    upstream.close()  # closes the connection: the engine sees the abort at once
        except asyncio.CancelledError:
            attempt.status = "499"  # the client hung up (or the drain timeout ran out)
            pool.request_abandoned(backend)
            raise
        finally:
            pool.release(backend, work_tokens)
            if self._admission_limited:
                self._admission.wake()  # a backend's request slot freed
            self._finish(attempt)

    @staticmethod
    def _retry_error(backend: Backend, status: int) -> RouterError:
        """The error an answer that sent the call on becomes, if no backend is left to try."""
        if status == 404:
            return RouterError(404, "no backend holds the stored response", code="response_not_found")
        return RouterError(502, f"backend {backend.url} answered {status}", code="bad_gateway")

    async def _learn_in_slices(self, plan: RoutePlan) -> None:
        """Insert a huge prompt's blocks into the index a slice per event-loop turn, so other
        requests run between them; before the request goes upstream, so the answer's
        feedback finds them all."""
        await asyncio.sleep(0)
        while self._routing.learn_slice(plan):
            await asyncio.sleep(0)

    async def _relay_body(self, attempt: _Attempt, upstream: UpstreamResponse) -> None:
        try:
            data = await upstream.read()
        except UpstreamError as exc:
            # Read whole before anything is sent: the client has seen nothing yet.
            self._pool.request_failed(attempt.backend)
            raise self._failed_before_first_byte(attempt, exc) from None
        usage_format = attempt.call.endpoint.usage
        if usage_format is not None and upstream.status == 200:
            attempt.usage = usage_from_body(data, usage_format)
        attempt.call.sink.send(upstream.status, self._response_headers(upstream, attempt), data)

    async def _relay_stream(self, attempt: _Attempt, upstream: UpstreamResponse) -> None:
        backend = attempt.backend
        read = upstream.read_available
        # The client gets the headers together with the first chunk: until then (engines
        # send SSE headers before the prefill) the request may still go elsewhere.
        try:
            chunk = await read()
            if not chunk:
                raise UpstreamProtocolError("the stream ended before its first event")
        except UpstreamError as exc:
            self._pool.request_failed(backend)
            raise self._failed_before_first_byte(attempt, exc) from None
        attempt.ttft_s = time.monotonic() - attempt.call.started
        # From the first chunk on, a stream may pause at most idle_timeout_s.
        upstream.set_timeout(self._idle_timeout)
        sink = attempt.call.sink
        usage_format = attempt.call.endpoint.usage
        tap = StreamTap(strip_usage_chunk=attempt.call.usage_injected, usage_format=usage_format or OPENAI_USAGE)
        write = sink.write
        try:
            await sink.start(upstream.status, self._response_headers(upstream, attempt))
            while True:
                forward = tap.feed(chunk)
                if forward:
                    await write(forward)
                try:
                    chunk = await read()
                except UpstreamError as exc:
                    self._pool.request_failed(backend)
                    attempt.status = "502"
                    log.warning("stream from %s broke off: %s", backend.url, exc)
                    message = f"the backend's stream broke off: {exc}"
                    await write(sse_error_event(message, types=attempt.call.endpoint.errors))
                    break
                if not chunk:
                    rest = tap.finish()
                    if rest:
                        await write(rest)
                    break
            await sink.end()
        except ConnectionResetError:
            # The client hung up and a write noticed first: abort the engine's work now.
            attempt.status = "499"
            self._pool.request_abandoned(backend)
            upstream.close()
        finally:
            # However the stream ended (a client that hung up cancels the task mid-read), what
            # the engine said so far: its usage, a background response's id. Not for a stored
            # response's stream read again (RESPONSE_LOOKUP), whose usage was counted once.
            if usage_format is not None:
                tap.finish()  # a no-op after the clean end; else a held-back partial event is dropped
                attempt.usage = tap.usage

    @staticmethod
    def _failed_before_first_byte(attempt: _Attempt, exc: UpstreamError) -> Exception:
        """The error for an attempt that failed before the client saw anything: retry it
        elsewhere when there is an alternative, else a 504 (timeout) or 502."""
        url = attempt.backend.url
        if isinstance(exc, UpstreamTimeout):
            attempt.status = "504"
            error = RouterError(504, f"backend {url} did not answer in time: {exc}", code="upstream_timeout")
        elif isinstance(exc, (UpstreamConnectError, UpstreamDisconnected)):
            attempt.status = "502"
            error = RouterError(502, f"backend {url} failed before answering: {exc}", code="backend_unreachable")
        else:
            attempt.status = "502"
            error = RouterError(502, f"backend {url} broke off its answer: {exc}", code="bad_gateway")
        return _Retry(error) if attempt.can_retry else error

    # --- headers -----------------------------------------------------------------------
    def _upstream_headers(self, attempt: _Attempt) -> list[tuple[bytes, bytes]]:
        """The client's end-to-end headers, with the router's request id and the backend's
        own extra headers and credential (see :mod:`kvroute.router.fleet.backend_access`)."""
        call = attempt.call
        access = attempt.backend.access
        own_credential = access.proxy_credential(call.request.headers)
        skip = _DROPPED_REQUEST_HEADERS[own_credential, call.usage_injected]
        if access.header_names:
            skip = skip | access.header_names
        drop_prefix = b"x-kvroute-" if self._strip_kvroute_headers else None
        headers = [(b"x-request-id", call.request_id_bytes)]
        headers += _forwarded(call.request.raw_headers, skip, drop_prefix)
        headers += access.proxy_headers(own_credential)
        if call.usage_injected:
            # The router must read the stream to remove the usage chunk it asked for.
            headers.append((b"Accept-Encoding", b"identity"))
        return headers

    @staticmethod
    def _response_headers(upstream: UpstreamResponse, attempt: _Attempt) -> ResponseHeaders:
        """The engine's end-to-end headers (as received, not decoded) and the routing headers."""
        headers = _forwarded(upstream.raw_headers, _PER_HOP_RESPONSE_HEADERS)
        plan = attempt.plan
        decision = plan.decision  # RoutePlan's backend and reason properties read it
        headers.append((b"x-kvroute-backend", decision.backend.encode()))
        headers.append((b"x-kvroute-policy", plan.policy.encode()))
        headers.append((b"x-kvroute-reason", decision.reason.encode()))
        prompt_tokens = plan.request.prompt_tokens
        if prompt_tokens is not None:
            headers.append((b"x-kvroute-prompt-tokens", b"%d" % prompt_tokens))
            headers.append((b"x-kvroute-matched-tokens", b"%d" % decision.matched_tokens))
        headers.append((b"x-request-id", attempt.call.request_id_bytes))
        return headers

    # --- bookkeeping -------------------------------------------------------------------
    def _finish(self, attempt: _Attempt) -> None:
        """Metrics, routing feedback and the decision log for one finished attempt."""
        plan = attempt.plan
        decision = plan.decision  # RoutePlan's backend, reason and prediction properties read it
        usage = attempt.usage
        # What the engine's report means is its engine module's to say (SGLang: null = 0
        # with --enable-cache-report; a generic server: nothing to learn from).
        backend = attempt.backend
        cached_tokens = backend.engine.observed(usage, backend.engine_facts)
        outcome = AttemptOutcome(
            request_id=attempt.call.request_id,
            backend=decision.backend,
            policy=plan.policy,
            endpoint=attempt.call.endpoint.name,
            status=attempt.status,
            duration_s=time.monotonic() - attempt.call.started,
            ttft_s=attempt.ttft_s,
            prompt_tokens=usage.prompt_tokens if usage is not None else None,
            predicted_cached_tokens=decision.matched_tokens,
            cached_tokens=cached_tokens,
        )
        self._metrics.record_request(outcome)
        self._metrics.record_decision(plan.policy, decision.reason)
        try:
            answered = attempt.status.startswith("2")
            response_id = usage.response_id if usage is not None else None
            for pending in self._routing.observe(
                plan, cached_tokens, answered=answered, sliced=True, response_id=response_id
            ):
                insert_in_loop_turns(pending)
            stored_id = attempt.call.stored_id
            if stored_id is not None and answered:
                self._routing.remember_response(stored_id, decision.backend)  # found it there
        except Exception:
            log.exception("routing feedback failed")
        decisions = self._routing.decisions
        if decisions.active:
            decisions.record(plan, outcome)


def insert_in_loop_turns(pending: PendingInsert) -> None:
    """Insert the rest of a huge prompt's blocks a slice per event-loop turn from the next
    one on (a peer's placement, an engine's answer that it held less than modelled), so
    requests run in between; nothing waits for it."""
    asyncio.get_running_loop().call_soon(_insert_next_slice, pending)


def _insert_next_slice(pending: PendingInsert) -> None:
    try:
        more = pending.insert_next()
    except Exception:  # a callback's error would only reach the loop's handler
        log.exception("inserting a prompt's blocks for %s failed", pending.backend)
        return
    if more:
        asyncio.get_running_loop().call_soon(_insert_next_slice, pending)
