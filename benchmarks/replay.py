"""The replay driver: send a workload to one base URL at its arrival times, measure each request.

Every request is sent streaming (chats and completions with ``stream_options.include_usage``),
so one request gives its time to first token (first event that carries generated text), its
end-to-end latency and the engine's usage (prompt and cached tokens; each endpoint's stream
as :mod:`kvroute.benchmarks.wire` reads it). The
``x-kvroute-*`` response headers, when a kvroute router is in front, add the backend chosen
and the tokens the router predicted to be cached.

Timing model: a request is sent at ``arrival_s / speedup`` after the start, but never before
the previous request of its session has finished (a user reads the answer before the next
turn; an agent runs its tool first), plus the request's ``think_s / speedup`` after that
answer (think time is modelled time, scaled like arrival times). Requests without a session
are independent (open loop).
``max_in_flight`` bounds the client's own concurrency so a slow target queues in the client,
where the queueing is counted in TTFT, instead of exhausting sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

import aiohttp
import orjson

from kvroute.benchmarks.wire import RENDERED_BY, stream_of, streaming_body
from kvroute.benchmarks.workloads import WorkloadRequest


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    session_id: str | None
    sent_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    status: int = 0
    error: str | None = None
    backend: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class ReplayResult:
    """Every request's record, in send order of the workload, and the wall time it took."""

    records: list[RequestRecord]
    duration_s: float

    @property
    def errors(self) -> int:
        return sum(1 for record in self.records if not record.ok)

    @property
    def completed(self) -> int:
        return len(self.records) - self.errors


class Progress:
    """A one-line progress bar on stderr (a line per quarter when stderr is not a terminal)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.errors = 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._last_draw = 0.0
        self._last_quarter = 0

    def advance(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        now = time.monotonic()
        if self._tty and (now - self._last_draw > 0.1 or self.done == self.total):
            self._last_draw = now
            filled = int(30 * self.done / self.total)
            self._stream.write(
                f"\r  {self.label:<40} [{'#' * filled}{'.' * (30 - filled)}] "
                f"{self.done}/{self.total} errors {self.errors}"
            )
            self._stream.flush()
        quarter = 4 * self.done // self.total
        if not self._tty and quarter != self._last_quarter:
            self._last_quarter = quarter
            self._stream.write(f"  {self.label}: {self.done}/{self.total} errors {self.errors}\n")
            self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()


def _header_int(headers: Mapping[str, str], name: str) -> int | None:
    value = headers.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _headers(request: WorkloadRequest) -> dict[str, str]:
    """JSON content type, and the session in ``x-session-id`` (sticky routing reads it)."""
    if request.session_id is None:
        return {"content-type": "application/json"}
    return {"content-type": "application/json", "x-session-id": request.session_id}


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    request: WorkloadRequest,
    record: RequestRecord,
    started: float,
    due: float,
) -> None:
    """Send one request (streaming) and fill ``record`` with what came back.

    ``due`` (a ``time.perf_counter()`` value) is when the request was ready to go; TTFT and
    latency count from there, so time spent waiting for the client's own concurrency limit
    counts as it would for a user.
    """
    stream = stream_of(request)
    sent = due
    record.sent_s = due - started
    try:
        rendered = None
        render_path = RENDERED_BY.get(request.endpoint)
        if render_path is not None:  # the engine's renderer first, as a scale-out client does
            async with session.post(
                url + render_path, data=orjson.dumps(request.body), headers=_headers(request)
            ) as render:
                if render.status != 200:
                    record.status = render.status
                    record.error = f"render: HTTP {render.status}: {(await render.text())[:200]}"
                    return
                rendered = orjson.loads(await render.read())
        body = streaming_body(request, rendered)
        async with session.post(
            url + request.endpoint,
            data=orjson.dumps(body),
            headers=_headers(request),
        ) as response:
            record.status = response.status
            record.backend = response.headers.get("x-kvroute-backend")
            record.predicted_cached_tokens = _header_int(response.headers, "x-kvroute-matched-tokens")
            if response.status != 200:
                text = await response.text()
                record.error = f"HTTP {response.status}: {text[:200]}"
                return
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                if record.ttft_s is not None and b'"usage"' not in payload and b'"error"' not in payload:
                    continue  # a text chunk after the first: nothing more to learn
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    record.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                if record.ttft_s is None and stream.has_text(chunk):
                    record.ttft_s = time.perf_counter() - sent
                usage = stream.usage(chunk)
                if usage is not None:
                    record.prompt_tokens = usage.prompt_tokens
                    record.cached_tokens = usage.cached_tokens
            record.latency_s = time.perf_counter() - sent
            if record.ttft_s is None:
                record.ttft_s = record.latency_s  # no text at all (max_tokens 0 or empty)
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]


def _sessions(requests: Sequence[WorkloadRequest]) -> list[list[int]]:
    """Indices of the requests grouped by session (each sessionless request alone), in order."""
    groups: dict[str, list[int]] = {}
    loose: list[list[int]] = []
    for index, request in enumerate(requests):
        if request.session_id is None:
            loose.append([index])
        else:
            groups.setdefault(request.session_id, []).append(index)
    return [*groups.values(), *loose]


async def replay(
    base_url: str | Sequence[str],
    requests: Sequence[WorkloadRequest],
    *,
    speedup: float = 1.0,
    max_in_flight: int = 256,
    timeout_s: float = 900.0,
    progress: Progress | None = None,
) -> ReplayResult:
    """Send ``requests`` to ``base_url`` (e.g. ``http://127.0.0.1:8000``) and measure them.

    Several URLs (router replicas) take the requests in turn, in the order they are sent,
    as a client-side round robin in front of them would.
    """
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    urls = [url.rstrip("/") for url in urls]
    turns = itertools.count()
    records = [RequestRecord(request.session_id, 0.0) for request in requests]
    gate = asyncio.Semaphore(max_in_flight)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    started = time.perf_counter()

    async def run_session(indices: list[int]) -> None:
        answered = started  # when this session's previous answer arrived
        for index in indices:
            request = requests[index]
            not_before = max(started + request.arrival_s / speedup, answered + request.think_s / speedup)
            delay = not_before - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            due = time.perf_counter()
            async with gate:
                await send_one(client, urls[next(turns) % len(urls)], request, records[index], started, due)
            answered = time.perf_counter()
            if progress is not None:
                progress.advance(records[index].ok)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as client:
        await asyncio.gather(*(run_session(group) for group in _sessions(requests)))
    if progress is not None:
        progress.close()
    return ReplayResult(records, time.perf_counter() - started)
