"""The profiling tools' bookkeeping: which stage a sample counts for, and the per-request split."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvroute.benchmarks.profile_render import conversation, profile_renders
from kvroute.benchmarks.profile_request import stage_of, summarize
from kvroute.benchmarks.profile_routing import busy_neighbour, profile_stages
from kvroute.benchmarks.profile_sessions import ROUNDS, format_runs, run_sessions
from kvroute.benchmarks.stage_timers import STAGES, _timed, reset, snapshot
from tests.paths import REPO

SITE = "/usr/lib/python3.11/site-packages"
SERVE = f"run (asyncio/runners.py:118);_handle ({SITE}/aiohttp/web_app.py:569)"
FORWARD = "forward (/src/router/forwarding/proxy.py:225)"


def stack(*frames: str) -> list[str]:
    return [frame for part in frames for frame in part.split(";")]


def test_the_innermost_known_frame_decides() -> None:
    prepare = f"{SERVE};{FORWARD};prepare (/src/router/routing/routing_engine.py:290)"
    # numpy is no stage: the tokenizer that called it is.
    assert (
        stage_of(
            stack(
                prepare,
                "encode_text_array (/src/tokenizer_index/tokenizer.py:439)",
                f"concatenate ({SITE}/numpy/core/multiarray.py:10)",
            )
        )
        == "tokenize"
    )
    assert stage_of(stack(prepare, "block_hashes (/src/tokenizer_index/hashing.py:64)")) == "hash"
    assert (
        stage_of(stack(prepare, "render (/src/tokenizer_index/chat_template.py:198)", "root (<template>:4)"))
        == "render"
    )
    assert stage_of(stack(prepare)) == "policy"  # the routing engine's own lines
    # aiohttp writing the answer the relay built is the HTTP server's work.
    assert stage_of(stack(SERVE, FORWARD, f"write ({SITE}/aiohttp/http_writer.py:116)")) == "http server"
    assert stage_of(stack(SERVE, FORWARD)) == "relay"
    assert stage_of(["<module> (<string>:1)"]) == "other"


def test_stage_shares_split_the_cpu_per_request() -> None:
    stacks = [
        (stack(SERVE, FORWARD, "send (/src/router/forwarding/upstream.py:251)"), 30),
        (stack(SERVE, FORWARD), 10),
        (stack(SERVE), 60),
    ]
    profile = summarize("t", "round_robin", stacks, requests=1000, seconds=2.0, cpu_s=0.5)
    assert profile.cpu_us_per_request == pytest.approx(500.0)
    assert profile.requests_per_s == pytest.approx(500.0)
    by_stage = {row.stage: row for row in profile.stages}
    assert set(by_stage) == {"upstream", "relay", "http server"}
    assert by_stage["upstream"].cpu_us_per_request == pytest.approx(150.0)
    assert sum(row.cpu_us_per_request for row in profile.stages) == pytest.approx(500.0)
    assert profile.hottest[0] == (stack(SERVE)[-1], 60)


def test_stage_timers_count_thread_cpu_per_call() -> None:
    def spin(n: int) -> int:
        return sum(range(n))

    timed = _timed(spin, "test spin")
    reset()
    assert timed(200_000) == spin(200_000)
    timed(200_000)
    measured = snapshot()["test spin"]
    assert measured["calls"] == 2 and measured["us_per_call"] > 0
    reset()
    assert snapshot()["test spin"] == {"calls": 0, "us_per_call": 0.0}


def test_stage_timers_name_functions_that_exist() -> None:
    import importlib

    for module_name, path, _ in STAGES:
        owner = importlib.import_module(module_name)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(owner)


@pytest.mark.parametrize("module", ["kvroute.router.whoami", "router.whoami"])
def test_a_baseline_tree_is_what_python_m_runs(tmp_path, module: str) -> None:
    """``python -m`` from the checkout puts the checkout first, and the editable install maps
    ``kvroute.*`` to it; the baseline env must run the baseline tree's code under both the
    namespace and (checkouts from before it) the bare folder names."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvroute.benchmarks.overhead import baseline_env

    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "__init__.py").write_text("")
    (tmp_path / "router" / "whoami.py").write_text("print(__file__)\n")
    ran = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **baseline_env(tmp_path)},
        check=True,
    )
    assert Path(ran.stdout.strip()).resolve() == (tmp_path / "router" / "whoami.py").resolve()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_neighbour_runs_on_another_cpu_and_is_gone_after() -> None:
    allowed = os.sched_getaffinity(0)
    with busy_neighbour() as pid:
        own = os.sched_getaffinity(0)
        assert len(own) == 1 and os.sched_getaffinity(pid).isdisjoint(own)
        started = time.monotonic()
        while _cpu_ticks(pid) == 0 and time.monotonic() - started < 5:
            time.sleep(0.05)
        assert _cpu_ticks(pid) > 0  # it computes
    assert os.sched_getaffinity(0) == allowed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_call_profiles_count_calls_per_request(tmp_path: Path) -> None:
    import cProfile
    import pstats

    from kvroute.benchmarks.call_profile import format_calls, summarize_calls

    def handle(n: int) -> int:
        return len(str(n))

    profiler = cProfile.Profile()
    profiler.enable()
    for number in range(100):
        handle(number)
    profiler.disable()
    path = tmp_path / "calls.prof"
    profiler.dump_stats(str(path))
    profile = summarize_calls(pstats.Stats(str(path)), requests=100, root=str(Path(__file__).parent) + "/")
    rows = {row.function: row for row in profile.functions}
    handler = next(row for name, row in rows.items() if name.startswith("test_profile_tools.py:") and "handle" in name)
    assert handler.calls_per_request == pytest.approx(1.0)
    assert rows["<built-in method builtins.len>"].calls_per_request == pytest.approx(1.0)
    assert profile.groups["builtins"] >= 1.0 and profile.calls_per_request >= 2.0
    assert "Python-level calls per request" in format_calls(profile, "test")


@pytest.mark.parametrize(("new_words", "bodies"), [(0, "chat"), (3, "chat"), (3, "agent-tools")])
def test_the_routing_profile_times_every_stage(new_words: int, bodies: str) -> None:
    """``profile_routing`` end to end on one body per system prompt, repeated or with new
    words in every stage's bodies, chats or agents' turns with tools."""
    rows = profile_stages(passes=1, per_prompt=1, new_words=new_words, body_kind=bodies)
    assert [row.stage for row in rows] == [
        "parse",
        "render",
        "tokenize",
        "hash",
        "prepare (render+tokenize+hash)",
        "route",
        "observe",
        "parse+prepare+route+observe",
    ]
    assert all(0 < row.min_us <= row.median_us <= row.max_us for row in rows)


def test_the_render_profile_renders_each_shape_both_ways_alike() -> None:
    """``profile_render`` on a few chats: the tokenizer's text equals the whole render (it
    raises otherwise) for plain and agent chats below and above the render memo's threshold."""
    rows = profile_renders(chats=3, repeats=2, lengths=(4, 18))
    assert [(row.shape, row.messages) for row in rows] == [("plain", 4), ("plain", 18), ("agent", 4), ("agent", 18)]
    assert all(row.whole_us > 0 and row.tokenizer_us > 0 for row in rows)
    qwen3 = (REPO / "benchmarks" / "templates" / "qwen3_style.jinja").read_text()
    rows = profile_renders(chats=3, repeats=1, lengths=(4,), chat_template=qwen3)  # (another template's texts)
    assert [(row.shape, row.messages) for row in rows] == [("plain", 4), ("agent", 4)]
    gemma3 = (REPO / "benchmarks" / "templates" / "gemma3_style.jinja").read_text()  # (a content format of parts)
    rows = profile_renders(chats=3, repeats=1, lengths=(4,), chat_template=gemma3, shapes=("plain",))
    assert [(row.shape, row.messages) for row in rows] == [("plain", 4)]
    agent = conversation("agent", 7, 6)
    assert [message["role"] for message in agent] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert agent[3]["tool_call_id"] == agent[2]["tool_calls"][0]["id"] != conversation("agent", 8, 6)[3]["tool_call_id"]


def test_the_sessions_profile_says_when_the_memo_holds_the_conversations() -> None:
    """``profile_sessions`` on a few short conversations: with room every later turn
    continues its conversation's last; with none, none does."""
    held = run_sessions(3, messages=80, memo_mb=8)  # (past the prompt memo's 16K characters)
    assert held.requests == 3 * ROUNDS and held.render_reused == held.ids_reused == held.requests
    assert len(held.us_per_request) == ROUNDS and all(spent > 0 for spent in held.us_per_request)
    none = run_sessions(3, messages=80, memo_mb=0)
    assert none.render_reused == none.ids_reused == 0
    assert format_runs([held, none]).count("\n") == 2
    # A third of them ending each round: their successors' first requests find nothing.
    ending = run_sessions(3, messages=80, memo_mb=8, rounds=4, ending=1 / 3)
    assert ending.requests == 12 and ending.render_reused == ending.ids_reused == 12 - 3
