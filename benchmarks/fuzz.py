"""Fuzzing the router's HTTP surface: generated requests, zero router 5xx, zero crashes.

``python -m kvroute.benchmarks.fuzz --cases 100000`` starts two sim engines and ``kvroute serve``
(subprocesses), sends that many generated requests (8 at a time), checks every answer,
prints a table and writes ``fuzz.json``. The cases come from two sources:

* a corpus drawn from the hypothesis strategies below (the same ones ``tests/router/http/test_fuzz.py``
  runs in CI): random bytes; JSON of every type at the top level; chat / completion bodies
  with wrong types in any field, huge numbers, odd unicode, lone surrogates (invalid
  UTF-8 on the wire); valid bodies with bytes flipped, cut or inserted; nesting 10^4
  deep; mostly POSTs to the proxied endpoints, sometimes unknown paths and methods;
* fast seeded mutations of that corpus (:class:`Mutator`: byte flips, cuts, splices of two
  bodies, a JSON field replaced by another case's value or by deep nesting), since
  drawing 10^5 examples from hypothesis itself would take an hour on a small machine.

Each answer is judged by :func:`judge`: a router-made answer (no ``x-kvroute-backend``
header) must be below 500 -- except 502/503/504, which are honest statements about an
upstream -- and every router error must be OpenAI-style JSON. Answers relayed from an
engine are the engine's (counted apart). At the end the router must still be healthy and
its log free of unhandled errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvroute.router.routing.request_info import ENDPOINTS

PROXIED_PATHS = [endpoint.path for endpoint in ENDPOINTS]
OTHER_PATHS = [
    "/",
    "/v1",
    "/v1/models",
    "/health",
    "/metrics",
    "/openapi.json",
    "/admin/backends",
    "/v1/chat/completions/",
    "/v1/../metrics",
    "/%00",
    "/v2/chat/completions",
]
UPSTREAM_STATUSES = frozenset({502, 503, 504})
MODEL = "sim"


# --- strategies --------------------------------------------------------------------------
def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value, with the awkward corners: huge ints, floats, unicode, surrogates."""
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=24)
        | st.sampled_from(["", "sim", "\ud800", "\x00", "é" * 3, "🚀", "a" * 300])
    )
    return st.recursive(
        leaves,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=max_leaves,
    )


def _messages() -> st.SearchStrategy[Any]:
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]), "content": st.text(max_size=40)}
    )
    return st.lists(message, min_size=1, max_size=4)


def well_formed_bodies() -> st.SearchStrategy[dict[str, Any]]:
    """Bodies an engine accepts (mostly): the base that wrong types are injected into."""
    return st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": _messages(), "prompt": st.text(min_size=1, max_size=40)},
        optional={
            "stream": st.booleans(),
            "max_tokens": st.integers(min_value=1, max_value=24),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "temperature": st.floats(min_value=0, max_value=2),
            "user": st.text(max_size=8),
            "cache_salt": st.text(min_size=1, max_size=8),
        },
    )


@st.composite
def wrong_typed_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed body with some fields replaced by any JSON value, or deleted."""
    body = draw(well_formed_bodies())
    fields = sorted(body) + ["n", "max_completion_tokens", "tools", "input", "tokens", "text"]
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()):
            body[name] = draw(json_values())
        else:
            body.pop(name, None)
    return body


def decode(data: bytes) -> Any:
    """The JSON value of ``data``; :class:`ValueError` for anything not JSON (too deep included)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deep") from None


def encode(value: Any) -> bytes:
    """JSON text; lone surrogates become invalid UTF-8 bytes instead of an encoding error."""
    return json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def mutated_bytes(draw: st.DrawFn) -> bytes:
    """A valid body's bytes with a few bytes flipped, cut or inserted."""
    data = bytearray(encode(draw(well_formed_bodies())))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        position = draw(st.integers(min_value=0, max_value=max(0, len(data) - 1)))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and data:
            data[position] ^= draw(st.integers(min_value=1, max_value=255))
        elif action == "cut":
            del data[position:]
        else:
            data[position:position] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


def deep_nesting() -> st.SearchStrategy[bytes]:
    depth = st.integers(min_value=100, max_value=20_000)
    arrays = depth.map(lambda n: b"[" * n + b"]" * n)
    objects = depth.map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
    in_field = depth.map(lambda n: b'{"model":"sim","messages":' + b"[" * n + b"]" * n + b"}")
    return arrays | objects | in_field


def bodies() -> st.SearchStrategy[bytes]:
    """Every kind of body, weighted towards those that get past the JSON parser."""
    return st.one_of(
        st.binary(max_size=256),
        json_values().map(encode),
        wrong_typed_bodies().map(encode),
        wrong_typed_bodies().map(encode),
        well_formed_bodies().map(encode),
        mutated_bytes(),
        deep_nesting(),
    )


@dataclass(frozen=True, slots=True)
class FuzzCase:
    method: str
    path: str
    body: bytes
    content_type: str | None


@st.composite
def fuzz_cases(draw: st.DrawFn) -> FuzzCase:
    """One request: mostly a POST to a proxied endpoint, sometimes anything else."""
    if draw(st.integers(min_value=0, max_value=9)) == 0:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "POST", "HEAD"]))
        path = draw(st.sampled_from(OTHER_PATHS + PROXIED_PATHS))
    else:
        method, path = "POST", draw(st.sampled_from(PROXIED_PATHS))
    content_type = draw(st.sampled_from(["application/json", "application/json", "text/plain", None]))
    return FuzzCase(method, path, draw(bodies()), content_type)


# --- judging -----------------------------------------------------------------------------
def _is_openai_error(data: bytes) -> bool:
    try:
        payload = decode(data)
    except ValueError:
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error and "code" in error


def judge(case: FuzzCase, status: int, headers: httpx.Headers, body: bytes) -> str | None:
    """None when the answer is acceptable, else what is wrong with it."""
    from_engine = "x-kvroute-backend" in headers
    if from_engine:
        return None  # the engine's own answer, relayed as it wrote it (counted apart)
    if status >= 500 and status not in UPSTREAM_STATUSES:
        return f"router answered {status} to {case.method} {case.path} {case.body[:300]!r}: {body[:200]!r}"
    if status >= 400 and case.method != "HEAD" and not _is_openai_error(body):
        return f"router error {status} is not OpenAI-style JSON: {body[:200]!r}"
    return None


@dataclass(slots=True)
class FuzzStats:
    """What a fuzz run saw."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    engine_statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def record(self, case: FuzzCase, response: httpx.Response | None, error: Exception | None = None) -> None:
        self.cases += 1
        if response is None:
            self.transport_errors[type(error).__name__] += 1
            self.problems.append(f"no answer to {case.method} {case.path}: {error!r}"[:300])
            return
        if "x-kvroute-backend" in response.headers:
            self.engine_statuses[response.status_code] += 1
        else:
            self.statuses[response.status_code] += 1
        problem = judge(case, response.status_code, response.headers, response.content)
        if problem:
            self.problems.append(problem)

    @property
    def router_5xx(self) -> int:
        return sum(
            count for status, count in self.statuses.items() if status >= 500 and status not in UPSTREAM_STATUSES
        )


def corpus(size: int, seed: int) -> list[FuzzCase]:
    """``size`` cases drawn from :func:`fuzz_cases` (seeded: the same corpus every run)."""
    cases: list[FuzzCase] = []

    @settings(
        max_examples=size,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=fuzz_cases())
    def collect(case: FuzzCase) -> None:
        cases.append(case)

    hypothesis.seed(seed)(collect)()
    return cases


class Mutator:
    """Cheap, seeded variations of corpus cases (the bulk of a long fuzz run)."""

    def __init__(self, cases: list[FuzzCase], seed: int) -> None:
        if not cases:
            raise ValueError("an empty corpus")
        self._cases = cases
        self._rng = random.Random(seed)
        # Values to graft into bodies: every JSON value found at the top of corpus bodies.
        self._values: list[Any] = []
        for case in cases:
            try:
                parsed = decode(case.body)
            except ValueError:
                continue
            self._values.extend(parsed.values() if isinstance(parsed, dict) else [parsed])
        if not self._values:
            self._values = [None]

    def case(self) -> FuzzCase:
        rng = self._rng
        base = rng.choice(self._cases)
        roll = rng.random()
        if roll < 0.2:
            return base
        if roll < 0.55:
            body = self._graft(base.body)
        else:
            body = self._bytes(base.body)
        return FuzzCase(base.method, base.path, body, base.content_type)

    def _graft(self, body: bytes) -> bytes:
        """Replace, delete or add a top-level field of a JSON object body."""
        rng = self._rng
        try:
            parsed = decode(body)
        except ValueError:
            return self._bytes(body)
        if not isinstance(parsed, dict):
            parsed = {"model": MODEL, "messages": parsed}
        name = rng.choice([*parsed, "model", "messages", "stream", "max_tokens", "stream_options", "prompt"])
        action = rng.random()
        if action < 0.15:
            parsed.pop(name, None)
        elif action < 0.25:
            depth = rng.randint(500, 5000)
            return encode({**parsed, name: None}).replace(b"null", b"[" * depth + b"]" * depth, 1)
        else:
            parsed[name] = rng.choice(self._values)
        return encode(parsed)

    def _bytes(self, body: bytes) -> bytes:
        """Flip, cut, duplicate or splice bytes."""
        rng = self._rng
        data = bytearray(body)
        for _ in range(rng.randint(1, 3)):
            position = rng.randint(0, max(0, len(data) - 1))
            action = rng.random()
            if action < 0.35 and data:
                data[position] ^= rng.randint(1, 255)
            elif action < 0.55:
                del data[position : position + rng.randint(1, 16)]
            elif action < 0.75:
                data[position:position] = data[position : position + rng.randint(1, 32)]
            else:
                other = rng.choice(self._cases).body
                data = data[:position] + other[rng.randint(0, len(other)) :]
        return bytes(data)


async def send(client: httpx.AsyncClient, base_url: str, case: FuzzCase) -> httpx.Response:
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    return await client.request(case.method, base_url + case.path, content=case.body or None, headers=headers)


async def fuzz(base_url: str, cases: Any, stats: FuzzStats, concurrency: int = 8, progress_every: int = 0) -> None:
    """Send every case of the iterable ``cases`` (``concurrency`` at a time) and judge the answers."""
    iterator = iter(cases)
    started = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        for case in iterator:
            try:
                response = await send(client, base_url, case)
            except httpx.HTTPError as exc:
                stats.record(case, None, exc)
            else:
                stats.record(case, response)
            if progress_every and stats.cases % progress_every == 0:
                rate = stats.cases / (time.monotonic() - started)
                print(f"{stats.cases:>8} cases  {rate:6.0f}/s  problems {len(stats.problems)}", file=sys.stderr)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


# --- the benchmark -----------------------------------------------------------------------
async def _run(args: argparse.Namespace) -> tuple[FuzzStats, dict[str, Any]]:
    from kvroute.benchmarks.fleet import SimFleet, SimSpec, start_router

    print(f"drawing a corpus of {args.corpus} cases from the hypothesis strategies...", file=sys.stderr)
    seeds = corpus(args.corpus, args.seed)
    mutator = Mutator(seeds, args.seed)
    cases = [*seeds, *(mutator.case() for _ in range(max(0, args.cases - len(seeds))))]
    fleet = SimFleet(SimSpec(replicas=2, time_scale=1000.0))
    await fleet.fresh()
    stats = FuzzStats()
    try:
        router = await start_router("cache_aware", fleet.urls, extra_args=("--max-body-bytes", str(1 << 20)))
        try:
            await fuzz(router.url, cases, stats, concurrency=args.concurrency, progress_every=5000)
            async with httpx.AsyncClient(timeout=30.0) as client:
                health = (await client.get(router.url + "/health")).status_code
            alive = router.process.poll() is None
            log = router.log_tail(10**9)
        finally:
            router.stop()
    finally:
        fleet.stop()
    unhandled = sum(1 for line in log.splitlines() if "Traceback" in line or "unhandled error" in line)
    return stats, {"router_alive": alive, "health_after": health, "unhandled_errors_in_log": unhandled}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--corpus", type=int, default=1_000, help="cases drawn from hypothesis itself")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fuzz.json"))
    args = parser.parse_args(argv)

    started = time.monotonic()
    stats, after = asyncio.run(_run(args))
    elapsed = time.monotonic() - started
    result = {
        "cases": stats.cases,
        "corpus_from_hypothesis": min(args.corpus, stats.cases),
        "seconds": round(elapsed, 1),
        "router_statuses": {str(k): v for k, v in sorted(stats.statuses.items())},
        "engine_statuses": {str(k): v for k, v in sorted(stats.engine_statuses.items())},
        "router_5xx_not_upstream": stats.router_5xx,
        "transport_errors": dict(stats.transport_errors),
        "problems": stats.problems[:50],
        **after,
    }
    args.out.write_text(json.dumps(result, indent=2))
    rows = [
        ("cases", stats.cases),
        ("seconds", f"{elapsed:.1f}"),
        ("router answers by status", dict(sorted(stats.statuses.items()))),
        ("engine answers by status", dict(sorted(stats.engine_statuses.items()))),
        ("router 5xx (not 502/3/4)", stats.router_5xx),
        ("no answer (transport)", sum(stats.transport_errors.values())),
        ("problems", len(stats.problems)),
        ("router alive / health", f"{after['router_alive']} / {after['health_after']}"),
        ("unhandled errors in log", after["unhandled_errors_in_log"]),
    ]
    for name, value in rows:
        print(f"{name:<28}{value}")
    for problem in stats.problems[:10]:
        print("  " + problem)
    print(f"written: {args.out}")
    ok = not stats.problems and after["router_alive"] and after["health_after"] == 200
    return 0 if ok and not after["unhandled_errors_in_log"] else 1


if __name__ == "__main__":
    sys.exit(main())
