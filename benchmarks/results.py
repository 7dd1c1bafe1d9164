"""Benchmark results: one :class:`TargetResult` per target x workload, as JSON, table and plot.

``results.json`` is a list of :class:`TargetResult` objects (keys as the field names below).
A *target* is a ``kvroute serve`` policy (``round_robin``, ``cache_aware``, ...), a peer
router (``peer:sglang-router``, ``peer:vllm-router``) or one of three offline caches over the
workload's requests in arrival order (:mod:`kvroute.benchmarks.bounds`): ``bound``, one unbounded
cache, the ceiling no fleet of finite caches beats; ``bound_fleet``, one cache of the fleet's
total capacity evicted optimally (Belady), the ceiling no router on this fleet beats; and
``pooled_lru``, that cache evicted LRU as an engine does. Every served target also carries
``bound_fleet`` and ``pooled_lru`` over the order *it* sent the requests (think time and
answers make that order differ from run to run) and ``of_bound_fleet``, its observed hit rate
over that bound.

Hit rates are fractions of prompt tokens: ``observed`` from the engines' own prefix-cache
counters (what really happened), ``predicted`` from the router's own counters (what kvroute
thought would happen; null for peers, load-only policies and the bound).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

BOUND_TARGET = "bound"
BOUND_FLEET_TARGET = "bound_fleet"
POOLED_LRU_TARGET = "pooled_lru"
#: The fixed placement of sessions with the highest hit rate (``--placement-search``).
BEST_PLACEMENT_TARGET = "best_placement"
#: Rows computed offline, not served by a router.
OFFLINE_TARGETS = (BOUND_TARGET, BOUND_FLEET_TARGET, POOLED_LRU_TARGET)
PEER_PREFIX = "peer:"


#: A target whose busiest backend took at least this share of the prompt tokens ran on one.
ONE_BACKEND_SHARE = 0.99


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
    # Offline caches over the order this target sent the requests (see the module doc).
    bound_fleet: float | None = None
    pooled_lru: float | None = None
    of_bound_fleet: float | None = None  # hit_rate_observed / bound_fleet
    fleet_capacity_blocks: int | None = None
    setting: str = ""  # a settings-sweep point, e.g. "time-scale=10 prefill=20000"
    repeat: int = 0  # which run of this target x workload (``--repeat``), from 0
    placement: str | None = None  # best_placement: which fixed placement it was
    seed: int | None = None  # the workload's seed, when ``--seeds`` ran several

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TargetResult:
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        values["backend_share"] = {url: BackendShare(**share) for url, share in data.get("backend_share", {}).items()}
        return cls(**values)


def machine() -> str:
    """The line a benchmark prints under its figures: cores and load average (1, 5, 15 min)."""
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"machine: {os.cpu_count()} cpus, load average {load}"


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


def _bound_of(results: Sequence[TargetResult], result: TargetResult) -> float | None:
    """The unbounded cache's hit rate on ``result``'s workload and setting."""
    for other in results:
        if (other.workload, other.setting, other.target) == (result.workload, result.setting, BOUND_TARGET):
            return other.hit_rate_observed
    return None


def _balance(share: dict[str, BackendShare]) -> str:
    """Prompt-token shares in percent, backend by backend: "25/24/26/25"."""
    return "/".join(f"{round(s.prompt_tokens * 100)}" for s in share.values()) or "-"


def _row(results: Sequence[TargetResult], result: TargetResult, width: int) -> tuple[str, ...]:
    """One table row (without the setting column)."""
    if result.status != "ok":
        return (result.workload, result.target, "-", "-", result.status, *("",) * (width - 5))
    bound = _bound_of(results, result)
    of_bound = (
        ratio(result.hit_rate_observed, bound)
        if result.hit_rate_observed is not None and bound and result.target != BOUND_TARGET
        else None
    )
    return (
        result.workload,
        result.target,
        str(result.requests),
        str(result.errors),
        _fmt(result.hit_rate_observed, ".3f"),
        _fmt(result.hit_rate_predicted, ".3f"),
        _fmt(of_bound, ".0%"),
        _fmt(result.bound_fleet, ".3f"),
        _fmt(result.of_bound_fleet, ".0%"),
        _fmt(result.ttft_p50_s, ".3f"),
        _fmt(result.ttft_p90_s, ".3f"),
        _fmt(result.ttft_p99_s, ".3f"),
        _fmt(result.latency_p50_s, ".3f"),
        _fmt(result.throughput_rps, ".1f"),
        _balance(result.backend_share),
    )


def format_table(results: Sequence[TargetResult]) -> str:
    """A plain-text table, one row per target x workload, grouped by (setting,) workload.

    ``of bound`` is over the unbounded cache (arrival order); ``bnd fleet`` is the pooled
    Belady bound over the order this row's target sent the requests, and ``of bound_fleet``
    the row's hit rate over it. A ``setting`` column leads when a settings sweep ran.
    """
    header: tuple[str, ...] = (
        "workload",
        "target",
        "reqs",
        "err",
        "hit obs",
        "hit pred",
        "of bound",
        "bnd fleet",
        "of bound_fleet",
        "TTFT p50",
        "p90",
        "p99",
        "e2e p50",
        "req/s",
        "tokens % per backend",
    )
    swept = any(result.setting for result in results)
    rows = [_row(results, result, len(header)) for result in results]
    if swept:
        header = ("setting", *header)
        rows = [(result.setting, *row) for result, row in zip(results, rows)]
    lines = _aligned(header, rows, group_columns=2 if swept else 1)
    notes = [
        f"  {r.workload} / {r.target}: {r.errors} errors, e.g. {r.error_sample}" for r in results if r.error_sample
    ]
    if notes:
        lines += ["", "errors:", *notes]
    alone = one_backend_notes(results)
    if alone:
        lines += ["", "one backend (its latency and req/s are one engine's while the others idled):", *alone]
    return "\n".join(lines)


def one_backend_notes(results: Sequence[TargetResult]) -> list[str]:
    """The targets that sent (nearly) every prompt token to one backend of several. Their
    TTFT and throughput are not comparable with the others': a fleet of one engine, and
    where the engines share a machine's cores, one that had them to itself."""
    notes = []
    for result in results:
        shares = result.backend_share
        if result.status != "ok" or len(shares) < 2:
            continue
        url, busiest = max(shares.items(), key=lambda item: item[1].prompt_tokens)
        if busiest.prompt_tokens >= ONE_BACKEND_SHARE:
            notes.append(
                f"  {result.workload} / {result.target}: {busiest.prompt_tokens:.0%} of prompt tokens to {url},"
                f" one of {len(shares)} backends"
            )
    return notes


def _spread(values: Sequence[float | None], spec: str) -> str:
    """Median and [min-max] of the values that exist: "0.781 [0.770-0.790]"."""
    present = sorted(value for value in values if value is not None)
    if not present:
        return "-"
    median = float(np.median(present))
    if len(present) == 1:
        return format(median, spec)
    return f"{median:{spec}} [{present[0]:{spec}}-{present[-1]:{spec}}]"


#: Columns of the repeats table: (header, attribute, format).
_REPEAT_COLUMNS = (
    ("hit obs", "hit_rate_observed", ".3f"),
    ("bnd fleet", "bound_fleet", ".3f"),
    ("of bound_fleet", "of_bound_fleet", ".0%"),
    ("TTFT p50", "ttft_p50_s", ".3f"),
    ("TTFT p99", "ttft_p99_s", ".3f"),
    ("req/s", "throughput_rps", ".1f"),
)


def format_repeats(results: Sequence[TargetResult]) -> str:
    """Per (setting,) workload and target: median [min-max] over the repeated runs."""
    groups: dict[tuple[str, str, str], list[TargetResult]] = {}
    for result in results:
        if result.status == "ok":
            groups.setdefault((result.setting, result.workload, result.target), []).append(result)
    swept = any(setting for setting, _, _ in groups)
    header = (*(("setting",) if swept else ()), "workload", "target", "runs", *(name for name, _, _ in _REPEAT_COLUMNS))
    rows = []
    for (setting, workload, target), runs in groups.items():
        cells = [_spread([getattr(run, attribute) for run in runs], spec) for _, attribute, spec in _REPEAT_COLUMNS]
        rows.append((*((setting,) if swept else ()), workload, target, str(len(runs)), *cells))
    return "\n".join(["median [min-max] over the runs", *_aligned(header, rows, group_columns=2 if swept else 1)])


def format_by_seed(results: Sequence[TargetResult]) -> str:
    """Per (setting,) workload and target: the observed hit rate at each seed (the median of
    its repeats), so targets compare seed by seed, not only in their spread over seeds."""
    seeds = sorted({result.seed for result in results if result.seed is not None})
    groups: dict[tuple[str, str, str], dict[int, list[float]]] = {}
    for result in results:
        if result.status == "ok" and result.seed is not None and result.hit_rate_observed is not None:
            runs = groups.setdefault((result.setting, result.workload, result.target), {})
            runs.setdefault(result.seed, []).append(result.hit_rate_observed)
    swept = any(setting for setting, _, _ in groups)
    header = (*(("setting",) if swept else ()), "workload", "target", *(f"seed {seed}" for seed in seeds))
    rows = []
    for (setting, workload, target), runs in groups.items():
        cells = [format(float(np.median(runs[seed])), ".3f") if seed in runs else "-" for seed in seeds]
        rows.append((*((setting,) if swept else ()), workload, target, *cells))
    return "\n".join(["hit obs by seed", *_aligned(header, rows, group_columns=2 if swept else 1)])


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]], group_columns: int) -> list[str]:
    """Left-aligned columns under a rule, with a blank line wherever the first
    ``group_columns`` cells change (one group per workload, or per setting and workload)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(header, widths)).rstrip(),
        "  ".join("-" * width for width in widths),
    ]
    previous = None
    for row in rows:
        if previous is not None and tuple(row[:group_columns]) != previous:
            lines.append("")
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        previous = tuple(row[:group_columns])
    return lines


#: What a plot shows of repeated runs: the median of each of these.
_PLOTTED = ("hit_rate_observed", "of_bound_fleet", "ttft_p50_s", "ttft_p99_s")


def _medians(results: Sequence[TargetResult]) -> list[TargetResult]:
    """One result per (setting, workload, target): the repeats' medians of what is plotted."""
    groups: dict[tuple[str, str, str], list[TargetResult]] = {}
    for result in results:
        groups.setdefault((result.setting, result.workload, result.target), []).append(result)
    merged = []
    for runs in groups.values():
        values = {}
        for name in _PLOTTED:
            present = [getattr(run, name) for run in runs if getattr(run, name) is not None]
            values[name] = float(np.median(present)) if present else None
        merged.append(replace(runs[0], **values))
    return merged


def _label(result: TargetResult) -> str:
    """A workload's label in the plot: its name, and its sweep setting when there is one."""
    return f"{result.workload}\n{result.setting}" if result.setting else result.workload


def _bars(
    axis,
    results: Sequence[TargetResult],
    targets: list[str],
    colors: dict[str, str],
    attribute: str,
    tick_attribute: str | None = None,
    of_fleet: bool = False,
) -> None:
    """Grouped bars: one group per workload, one bar per target (and a tick for p99).

    ``of_fleet`` writes each bar's ``of_bound_fleet`` above it.
    """
    workloads = list(dict.fromkeys(_label(result) for result in results))
    found = {(r.target, _label(r)): r for r in results}

    def value(target: str, workload: str, name: str) -> float:
        result = found.get((target, workload))
        number = getattr(result, name) if result is not None else None
        return float(number) if number is not None else math.nan

    width = 0.8 / max(1, len(targets))
    positions = np.arange(len(workloads))
    for number, target in enumerate(targets):
        where = positions + number * width
        heights = [value(target, w, attribute) for w in workloads]
        axis.bar(where, heights, width, label=target, color=colors[target])
        if tick_attribute:
            axis.scatter(
                where, [value(target, w, tick_attribute) for w in workloads], marker="_", s=250, color=colors[target]
            )
        if of_fleet:
            for x, height, w in zip(where, heights, workloads):
                share = value(target, w, "of_bound_fleet")
                if not math.isnan(share) and not math.isnan(height):
                    axis.text(x, height + 0.01, f"{share:.0%}", ha="center", va="bottom", rotation=90, fontsize=6)
    axis.set_xticks(
        positions + width * (len(targets) - 1) / 2, [name.replace("+", "\n+", 1) for name in workloads], fontsize=7
    )
    axis.legend(fontsize=8)


def _sweep(
    axis, results: Sequence[TargetResult], colors: dict[str, str], attribute: str, of_fleet: bool = False
) -> None:
    """One line per target over the agent-sessions sweep (points labelled with their
    ``of_bound_fleet`` when ``of_fleet``)."""
    axis.set_xscale("log", base=2)
    counts: set[int] = set()
    for target in dict.fromkeys(result.target for result in results):
        points = sorted(
            (r.sessions, getattr(r, attribute), r.of_bound_fleet)
            for r in results
            if r.target == target and getattr(r, attribute) is not None
        )
        if points:
            xs, ys, shares = zip(*points)
            counts.update(xs)
            axis.plot(
                xs, ys, "--" if target in OFFLINE_TARGETS else "-", marker="o", label=target, color=colors[target]
            )
            for x, y, share in zip(xs, ys, shares):
                if of_fleet and share is not None:
                    axis.annotate(
                        f"{share:.0%}",
                        (x, y),
                        textcoords="offset points",
                        xytext=(4, 2),
                        fontsize=6,
                        color=colors[target],
                    )
    axis.set_xticks(sorted(counts), [str(count) for count in sorted(counts)])
    axis.set_xticks([], minor=True)
    axis.set_xlabel("agent sessions taking turns in lockstep")
    axis.legend(fontsize=8)


def plot_summary(results: Sequence[TargetResult], path: Path) -> None:
    """summary.png: hit rate and TTFT per target per workload; the agent-sessions sweep.

    Up to four panels: hit rate and TTFT as grouped bars for the other workloads (timing
    variants and settings-sweep points included), and hit rate and TTFT against the number
    of sessions for the plain agent-sessions sweep. Hit-rate bars and points are labelled
    with their share of ``bound_fleet``. Repeated runs are shown by their medians.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = _medians([result for result in results if result.status == "ok"])
    targets = list(dict.fromkeys(result.target for result in ok))
    colors = {target: f"C{number % 10}" for number, target in enumerate(targets)}
    served = [target for target in targets if target not in OFFLINE_TARGETS]

    def in_sweep(result: TargetResult) -> bool:
        plain = "+" not in result.workload and not result.setting
        return result.sessions is not None and plain

    flat = [result for result in ok if not in_sweep(result)]
    sweep = [result for result in ok if in_sweep(result)]
    rows = [group for group in (flat, sweep) if group]
    if not rows:
        return
    figure, axes = plt.subplots(len(rows), 2, figsize=(13 if len(flat) < 40 else 20, 4.8 * len(rows)), squeeze=False)
    for row, group in zip(axes, rows):
        hit_axis, ttft_axis = row
        live = [r for r in group if r.target not in OFFLINE_TARGETS]
        if group is flat:
            _bars(hit_axis, group, targets, colors, "hit_rate_observed", of_fleet=True)
            _bars(ttft_axis, live, served, colors, "ttft_p50_s", "ttft_p99_s")
            hit_axis.set_title("Prefix-cache hit rate (label: share of bound_fleet)")
            ttft_axis.set_title("Time to first token (bar p50, tick p99)")
        else:
            _sweep(hit_axis, group, colors, "hit_rate_observed", of_fleet=True)
            _sweep(ttft_axis, live, colors, "ttft_p50_s")
            hit_axis.set_title("Agent sessions: hit rate vs sessions (label: of bound_fleet)")
            ttft_axis.set_title("Agent sessions: TTFT p50 vs sessions")
        hit_axis.set_ylabel("engine-observed hit rate (prompt tokens)")
        hit_axis.set_ylim(0, 1.1)
        ttft_axis.set_ylabel("seconds (wall)")
        ttft_axis.set_yscale("log")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
