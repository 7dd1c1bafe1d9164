"""Benchmark results: one :class:`TargetResult` per target x workload, as JSON, table and plot.

``results.json`` is a list of :class:`TargetResult` objects (keys as the field names below).
A *target* is a ``kvroute serve`` policy (``round_robin``, ``cache_aware``, ...), a peer
router (``peer:sglang-router``, ``peer:vllm-router``) or ``bound``: the hit rate of one
unbounded cache over the same request sequence, the ceiling no fleet of finite caches beats.

Hit rates are fractions of prompt tokens: ``observed`` from the engines' own prefix-cache
counters (what really happened), ``predicted`` from the router's own counters (what kvroute
thought would happen; null for peers, load-only policies and the bound).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

BOUND_TARGET = "bound"
PEER_PREFIX = "peer:"


@dataclass(slots=True)
class BackendShare:
    """One backend's share (0..1) of a run's requests and of its prompt tokens."""

    requests: float
    prompt_tokens: float


@dataclass(slots=True)
class TargetResult:
    """What one target did with one workload."""

    target: str
    workload: str
    requests: int
    errors: int
    hit_rate_observed: float | None
    hit_rate_predicted: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    throughput_rps: float | None
    backend_share: dict[str, BackendShare] = field(default_factory=dict)
    ttft_p90_s: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    duration_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens_reported: int = 0
    sessions: int | None = None
    time_scale: float = 1.0  # sims ran this many times faster than real time
    status: str = "ok"
    error_sample: str | None = None  # the first error a client saw, if any

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TargetResult:
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["backend_share"] = {
            url: BackendShare(**share) for url, share in data.get("backend_share", {}).items()
        }
        return cls(**values)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of ``values``; None when there are none."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is not positive."""
    return numerator / denominator if denominator > 0 else None


def shares(requests: dict[str, float], prompt_tokens: dict[str, float]) -> dict[str, BackendShare]:
    """Per-backend shares from per-backend request and prompt-token counts."""
    total_requests = sum(requests.values())
    total_tokens = sum(prompt_tokens.values())
    return {
        url: BackendShare(
            requests=ratio(requests.get(url, 0.0), total_requests) or 0.0,
            prompt_tokens=ratio(prompt_tokens.get(url, 0.0), total_tokens) or 0.0,
        )
        for url in sorted(set(requests) | set(prompt_tokens))
    }


def write_json(results: Sequence[TargetResult], path: Path) -> None:
    path.write_text(json.dumps([result.to_json() for result in results], indent=2) + "\n")


def read_json(path: Path) -> list[TargetResult]:
    return [TargetResult.from_json(item) for item in json.loads(path.read_text())]


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _bound_of(results: Sequence[TargetResult], workload: str) -> float | None:
    for result in results:
        if result.workload == workload and result.target == BOUND_TARGET:
            return result.hit_rate_observed
    return None


def _balance(share: dict[str, BackendShare]) -> str:
    """Prompt-token shares in percent, backend by backend: "25/24/26/25"."""
    return "/".join(f"{round(s.prompt_tokens * 100)}" for s in share.values()) or "-"


def format_table(results: Sequence[TargetResult]) -> str:
    """A plain-text table, one row per target x workload, grouped by workload."""
    header = (
        "workload", "target", "reqs", "err", "hit obs", "hit pred", "of bound",
        "TTFT p50", "p90", "p99", "e2e p50", "req/s", "tokens % per backend",
    )
    rows: list[tuple[str, ...]] = []
    for result in results:
        bound = _bound_of(results, result.workload)
        of_bound = (
            ratio(result.hit_rate_observed, bound)
            if result.hit_rate_observed is not None and bound and result.target != BOUND_TARGET
            else None
        )
        if result.status != "ok":
            rows.append((result.workload, result.target, "-", "-", result.status,
                         *("",) * (len(header) - 5)))
            continue
        rows.append((
            result.workload, result.target, str(result.requests), str(result.errors),
            _fmt(result.hit_rate_observed, ".3f"), _fmt(result.hit_rate_predicted, ".3f"),
            _fmt(of_bound, ".0%"), _fmt(result.ttft_p50_s, ".3f"), _fmt(result.ttft_p90_s, ".3f"),
            _fmt(result.ttft_p99_s, ".3f"), _fmt(result.latency_p50_s, ".3f"),
            _fmt(result.throughput_rps, ".1f"), _balance(result.backend_share),
        ))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths))]
    lines.append("  ".join("-" * width for width in widths))
    previous = None
    for row in rows:
        if previous is not None and row[0] != previous:
            lines.append("")
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        previous = row[0]
    notes = [f"  {r.workload} / {r.target}: {r.errors} errors, e.g. {r.error_sample}"
             for r in results if r.error_sample]
    if notes:
        lines += ["", "errors:", *notes]
    return "\n".join(lines)


def _bars(axis, results: Sequence[TargetResult], targets: list[str], colors: dict[str, str],
          attribute: str, tick_attribute: str | None = None) -> None:
    """Grouped bars: one group per workload, one bar per target (and a tick for p99)."""
    workloads = list(dict.fromkeys(result.workload for result in results))
    found = {(r.target, r.workload): r for r in results}

    def value(target: str, workload: str, name: str) -> float:
        result = found.get((target, workload))
        number = getattr(result, name) if result is not None else None
        return float(number) if number is not None else math.nan

    width = 0.8 / max(1, len(targets))
    positions = np.arange(len(workloads))
    for number, target in enumerate(targets):
        where = positions + number * width
        axis.bar(where, [value(target, w, attribute) for w in workloads], width,
                 label=target, color=colors[target])
        if tick_attribute:
            axis.scatter(where, [value(target, w, tick_attribute) for w in workloads],
                         marker="_", s=250, color=colors[target])
    axis.set_xticks(positions + width * (len(targets) - 1) / 2, workloads, fontsize=8)
    axis.legend(fontsize=8)


def _sweep(axis, results: Sequence[TargetResult], colors: dict[str, str], attribute: str) -> None:
    """One line per target over the agent-sessions sweep."""
    axis.set_xscale("log", base=2)
    counts: set[int] = set()
    for target in dict.fromkeys(result.target for result in results):
        points = sorted(
            (r.sessions, getattr(r, attribute)) for r in results
            if r.target == target and getattr(r, attribute) is not None
        )
        if points:
            xs, ys = zip(*points)
            counts.update(xs)
            axis.plot(xs, ys, "--" if target == BOUND_TARGET else "-", marker="o",
                      label=target, color=colors[target])
    axis.set_xticks(sorted(counts), [str(count) for count in sorted(counts)])
    axis.set_xticks([], minor=True)
    axis.set_xlabel("agent sessions taking turns in lockstep")
    axis.legend(fontsize=8)


def plot_summary(results: Sequence[TargetResult], path: Path) -> None:
    """summary.png: hit rate and TTFT per target per workload; the agent-sessions sweep.

    Up to four panels: hit rate and TTFT as grouped bars for the plain workloads, and hit
    rate and TTFT against the number of sessions for the agent-sessions sweep.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [result for result in results if result.status == "ok"]
    targets = list(dict.fromkeys(result.target for result in ok))
    colors = {target: f"C{number % 10}" for number, target in enumerate(targets)}
    served = [target for target in targets if target != BOUND_TARGET]
    flat = [result for result in ok if result.sessions is None]
    sweep = [result for result in ok if result.sessions is not None]
    rows = [group for group in (flat, sweep) if group]
    if not rows:
        return
    figure, axes = plt.subplots(len(rows), 2, figsize=(13, 4.6 * len(rows)), squeeze=False)
    for row, group in zip(axes, rows):
        hit_axis, ttft_axis = row
        if group is flat:
            _bars(hit_axis, group, targets, colors, "hit_rate_observed")
            _bars(ttft_axis, [r for r in group if r.target != BOUND_TARGET], served, colors,
                  "ttft_p50_s", "ttft_p99_s")
            hit_axis.set_title("Prefix-cache hit rate (bound = one unbounded cache)")
            ttft_axis.set_title("Time to first token (bar p50, tick p99)")
        else:
            _sweep(hit_axis, group, colors, "hit_rate_observed")
            _sweep(ttft_axis, [r for r in group if r.target != BOUND_TARGET], colors,
                   "ttft_p50_s")
            hit_axis.set_title("Agent sessions: hit rate vs sessions")
            ttft_axis.set_title("Agent sessions: TTFT p50 vs sessions")
        hit_axis.set_ylabel("engine-observed hit rate (prompt tokens)")
        hit_axis.set_ylim(0, 1)
        ttft_axis.set_ylabel("seconds (wall)")
        ttft_axis.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
