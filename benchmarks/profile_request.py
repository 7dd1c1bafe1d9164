"""Where a router's CPU goes per request: py-spy samples of a loaded ``kvroute serve``, by stage.

    python3 -m kvroute.benchmarks.profile_request --policy cache_aware --seconds 20 --label before

Starts the trivial upstreams of :mod:`kvroute.benchmarks.overhead` and a ``kvroute serve --policy
POLICY`` in front of them, loads it from closed-loop clients with the overhead benchmark's
~2 KB chat bodies (64 system prompts), and samples the router with ``py-spy record`` while
the router's CPU time is read from ``/proc``. Each sample is charged to one stage: the
innermost frame of the stack that lies in a module of a known stage decides (so native
code — orjson, the Rust tokenizer, numba kernels — counts for the Python function that
called it). Stage share x CPU per request = microseconds of CPU per request per stage.

py-spy samples wall time while the router's thread is not idle, so on a crowded machine a
thread preempted inside a system call (a loopback ``send`` wakes the process it sends to)
is charged to that call: the ``upstream`` and ``http server`` shares include such waits.
Compare profiles taken side by side, not across machine loads.

By default every body is sent once before sampling, so the profile is the steady state of
a set of 1,024 repeated requests (as ``kvroute bench --overhead`` measures); ``--cold
--per-prompt 256`` profiles requests whose user turns are all new text instead.

Writes ``benchmarks/results/profile-LABEL.txt`` (the stage table and the 30 hottest
functions by own time) and ``.json``, and keeps py-spy's raw collapsed stacks next to them
(``.stacks``; ``flamegraph.pl`` or speedscope draws them).

``--timers`` times the routing stages inside the router instead (thread CPU per call);
``--calls`` counts Python-level calls per request under cProfile
(:mod:`kvroute.benchmarks.call_profile`: the list of what one request calls, and how often)
and keeps the profile (``profile-LABEL-calls.prof``, for ``pstats``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pstats
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroute.benchmarks import fleet as fleets
from kvroute.benchmarks.call_profile import format_calls, summarize_calls
from kvroute.benchmarks.fleet import ManagedProcess, free_port
from kvroute.benchmarks.overhead import LoadRun, chat_bodies, closed_loop, start_upstream

RESULTS = Path(__file__).parent / "results"
#: The checkout (dropped from the function names of a call profile).
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Stage -> path fragments of the modules whose frames belong to it. Checked from the
#: innermost frame outwards; the first frame that matches any stage decides.
STAGES: dict[str, tuple[str, ...]] = {
    "render": ("tokenizer_index/chat_template.py", "tokenizer_index/chat_messages.py", "/jinja2/", "<template>"),
    "tokenize": (
        "tokenizer_index/tokenizer.py",
        "tokenizer_index/piece_cache.py",
        "/tokenizers/",
        "tokenizer_index/hf_files.py",
    ),
    "hash": ("tokenizer_index/hashing.py",),
    "index": (
        "tokenizer_index/prefix_index.py",
        "tokenizer_index/bucket_table.py",
        "tokenizer_index/kernels.py",
        "router/routing/precise_index.py",
        "router/routing/cache_model.py",
    ),
    "policy": (
        "router/routing/policies/",
        "router/routing/routing_engine.py",
        "router/routing/decisions.py",
        "router/forwarding/admission.py",
        "router/fleet/backends.py",
        "router/fleet/breaker.py",
        "router/fleet/backend_access.py",
    ),
    "parse": ("router/routing/request_info.py",),
    "metrics": ("router/forwarding/metrics.py", "/prometheus_client/"),
    "upstream": ("router/forwarding/upstream.py",),
    "relay": ("router/forwarding/proxy.py", "router/engines/usage.py", "router/errors.py"),
    "http server": (
        "/aiohttp/",
        "/multidict/",
        "/yarl/",
        "/asyncio/",
        "uvloop",
        "router/http/app.py",
        "router/http/security.py",
    ),
}


def frame_path(frame: str) -> str:
    """``'func (path:line)'`` -> ``'path'``."""
    start = frame.rfind(" (")
    return frame[start + 2 : frame.rfind(":")] if start >= 0 else frame


def stage_of(stack: Sequence[str]) -> str:
    """The stage a sample counts for (``stack`` outermost first, as py-spy writes it)."""
    for frame in reversed(stack):
        path = frame_path(frame)
        for stage, fragments in STAGES.items():
            if any(fragment in path for fragment in fragments):
                return stage
    return "other"


@dataclass(slots=True)
class StageRow:
    stage: str
    samples: int
    share: float
    cpu_us_per_request: float


@dataclass(slots=True)
class Profile:
    label: str
    policy: str
    requests: int
    requests_per_s: float
    cpu_us_per_request: float
    samples: int
    stages: list[StageRow]
    hottest: list[tuple[str, int]]  # function (own time), samples


def read_stacks(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output: ``frame;frame;... count`` per line."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def summarize(
    label: str, policy: str, stacks: list[tuple[list[str], int]], requests: int, seconds: float, cpu_s: float
) -> Profile:
    by_stage: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, count in stacks:
        by_stage[stage_of(stack)] += count
        own[stack[-1]] += count
    total = sum(by_stage.values()) or 1
    per_request_us = cpu_s / max(1, requests) * 1e6
    rows = [
        StageRow(stage, samples, samples / total, samples / total * per_request_us)
        for stage, samples in by_stage.most_common()
    ]
    return Profile(label, policy, requests, requests / seconds, per_request_us, total, rows, own.most_common(30))


def format_profile(profile: Profile, command: str) -> str:
    lines = [
        f"# {command}",
        (
            f"policy {profile.policy}: {profile.requests} requests, {profile.requests_per_s:.0f} req/s, "
            f"router CPU {profile.cpu_us_per_request:.0f} us/request, {profile.samples} samples"
        ),
        "",
        f"{'stage':<12} {'samples':>8} {'share':>7} {'us/request':>11}",
    ]
    lines += [
        f"{row.stage:<12} {row.samples:>8} {row.share:>7.1%} {row.cpu_us_per_request:>11.0f}" for row in profile.stages
    ]
    lines += ["", "hottest functions (own time):"]
    lines += [f"{count:>7}  {frame}" for frame, count in profile.hottest]
    return "\n".join(lines) + "\n"


async def profile_router(
    policy: str,
    seconds: float,
    concurrency: int,
    rate: int,
    stacks_path: Path,
    extra_args: Sequence[str],
    *,
    per_prompt: int = 16,
    warm: bool = True,
) -> tuple[int, float, float]:
    """Load a fresh router while py-spy samples it; (requests, seconds, router CPU seconds)."""
    upstreams = [start_upstream() for _ in range(2)]
    router = None
    try:
        await asyncio.gather(*(upstream.wait_ready() for upstream in upstreams))
        router = await fleets.start_router(policy, [upstream.url for upstream in upstreams], extra_args=extra_args)
        bodies = chat_bodies(per_prompt=per_prompt)
        if warm:  # every body once: the profile is then the steady state of a repeated set
            await closed_loop(router.url, bodies, concurrency, 0.0, None, requests=len(bodies))
        else:  # only the connections and the compiled kernels: every user turn is new text
            await closed_loop(router.url, bodies[-concurrency:], concurrency, 0.0, None, requests=concurrency)
        spy = await asyncio.create_subprocess_exec(
            shutil.which("py-spy") or "py-spy",
            "record",
            "--pid",
            str(router.pid),
            "--rate",
            str(rate),
            "--duration",
            str(int(seconds) + 1),
            "--format",
            "raw",
            "--nonblocking",
            "--full-filenames",
            "--output",
            str(stacks_path),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        await asyncio.sleep(0.5)  # py-spy attached
        run = await closed_loop(router.url, bodies, concurrency, seconds, router.pid)
        _, error = await spy.communicate()
        if spy.returncode != 0 and not stacks_path.exists():
            raise RuntimeError(f"py-spy failed: {error.decode(errors='replace')}")
        assert run.cpu_s is not None
        return run.requests, run.seconds, run.cpu_s
    finally:
        if router is not None:
            router.stop()
        for upstream in upstreams:
            upstream.stop()


async def _start_timed_router(
    policy: str,
    backends: Sequence[str],
    out: Path,
    extra_args: Sequence[str],
    wrapper: str = "kvroute.benchmarks.stage_timers",
) -> ManagedProcess:
    """``kvroute serve`` under ``wrapper`` (:mod:`kvroute.benchmarks.stage_timers` or
    :mod:`kvroute.benchmarks.call_profile`: SIGUSR1 starts, SIGUSR2 writes ``out``), all
    backends healthy."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        wrapper,
        str(out),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warning",
        *(arg for url in backends for arg in ("--backend", url)),
        *extra_args,
    ]
    router = ManagedProcess(f"timed-{policy}", argv, f"http://127.0.0.1:{port}")
    try:
        await router.wait_ready("/health")
        await fleets._wait_all_healthy(router, len(backends))
    except BaseException:
        router.stop()
        raise
    return router


@dataclass(slots=True)
class TimedStage:
    stage: str
    calls_per_request: float
    us_per_call: float
    us_per_request: float


async def _measured_load(router: ManagedProcess, concurrency: int, seconds: float, per_prompt: int) -> LoadRun:
    """Every body once (warm-up), then SIGUSR1 (start measuring), ``seconds`` of closed-loop
    load, SIGUSR2 (stop and write): what the stage timers and the call profile both take."""
    bodies = chat_bodies(per_prompt=per_prompt)
    await closed_loop(router.url, bodies, concurrency, 0.0, None, requests=len(bodies))
    router.process.send_signal(signal.SIGUSR1)
    await asyncio.sleep(0.2)
    run = await closed_loop(router.url, bodies, concurrency, seconds, router.pid)
    router.process.send_signal(signal.SIGUSR2)
    return run


async def time_stages(
    policy: str, seconds: float, concurrency: int, out: Path, extra_args: Sequence[str], *, per_prompt: int = 16
) -> tuple[int, float, list[TimedStage]]:
    """Thread CPU per routing stage inside a loaded router; (requests, CPU us/request, stages)."""
    upstreams = [start_upstream() for _ in range(2)]
    router = None
    try:
        await asyncio.gather(*(upstream.wait_ready() for upstream in upstreams))
        router = await _start_timed_router(policy, [upstream.url for upstream in upstreams], out, extra_args)
        run = await _measured_load(router, concurrency, seconds, per_prompt)
        await asyncio.sleep(0.5)
        timers = json.loads(out.read_text())
    finally:
        if router is not None:
            router.stop()
        for upstream in upstreams:
            upstream.stop()
    requests = run.requests
    stages = [
        TimedStage(
            stage, value["calls"] / requests, value["us_per_call"], value["us_per_call"] * value["calls"] / requests
        )
        for stage, value in timers.items()
        if value["calls"]
    ]
    assert run.cpu_s is not None
    return requests, run.cpu_s / requests * 1e6, stages


async def count_calls(
    policy: str, seconds: float, concurrency: int, out: Path, extra_args: Sequence[str], *, per_prompt: int = 16
) -> tuple[int, pstats.Stats]:
    """A loaded router under cProfile (:mod:`kvroute.benchmarks.call_profile`); (requests, profile)."""
    upstreams = [start_upstream() for _ in range(2)]
    router = None
    out.unlink(missing_ok=True)
    try:
        await asyncio.gather(*(upstream.wait_ready() for upstream in upstreams))
        backends = [upstream.url for upstream in upstreams]
        router = await _start_timed_router(policy, backends, out, extra_args, "kvroute.benchmarks.call_profile")
        run = await _measured_load(router, concurrency, seconds, per_prompt)
        for _ in range(100):  # the dump takes a moment
            await asyncio.sleep(0.1)
            if out.exists():
                await asyncio.sleep(0.5)
                break
        stats = pstats.Stats(str(out))
    finally:
        if router is not None:
            router.stop()
        for upstream in upstreams:
            upstream.stop()
    # closed_loop's first request on each connection (it opens them) is profiled too.
    return run.requests + concurrency, stats


def format_timed(policy: str, requests: int, cpu_us: float, stages: Sequence[TimedStage], command: str) -> str:
    lines = [
        f"# {command}",
        (
            f"policy {policy}: {requests} requests, router CPU {cpu_us:.0f} us/request "
            "(thread CPU per stage; stages nest)"
        ),
        "",
        f"{'stage':<38} {'calls/req':>9} {'us/call':>8} {'us/request':>11}",
    ]
    lines += [
        f"{row.stage:<38} {row.calls_per_request:>9.2f} {row.us_per_call:>8.1f} {row.us_per_request:>11.1f}"
        for row in stages
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m kvroute.benchmarks.profile_request", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument(
        "--per-prompt", type=int, default=16, help="distinct user turns per system prompt (64 system prompts)"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="do not send every body once first: user turns are new text "
        "(use with a --per-prompt large enough for the run)",
    )
    parser.add_argument(
        "--timers",
        action="store_true",
        help="instead of py-spy: thread CPU per routing stage, timed inside the "
        "router (kvroute.benchmarks.stage_timers); writes profile-LABEL-timers.txt/.json",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="instead of py-spy: Python-level calls per request under cProfile "
        "(kvroute.benchmarks.call_profile); writes profile-LABEL-calls.txt/.json/.prof",
    )
    parser.add_argument("--label", default="current")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("router_args", nargs="*", help="extra kvroute serve flags (after --)")
    args = parser.parse_args(argv)
    if args.timers:
        return _main_timers(args, argv)
    if args.calls:
        return _main_calls(args, argv)
    if shutil.which("py-spy") is None:
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"profile-{args.label}"
    stacks_path = base.with_suffix(".stacks")

    async def run() -> int:
        requests, seconds, cpu_s = await profile_router(
            args.policy,
            args.seconds,
            args.concurrency,
            args.rate,
            stacks_path,
            args.router_args,
            per_prompt=args.per_prompt,
            warm=not args.cold,
        )
        profile = summarize(args.label, args.policy, read_stacks(stacks_path), requests, seconds, cpu_s)
        _write_report(base, format_profile(profile, _command(argv)), asdict(profile), also=", .stacks")
        return 0

    return fleets.run_stoppable(run())


def _command(argv: list[str] | None) -> str:
    """The command line that made a report, as its header quotes it."""
    return "python3 -m kvroute.benchmarks.profile_request " + " ".join(argv or sys.argv[1:])


def _write_report(base: Path, text: str, report: Any, *, also: str = "") -> None:
    """Print ``text`` and write it and ``report`` (JSON) beside ``base``."""
    print(text, end="")
    base.with_suffix(".txt").write_text(text)
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {base}.txt, .json{also}")


def _main_calls(args: argparse.Namespace, argv: list[str] | None) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"profile-{args.label}-calls"

    async def run() -> int:
        requests, stats = await count_calls(
            args.policy,
            args.seconds,
            args.concurrency,
            base.with_suffix(".prof"),
            args.router_args,
            per_prompt=args.per_prompt,
        )
        profile = summarize_calls(stats, requests, root=str(REPO_ROOT) + "/")
        _write_report(base, format_calls(profile, _command(argv)), asdict(profile), also=", .prof")
        return 0

    return fleets.run_stoppable(run())


def _main_timers(args: argparse.Namespace, argv: list[str] | None) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"profile-{args.label}-timers"
    raw = args.out_dir / f"profile-{args.label}-timers.raw"

    async def run() -> int:
        requests, cpu_us, stages = await time_stages(
            args.policy, args.seconds, args.concurrency, raw, args.router_args, per_prompt=args.per_prompt
        )
        raw.unlink(missing_ok=True)
        report = {
            "policy": args.policy,
            "requests": requests,
            "cpu_us_per_request": cpu_us,
            "stages": [asdict(stage) for stage in stages],
        }
        _write_report(base, format_timed(args.policy, requests, cpu_us, stages, _command(argv)), report)
        return 0

    return fleets.run_stoppable(run())


if __name__ == "__main__":
    sys.exit(main())
