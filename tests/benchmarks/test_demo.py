"""``kvroute demo`` end to end, and its clean-up on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.paths import REPO


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvroute.router.cli", "demo", *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # As a terminal starts it: a runner launched in the background (nohup, &) passes
        # SIGINT on ignored, and Python then never turns Ctrl-C into KeyboardInterrupt.
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(b")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return True
    return state == b"Z"


def test_demo_prints_both_policies_side_by_side() -> None:
    demo = _demo("--users", "3", "--turns", "2", "--system-tokens", "1500", "--time-scale", "20")
    output, _ = demo.communicate(timeout=120)
    assert demo.returncode == 0, output
    hit_rates = re.search(r"engine-observed hit rate\s+(\d+)%\s+(\d+)%", output)
    assert hit_rates, output
    assert re.search(r"\s+round_robin\s+cache_aware", output)
    assert re.search(r"TTFT p50 \(GPU time\)\s+\d+ ms\s+\d+ ms", output)
    assert "/metrics" in output


def test_demo_stops_everything_it_started_on_ctrl_c() -> None:
    demo = _demo("--time-scale", "2")
    assert demo.stdout is not None
    deadline = time.monotonic() + 90
    children: list[int] = []
    for line in demo.stdout:
        if "router at" in line:
            children = _children(demo.pid)
            break
        assert time.monotonic() < deadline
    assert len(children) >= 3  # two sim engines and a router
    demo.send_signal(signal.SIGINT)
    rest, _ = demo.communicate(timeout=60)
    assert demo.returncode == 130, rest
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in children)
