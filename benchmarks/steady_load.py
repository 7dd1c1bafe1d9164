"""Steady, bounded client load with an account of every request: the yardstick of reliability.

:class:`SteadyLoad` runs ``concurrency`` client loops against an OpenAI-compatible URL
(the router) with the real ``openai`` SDK: a seeded mix of streaming and non-streaming
chat completions, some of whose clients hang up mid-stream on purpose. Every request ends
in exactly one :class:`Outcome`:

* ``completed``: a whole answer (non-streaming: a ``finish_reason``; streaming: a chunk
  with a ``finish_reason`` and the stream's end);
* ``failed``: an explicit error the client can act on: an HTTP error with an OpenAI-style
  JSON body, or an SSE ``error`` event. ``before_first_byte`` tells whether any content
  had reached the client first (an error after content is the only honest outcome of a
  stream whose engine died; before content the router should have retried elsewhere);
* ``disconnected``: the client hung up on purpose;
* ``lost``: anything else: no answer within the client timeout (hung), a connection
  closed without an answer, a stream cut without an error, an error that is not
  OpenAI-style JSON. A reliable router has none.

Used by the fault-injection suite (``tests/faults``) and the soak (``benchmarks/soak.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
import openai

WORDS = (
    "river",
    "mountain",
    "cache",
    "token",
    "prefix",
    "engine",
    "router",
    "stream",
    "batch",
    "memory",
    "block",
    "queue",
    "latency",
    "graph",
    "vector",
    "kernel",
    "tensor",
    "shard",
    "replica",
    "fleet",
    "policy",
    "budget",
    "answer",
    "question",
    "story",
    "ocean",
)
SYSTEM_PROMPTS = (
    "You are a terse assistant. Answer in one sentence.",
    "You are a helpful travel guide who knows every river and mountain on earth.",
    "You are a code reviewer. Point out bugs, then suggest a fix, then stop.",
    "You summarise documents for busy engineers, keeping every number exact.",
)


class Outcome(enum.StrEnum):
    """How one request ended; see the module docstring."""

    COMPLETED = "completed"
    FAILED = "failed"
    DISCONNECTED = "disconnected"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class LoadMix:
    """What the clients send."""

    #: Share of streaming requests.
    stream_share: float = 0.6
    #: Share of streaming requests whose client hangs up after a few chunks.
    disconnect_share: float = 0.2
    min_tokens: int = 8
    max_tokens: int = 48
    #: User-turn words per request (on top of one of the shared system prompts).
    prompt_words: int = 40
    #: Draw user turns from this many distinct texts (None: a new text every request). A
    #: bounded set lets the router's caches reach their steady state, as real traffic does.
    distinct_prompts: int | None = None
    model: str = "sim"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's end."""

    kind: str  # "stream", "non_stream" or "disconnect"
    outcome: Outcome
    #: Content had reached the client before the end.
    after_first_byte: bool
    #: The HTTP status of an error answer, the SSE error's code, or why it is lost.
    detail: str
    started: float
    duration_s: float


@dataclass(slots=True)
class Tally:
    """Counts over a set of records."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    failed_before_first_byte: int = 0
    disconnected: int = 0
    lost: int = 0
    #: Error statuses/codes of failed requests, and reasons of lost ones.
    failures: Counter[str] = field(default_factory=Counter)
    lost_reasons: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> Tally:
        tally = cls()
        for record in records:
            tally.sent += 1
            if record.outcome is Outcome.COMPLETED:
                tally.completed += 1
            elif record.outcome is Outcome.FAILED:
                tally.failed += 1
                tally.failures[record.detail] += 1
                if not record.after_first_byte:
                    tally.failed_before_first_byte += 1
            elif record.outcome is Outcome.DISCONNECTED:
                tally.disconnected += 1
            else:
                tally.lost += 1
                tally.lost_reasons[record.detail] += 1
        return tally

    def as_dict(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "completed": self.completed,
            "failed_with_error": self.failed,
            "failed_before_first_byte": self.failed_before_first_byte,
            "client_disconnected": self.disconnected,
            "lost": self.lost,
            "failures": dict(self.failures),
            "lost_reasons": dict(self.lost_reasons),
        }


def _is_openai_error(payload: Any) -> bool:
    """``{"error": {"message": str, "type": str, "code": ...}}``."""
    if not isinstance(payload, dict):
        return False
    error = payload.get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error and "code" in error


class SteadyLoad:
    """``concurrency`` client loops against ``base_url`` until stopped; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        *,
        concurrency: int = 8,
        mix: LoadMix | None = None,
        seed: int = 0,
        request_timeout_s: float = 30.0,
        api_key: str = "kvroute-load",
        pause_s: float = 0.0,
    ) -> None:
        self.mix = mix or LoadMix()
        self.records: list[RequestRecord] = []
        self._concurrency = concurrency
        self._random = random.Random(seed)
        self._pause_s = pause_s
        self._client = openai.AsyncOpenAI(
            base_url=base_url.rstrip("/") + "/v1",
            api_key=api_key,
            max_retries=0,  # every attempt is counted; the router does the retrying
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
        )
        self._stop = asyncio.Event()
        self._workers: list[asyncio.Task[None]] = []
        self._texts = [self._words() for _ in range(self.mix.distinct_prompts or 0)]

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def start(self) -> None:
        """Start the client loops."""
        self._stop.clear()
        self._workers = [asyncio.create_task(self._loop(), name=f"load-{n}") for n in range(self._concurrency)]

    async def stop(self) -> None:
        """Let every client finish the request it is in, then stop."""
        self._stop.set()
        await asyncio.gather(*self._workers)
        self._workers = []

    async def close(self) -> None:
        await self._client.close()

    def tally(self, since: float | None = None) -> Tally:
        """Counts over every record, or over those started at or after ``since``."""
        records = self.records if since is None else [r for r in self.records if r.started >= since]
        return Tally.of(records)

    # --- one client --------------------------------------------------------------------
    async def _loop(self) -> None:
        while not self._stop.is_set():
            self.records.append(await self.one())
            if self._pause_s:
                await asyncio.sleep(self._pause_s)

    def _request(self) -> tuple[str, dict[str, Any], int]:
        mix, rng = self.mix, self._random
        if rng.random() < mix.stream_share:
            kind = "disconnect" if rng.random() < mix.disconnect_share else "stream"
        else:
            kind = "non_stream"
        words = rng.choice(self._texts) if self._texts else self._words()
        body = {
            "model": mix.model,
            "messages": [
                {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                {"role": "user", "content": words},
            ],
            "max_tokens": rng.randint(mix.min_tokens, mix.max_tokens),
        }
        return kind, body, rng.randint(1, 3)

    def _words(self) -> str:
        return " ".join(self._random.choice(WORDS) for _ in range(self.mix.prompt_words))

    async def one(self) -> RequestRecord:
        """Send one request of the mix and account for how it ended."""
        kind, body, hang_up_after = self._request()
        started = time.monotonic()
        seen_content = False

        def record(outcome: Outcome, detail: str) -> RequestRecord:
            return RequestRecord(kind, outcome, seen_content, detail, started, time.monotonic() - started)

        try:
            if kind == "non_stream":
                answer = await self._client.chat.completions.create(**body)
                if answer.choices and answer.choices[0].finish_reason:
                    return record(Outcome.COMPLETED, "")
                return record(Outcome.LOST, "answer without finish_reason")
            stream = await self._client.chat.completions.create(**body, stream=True)
            finished = False
            try:
                async for chunk in stream:
                    seen_content = True
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finished = True
                    if kind == "disconnect" and not finished:
                        hang_up_after -= 1
                        if hang_up_after == 0:
                            return record(Outcome.DISCONNECTED, "")
            finally:
                with contextlib.suppress(Exception):
                    await stream.close()
            if finished:
                return record(Outcome.COMPLETED, "")
            return record(Outcome.LOST, "stream ended without finish_reason or error")
        except openai.APITimeoutError:
            return record(Outcome.LOST, "hung: no answer within the client timeout")
        except openai.APIConnectionError as exc:
            return record(Outcome.LOST, f"connection closed without an answer ({exc.__cause__!r})"[:160])
        except openai.APIStatusError as exc:
            try:
                payload = exc.response.json()
            except ValueError:
                payload = None
            if _is_openai_error(payload):
                return record(Outcome.FAILED, f"{exc.status_code} {payload['error']['code']}")
            return record(Outcome.LOST, f"{exc.status_code} without an OpenAI-style error body")
        except openai.APIError as exc:  # an SSE error event
            if isinstance(exc.body, dict) and isinstance(exc.body.get("message"), str):
                return record(Outcome.FAILED, f"stream error {exc.body.get('code')}")
            return record(Outcome.LOST, f"stream error without an error object: {exc}"[:160])
        except Exception as exc:
            return record(Outcome.LOST, f"{type(exc).__name__}: {exc}"[:160])


def format_table(rows: Sequence[tuple[str, Tally]]) -> str:
    """A fixed-width table: one line per scenario."""
    header = ("scenario", "sent", "completed", "failed (error)", "before 1st byte", "client hung up", "lost")
    lines = [f"{header[0]:<24}" + "".join(f"{title:>16}" for title in header[1:])]
    for name, tally in rows:
        values = (
            tally.sent,
            tally.completed,
            tally.failed,
            tally.failed_before_first_byte,
            tally.disconnected,
            tally.lost,
        )
        lines.append(f"{name:<24}" + "".join(f"{value:>16}" for value in values))
    return "\n".join(lines)
