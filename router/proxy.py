"""Forwarding one request to a backend and relaying its answer: the router's hot path.

Per request: read the body (size-limited), parse it once (``request_info``), ask the
``RoutingEngine`` for a backend among the eligible ones, send the body byte for byte over
the lean keep-alive client of ``router.upstream``, and relay the answer:

* non-streaming answers are read whole (they are small) and sent with the routing headers;
* SSE streams are written to the client chunk by chunk as they arrive, never buffered.

Before any request is parsed, the client passes the gate (``router.security``: API key,
rate limit) and admission control (``router.admission``: concurrency limits, a bounded
wait queue, else 429); the body must arrive within ``request_read_timeout_s`` (408) and
within ``max_body_bytes`` (413).

Until the first byte reaches the client, a failure is retried once on another healthy
backend: connection refused/reset, timeouts, 500/502/503/504 answers, a non-streaming
answer broken off mid-body, a stream that breaks before its first chunk. (A stream's
headers are sent to the client together with its first chunk, so the whole prefill is
inside that window.) After that nothing is retried: a stream broken by its engine ends
with an SSE error event and ``[DONE]``. Every attempt's outcome feeds the backend's
circuit breaker (``router.breaker``). Every attempt holds the backend's in-flight
counters in a ``try/finally``, so a client hanging up (the handler is cancelled, the
upstream connection is closed at once so the engine aborts) or any error returns them
to zero.

The engine's ``usage`` (prompt and cached tokens) is read from every answer and fed to
``RoutingEngine.observe`` and the metrics; streams get ``include_usage`` injected when the
client did not ask for it, and the extra usage chunk is removed again (``router.usage``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from aiohttp import web
from multidict import CIMultiDict

from router.admission import AdmissionControl
from router.backends import Backend, BackendPool
from router.breaker import BreakerState
from router.config import Settings
from router.errors import RouterError, sse_error_event
from router.metrics import RouterMetrics
from router.policies.base import Decision, RouteRequest
from router.request_info import Endpoint, ParsedRequest, body_with_usage_requested, parse_request
from router.routing import PreparedPrompt, RoutePlan, RoutingEngine
from router.security import ClientGate
from router.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
    UpstreamTimeout,
)
from router.usage import StreamTap, Usage, usage_from_body

log = logging.getLogger("kvroute.proxy")

#: Request bodies at least this large are tokenized in a worker thread (~25K tokens of text):
#: below it, tokenizing inline costs less than the thread hand-off.
THREAD_PREPARE_BYTES = 100_000
decision_log = logging.getLogger("kvroute.decisions")

# RFC 9110 7.6.1 hop-by-hop headers (lower-case bytes, as compared with raw header names).
HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
        b"te", b"trailer", b"transfer-encoding", b"upgrade",
    }
)
# Recomputed for each hop, or set by the router itself.
_REQUEST_SKIP = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"x-request-id"}
_RESPONSE_SKIP = HOP_BY_HOP | {b"content-length", b"x-request-id"}
# Answers that mean "this replica failed or cannot take it now": nothing reached the
# client yet and generation has no side effects, so another replica may answer instead.
_RETRYABLE_STATUSES = frozenset({500, 502, 503, 504})
_STATUS_LABELS = {code: str(code) for code in range(100, 600)}


@dataclass(slots=True)
class _Outcome:
    """What one attempt ended with, for metrics and feedback."""

    status: str = "500"  # until known: an escaping exception becomes a 500
    ttft_s: float | None = None
    usage: Usage | None = None


class _Retry(Exception):
    """This attempt failed before anything reached the client; try another backend."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


def _hop_by_hop(raw_headers: Sequence[tuple[bytes, bytes]], base: frozenset[bytes]) -> frozenset[bytes]:
    """``base`` plus every header name a ``Connection`` header lists (RFC 9110 7.6.1)."""
    listed = [
        token.strip().lower()
        for name, value in raw_headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    ]
    return base.union(listed) if listed else base


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
        gate: ClientGate | None = None,
    ) -> None:
        self._pool = pool
        self._routing = routing
        self._metrics = metrics
        self._upstream = upstream
        self._admission: AdmissionControl[Backend] = admission or AdmissionControl(
            max_concurrency=None, max_backend_concurrency=None, queue_size=0, queue_timeout_s=1.0
        )
        self._gate = gate or ClientGate(settings)
        self._max_body_bytes = settings.max_body_bytes
        self._read_timeout = settings.request_read_timeout_s
        # The first-byte timeout covers the wait for the answer's head and a stream's first
        # chunk (engines send SSE headers before the prefill); the idle timeout the rest.
        self._first_byte_timeout = settings.first_byte_timeout_s
        self._idle_timeout = settings.idle_timeout_s
        self._session_header = settings.session_header
        self._strip_kvroute_headers = not settings.allow_policy_header
        self._decision_log = settings.decision_log

    # --- entry -----------------------------------------------------------------------
    async def forward(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Handle one request to a proxied endpoint."""
        started = time.monotonic()
        request_id = request.headers.get("x-request-id") or os.urandom(16).hex()
        try:
            if self._gate.active:
                self._gate.check(request)
            raw = await self._read_body(request)
            parsed = parse_request(raw, endpoint, request.headers, self._session_header)
            return await self._route(request, endpoint, parsed, raw, request_id, started)
        except RouterError as exc:
            response = exc.to_response()
            response.headers["x-request-id"] = request_id
            return response

    async def _read_body(self, request: web.Request) -> bytes:
        length = request.content_length
        if length is not None and length > self._max_body_bytes:
            # Refused before reading it; the connection closes rather than swallow the rest.
            raise RouterError(
                413, f"request body of {length} bytes is over the limit of {self._max_body_bytes}",
                code="request_too_large", close=True,
            )
        content = request.content
        if content.is_eof():
            # The whole body came with the head (nearly always): take it as is, no timer.
            raw = content.read_nowait()
            if len(raw) > self._max_body_bytes:
                raise RouterError(
                    413, f"request body is over the limit of {self._max_body_bytes} bytes",
                    code="request_too_large", close=True,
                )
            return raw
        try:
            async with asyncio.timeout(self._read_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RouterError(
                413, f"request body is over the limit of {self._max_body_bytes} bytes",
                code="request_too_large", close=True,
            ) from None
        except TimeoutError:
            raise RouterError(
                408, f"the request body did not arrive within {self._read_timeout:g} s",
                code="request_timeout", close=True,
            ) from None

    # --- choosing backends -----------------------------------------------------------
    async def _route(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        raw: bytes,
        request_id: str,
        started: float,
    ) -> web.StreamResponse:
        pool = self._pool
        model = parsed.model
        admission = self._admission
        failed: list[Backend] = []
        holds_slot = False
        last_error: RouterError | None = None

        def eligible() -> list[Backend]:
            candidates = pool.candidates(model)
            if not failed:
                return candidates
            others = [backend for backend in candidates if backend not in failed]
            # The retry is the client's last chance: not on a backend still on probation.
            proven = [backend for backend in others if backend.breaker.state is BreakerState.CLOSED]
            return proven or others

        prepared = await self._prepare(endpoint, parsed, len(raw))
        try:
            for attempt in range(2):
                if admission.limited:
                    # May wait for a turn (or raise 429); only backends with room come back.
                    candidates = list(await admission.admit(eligible, holds_slot=holds_slot))
                    holds_slot = True
                    alternatives = len(eligible())
                else:
                    candidates = eligible()
                    alternatives = len(candidates)
                if not candidates:
                    raise last_error or self._no_backend(model)
                plan = self._plan(endpoint, parsed, request, candidates, prepared)
                backend = pool.get(plan.backend)
                if backend is None:
                    log.error("policy %s chose %s, which is not in the pool", plan.policy, plan.backend)
                    raise RouterError(500, "routing chose an unknown backend", code="internal_error")
                can_retry = attempt == 0 and alternatives > 1
                try:
                    return await self._attempt(request, endpoint, parsed, raw, request_id, started, plan, backend, can_retry)
                except _Retry as retry:
                    failed.append(backend)
                    last_error = retry.error
                    log.debug("retrying %s elsewhere after %s failed: %s", request_id, backend.url, retry)
            raise last_error or RouterError(502, "no backend could take the request", code="backend_unavailable")
        finally:
            if holds_slot:
                admission.leave()

    async def _prepare(self, endpoint: Endpoint, parsed: ParsedRequest, size: int) -> PreparedPrompt | None:
        """Tokenize and hash the prompt once per request, not per attempt.

        Long prompts are tokenized in a worker thread (the tokenizer releases the GIL), so
        a 100K-token first turn does not stall every other request's relay.
        """
        if not self._routing.tracks_prefixes:
            return None
        if size >= THREAD_PREPARE_BYTES:
            return await asyncio.to_thread(self._routing.prepare, endpoint.path, parsed.body)
        return self._routing.prepare(endpoint.path, parsed.body)

    def _plan(
        self,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        request: web.Request,
        candidates: list[Backend],
        prepared: PreparedPrompt | None,
    ) -> RoutePlan:
        try:
            return self._routing.route(
                endpoint.path,
                parsed.body,
                request.headers,
                candidates,
                prepared=prepared,
                session_key=parsed.session_key,
                expected_output_tokens=parsed.expected_output_tokens,
            )
        except Exception:  # noqa: BLE001 - a routing bug must not cost the request
            log.exception("routing failed; falling back to the least loaded backend")
            backend = min(candidates, key=lambda b: (b.in_flight, b.in_flight_tokens))
            return RoutePlan(
                decision=Decision(backend.url, "routing_error"),
                policy="fallback",
                request=RouteRequest(endpoint=endpoint.path, model=parsed.model),
            )

    def _no_backend(self, model: str | None) -> RouterError:
        if model is not None and self._pool.healthy_count() and not self._pool.any_serves(model):
            return RouterError(404, f"The model `{model}` does not exist.", code="model_not_found")
        which = f" serving model `{model}`" if model is not None else ""
        return RouterError(503, f"no healthy backend{which}", code="no_healthy_backend")

    # --- one attempt on one backend ----------------------------------------------------
    async def _attempt(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        raw: bytes,
        request_id: str,
        started: float,
        plan: RoutePlan,
        backend: Backend,
        can_retry: bool,
    ) -> web.StreamResponse:
        tokens = (plan.request.prompt_tokens or 0) + parsed.expected_output_tokens
        outcome = _Outcome()
        self._pool.acquire(backend, tokens)
        try:
            return await self._exchange(request, endpoint, parsed, raw, request_id, started, plan, backend, can_retry, outcome)
        except asyncio.CancelledError:
            outcome.status = "499"  # the client hung up (or the drain timeout ran out)
            self._pool.request_abandoned(backend)
            raise
        finally:
            self._pool.release(backend, tokens)
            if self._admission.limited:
                self._admission.wake()  # a backend slot freed
            self._finish(plan, endpoint, outcome, started)

    async def _exchange(
        self,
        request: web.Request,
        endpoint: Endpoint,
        parsed: ParsedRequest,
        raw: bytes,
        request_id: str,
        started: float,
        plan: RoutePlan,
        backend: Backend,
        can_retry: bool,
        outcome: _Outcome,
    ) -> web.StreamResponse:
        inject_usage = parsed.stream and endpoint.accepts_stream_options and not parsed.include_usage
        body = raw
        if inject_usage:
            try:
                body = body_with_usage_requested(parsed.body)
            except orjson.JSONEncodeError:
                # Nested deeper than orjson writes (it reads deeper): forward it as sent.
                inject_usage = False
        headers = self._upstream_headers(request, backend, request_id, inject_usage)
        try:
            upstream = await self._upstream.post(
                backend.url, request.raw_path.encode(), headers, body, first_byte_timeout=self._first_byte_timeout
            )
        except UpstreamError as exc:
            unreachable = isinstance(exc, (UpstreamConnectError, UpstreamDisconnected))
            self._pool.request_failed(backend, unreachable=unreachable)
            raise self._failed_before_first_byte(backend, exc, outcome, can_retry) from None

        completed = False
        try:
            status = upstream.status
            if status >= 500:
                self._pool.request_failed(backend)
            else:
                self._pool.request_succeeded(backend)
            if can_retry and status in _RETRYABLE_STATUSES:
                outcome.status = _STATUS_LABELS[status]
                raise _Retry(RouterError(502, f"backend {backend.url} answered {status}", code="bad_gateway"))
            outcome.status = _STATUS_LABELS.get(status) or str(status)
            if upstream.is_event_stream:
                response = await self._relay_stream(
                    request, upstream, plan, backend, request_id, started, inject_usage, outcome, can_retry
                )
            else:
                response = await self._relay_body(upstream, endpoint, plan, backend, request_id, outcome, can_retry)
            completed = True
            return response
        finally:
            if completed:
                upstream.release()
            else:
                upstream.close()  # closes the connection: the engine sees the abort at once

    async def _relay_body(
        self,
        upstream: UpstreamResponse,
        endpoint: Endpoint,
        plan: RoutePlan,
        backend: Backend,
        request_id: str,
        outcome: _Outcome,
        can_retry: bool,
    ) -> web.StreamResponse:
        try:
            data = await upstream.read()
        except UpstreamError as exc:
            # Read whole before anything is sent: the client has seen nothing yet.
            self._pool.request_failed(backend)
            raise self._failed_before_first_byte(backend, exc, outcome, can_retry) from None
        if endpoint.reports_usage and upstream.status == 200:
            outcome.usage = usage_from_body(data)
        return web.Response(status=upstream.status, body=data, headers=self._response_headers(upstream, plan, request_id))

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        plan: RoutePlan,
        backend: Backend,
        request_id: str,
        started: float,
        strip_usage_chunk: bool,
        outcome: _Outcome,
        can_retry: bool,
    ) -> web.StreamResponse:
        read = upstream.read_available
        # The client gets the headers together with the first chunk: until then (engines
        # send SSE headers before the prefill) the request may still go elsewhere.
        try:
            chunk = await read()
            if not chunk:
                raise UpstreamProtocolError("the stream ended before its first event")
        except UpstreamError as exc:
            self._pool.request_failed(backend)
            raise self._failed_before_first_byte(backend, exc, outcome, can_retry) from None
        outcome.ttft_s = time.monotonic() - started
        # From the first chunk on, a stream may pause at most idle_timeout_s.
        upstream.set_timeout(self._idle_timeout)
        response = web.StreamResponse(status=upstream.status, headers=self._response_headers(upstream, plan, request_id))
        tap = StreamTap(strip_usage_chunk=strip_usage_chunk)
        write = response.write
        try:
            await response.prepare(request)
            while True:
                forward = tap.feed(chunk)
                if forward:
                    await write(forward)
                try:
                    chunk = await read()
                except UpstreamError as exc:
                    self._pool.request_failed(backend)
                    outcome.status = "502"
                    log.warning("stream from %s broke off: %s", backend.url, exc)
                    await write(sse_error_event(f"the backend's stream broke off: {exc}"))
                    break
                if not chunk:
                    rest = tap.finish()
                    if rest:
                        await write(rest)
                    break
            outcome.usage = tap.usage
            await response.write_eof()
        except ConnectionResetError:
            # The client hung up and a write noticed first: abort the engine's work now.
            outcome.status = "499"
            self._pool.request_abandoned(backend)
            upstream.close()
        return response

    @staticmethod
    def _failed_before_first_byte(
        backend: Backend, exc: UpstreamError, outcome: _Outcome, can_retry: bool
    ) -> Exception:
        """The error for an attempt that failed before the client saw anything: retry it
        elsewhere when there is an alternative, else a 504 (timeout) or 502."""
        if isinstance(exc, UpstreamTimeout):
            outcome.status = "504"
            error = RouterError(504, f"backend {backend.url} did not answer in time: {exc}", code="upstream_timeout")
        elif isinstance(exc, (UpstreamConnectError, UpstreamDisconnected)):
            outcome.status = "502"
            error = RouterError(
                502, f"backend {backend.url} failed before answering: {exc}", code="backend_unreachable"
            )
        else:
            outcome.status = "502"
            error = RouterError(502, f"backend {backend.url} broke off its answer: {exc}", code="bad_gateway")
        return _Retry(error) if can_retry else error

    # --- headers -----------------------------------------------------------------------
    def _upstream_headers(
        self, request: web.Request, backend: Backend, request_id: str, identity_encoding: bool
    ) -> list[tuple[bytes, bytes]]:
        strip_kvroute = self._strip_kvroute_headers
        replace_auth = backend.api_key is not None
        raw_headers = request.raw_headers
        skip = _hop_by_hop(raw_headers, _REQUEST_SKIP)
        headers = [(b"x-request-id", request_id.encode())]
        for name, value in raw_headers:
            lower = name.lower()
            if (
                lower in skip
                or (strip_kvroute and lower.startswith(b"x-kvroute-"))
                or (replace_auth and lower == b"authorization")
                or (identity_encoding and lower == b"accept-encoding")
            ):
                continue
            headers.append((name, value))
        if replace_auth:
            headers.append((b"Authorization", b"Bearer " + str(backend.api_key).encode()))
        if identity_encoding:
            # The router must read the stream to remove the usage chunk it asked for.
            headers.append((b"Accept-Encoding", b"identity"))
        return headers

    @staticmethod
    def _response_headers(upstream: UpstreamResponse, plan: RoutePlan, request_id: str) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        raw_headers = upstream.raw_headers
        skip = _hop_by_hop(raw_headers, _RESPONSE_SKIP)
        for name, value in raw_headers:
            if name.lower() not in skip:
                headers.add(name.decode("latin-1"), value.decode("latin-1"))
        headers["x-kvroute-backend"] = plan.backend
        headers["x-kvroute-policy"] = plan.policy
        headers["x-kvroute-reason"] = plan.reason
        prompt_tokens = plan.request.prompt_tokens
        if prompt_tokens is not None:
            headers["x-kvroute-prompt-tokens"] = str(prompt_tokens)
            headers["x-kvroute-matched-tokens"] = str(plan.predicted_cached_tokens)
        headers["x-request-id"] = request_id
        return headers

    # --- bookkeeping -------------------------------------------------------------------
    def _finish(self, plan: RoutePlan, endpoint: Endpoint, outcome: _Outcome, started: float) -> None:
        """Metrics, routing feedback and the decision log for one finished attempt."""
        usage = outcome.usage
        prompt_tokens = usage.prompt_tokens if usage is not None else None
        cached_tokens = usage.cached_tokens if usage is not None else None
        duration = time.monotonic() - started
        self._metrics.record_request(
            plan.backend, plan.policy, endpoint.name, outcome.status, duration, outcome.ttft_s,
            prompt_tokens, plan.predicted_cached_tokens, cached_tokens,
        )
        self._metrics.record_decision(plan.policy, plan.reason)
        try:
            self._routing.observe(plan, cached_tokens)
        except Exception:  # noqa: BLE001 - feedback must never fail a request
            log.exception("routing feedback failed")
        if self._decision_log:
            decision_log.info(
                orjson.dumps(
                    {
                        "backend": plan.backend,
                        "policy": plan.policy,
                        "reason": plan.reason,
                        "endpoint": endpoint.name,
                        "status": outcome.status,
                        "prompt_tokens": plan.request.prompt_tokens if prompt_tokens is None else prompt_tokens,
                        "predicted_cached_tokens": plan.predicted_cached_tokens,
                        "observed_cached_tokens": cached_tokens,
                        "ttft_s": outcome.ttft_s,
                        "duration_s": round(duration, 6),
                    }
                ).decode()
            )


