"""``kvroute serve`` with a thread-CPU timer around each routing stage (for profiling only).

    python3 -m kvroute.benchmarks.stage_timers OUT.json serve --policy cache_aware --backend ...

Wraps the functions of the request path that do the routing work (parse, render,
tokenize, hash, prepare, index match and insert, the policy's choice, route, observe,
metrics) so each call adds its ``time.thread_time_ns`` to its stage, then runs ``kvroute``
with the remaining arguments. SIGUSR1 zeroes the counters (after a warm-up); SIGUSR2 and
exit write ``{stage: {"calls": n, "us_per_call": x}}`` to OUT.json. Unlike py-spy's
samples, this is CPU time only: waiting for the CPU never counts. Stages nest (prepare
holds render, tokenize and hash; route holds the index and the policy). The wrapper
itself costs ~1 us per call.
"""

from __future__ import annotations

import atexit
import importlib
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: (module, attribute path, stage): patched where the caller looks the function up.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("kvroute.router.forwarding.proxy", "parse_request", "parse"),
    ("kvroute.tokenizer_index.tokenizer", "RequestTokenizer.render_chat", "render"),
    ("kvroute.tokenizer_index.tokenizer", "RequestTokenizer.encode_text_array", "tokenize"),
    # Long chat prompts the memo knows skip encode_text_array (the two never nest).
    ("kvroute.tokenizer_index.tokenizer", "RequestTokenizer._encode_remembering", "tokenize"),
    ("kvroute.router.routing.routing_engine", "block_hashes", "hash"),
    ("kvroute.router.routing.routing_engine", "RoutingEngine.prepare", "prepare (render+tokenize+hash)"),
    # One call per event-loop turn's batch of prepares: calls/request is 1 / the mean batch.
    ("kvroute.router.forwarding.turn_batch", "TurnBatch._run_pending", "prepare batch (one call per batch)"),
    ("kvroute.tokenizer_index.prefix_index", "PrefixIndex.match_hashes", "index match"),
    ("kvroute.tokenizer_index.prefix_index", "PrefixIndex.insert_hashes", "index insert"),
    ("kvroute.router.routing.policies.cache_aware", "CacheAware.choose", "policy choice (cache_aware)"),
    ("kvroute.router.routing.routing_engine", "RoutingEngine.route", "route (match+policy+insert+ledgers)"),
    ("kvroute.router.routing.routing_engine", "RoutingEngine.observe", "observe"),
    ("kvroute.router.forwarding.metrics", "RouterMetrics.record_request", "metrics"),
)

_totals: dict[str, list[int]] = {}


def _timed(function: Callable[..., Any], stage: str) -> Callable[..., Any]:
    total = _totals.setdefault(stage, [0, 0])
    clock = time.thread_time_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return function(*args, **kwargs)
        finally:
            total[0] += clock() - started
            total[1] += 1

    return timed


def install() -> None:
    """Wrap every stage's function in place."""
    for module_name, path, stage in STAGES:
        owner: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        setattr(owner, name, _timed(getattr(owner, name), stage))


def reset() -> None:
    for total in _totals.values():
        total[0] = total[1] = 0


def snapshot() -> dict[str, dict[str, float]]:
    return {
        stage: {"calls": calls, "us_per_call": nanos / calls / 1000 if calls else 0.0}
        for stage, (nanos, calls) in _totals.items()
    }


def main(argv: list[str]) -> int:
    out = Path(argv[0])

    def write(*_: object) -> None:
        out.write_text(json.dumps(snapshot(), indent=2) + "\n")

    install()
    signal.signal(signal.SIGUSR1, lambda *_: reset())
    signal.signal(signal.SIGUSR2, write)
    atexit.register(write)
    from kvroute.router.cli import main as kvroute

    return kvroute(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
