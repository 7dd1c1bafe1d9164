"""``kvroute serve`` under cProfile, for Python-level calls per request (for profiling only).

    python3 -m kvroute.benchmarks.call_profile OUT.prof serve --policy round_robin --backend ...

Runs ``kvroute`` with the remaining arguments; SIGUSR1 starts a fresh profile (after a
warm-up), SIGUSR2 stops it and writes it to OUT.prof (``pstats``). ``profile_request
--calls`` drives it and divides by the requests answered meanwhile.

What the counts are: every call of a Python function, and of a C function from Python
(``len``, ``dict.get``, ``bytes.lower``, orjson); a coroutine counts once per resumption
(its start, and each return from an ``await`` that suspended). Not counted: object
construction by calling a class (``dict()``, a dataclass's ``__init__`` body aside) and
the event loop's own C work. cProfile names functions by file, line and name, so the
``__init__`` of every dataclass (``<string>:2``) shows as one of them: those are
undercounted. Times are wall clock and include cProfile's own overhead (roughly 2x the
CPU of the unprofiled router) and any preemption inside a call (a loopback ``send`` that
wakes the receiver): read them for ranking, the counts for change.
"""

from __future__ import annotations

import cProfile
import pstats
import signal
import sys
from dataclasses import dataclass

_profile: list[cProfile.Profile] = []


def _start(*_: object) -> None:
    _stop()
    profiler = cProfile.Profile()
    _profile[:] = [profiler]
    profiler.enable()


def _stop() -> cProfile.Profile | None:
    profiler = _profile[0] if _profile else None
    if profiler is not None:
        profiler.disable()
    return profiler


@dataclass(slots=True)
class CallRow:
    """One function: calls and own time per request."""

    function: str
    calls_per_request: float
    own_us_per_request: float
    cumulative_us_per_request: float


@dataclass(slots=True)
class CallProfile:
    requests: int
    calls_per_request: float
    #: Calls per request by where the function lives: builtins (C), router, tokenizer_index, other.
    groups: dict[str, float]
    #: Functions called at least once per 20 requests, most called first.
    functions: list[CallRow]


def _group(path: str) -> str:
    if path == "~":
        return "builtins"
    for room in ("/router/", "/tokenizer_index/", "/benchmarks/"):
        if room in path:
            return room.strip("/")
    return "other"


def summarize_calls(stats: pstats.Stats, requests: int, *, root: str = "") -> CallProfile:
    """Per-request calls of a profile taken over ``requests`` requests (``root``: a path
    prefix dropped from the function names)."""
    per = 1.0 / max(1, requests)
    groups: dict[str, float] = {}
    rows: list[CallRow] = []
    total = 0
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = stats.stats  # type: ignore[attr-defined]
    for (path, line, name), (_, calls, own, cumulative, _) in raw.items():
        total += calls
        group = _group(path)
        groups[group] = groups.get(group, 0.0) + calls * per
        if calls * per >= 0.05:
            where = name if path == "~" else f"{path.removeprefix(root)}:{line}({name})"
            rows.append(CallRow(where, calls * per, own * per * 1e6, cumulative * per * 1e6))
    rows.sort(key=lambda row: (-row.calls_per_request, row.function))
    ordered = dict(sorted(groups.items(), key=lambda item: -item[1]))
    return CallProfile(requests, total * per, ordered, rows)


def format_calls(profile: CallProfile, command: str, *, top: int = 30) -> str:
    lines = [
        f"# {command}",
        f"{profile.requests} requests, {profile.calls_per_request:.1f} Python-level calls per request",
        "  " + ", ".join(f"{group} {calls:.1f}" for group, calls in profile.groups.items()),
        "",
        f"{'calls/req':>9} {'own us/req':>10} {'cum us/req':>10}  function (most called first)",
    ]
    lines += [
        f"{row.calls_per_request:>9.2f} {row.own_us_per_request:>10.2f} {row.cumulative_us_per_request:>10.2f}  {row.function}"
        for row in profile.functions
    ]
    lines += ["", f"top {top} by own time (cProfile's wall clock, its overhead included):"]
    by_own = sorted(profile.functions, key=lambda row: -row.own_us_per_request)[:top]
    lines += [f"{row.own_us_per_request:>9.2f} us  {row.calls_per_request:>6.2f}/req  {row.function}" for row in by_own]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out = argv[0]

    def write(*_: object) -> None:
        profiler = _stop()
        if profiler is not None:
            profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, write)
    from kvroute.router.cli import main as kvroute

    return kvroute(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
