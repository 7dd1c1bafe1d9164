"""The long-prompt benchmark at a tiny size: it runs, its ids are exact, its premises hold."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvroute.benchmarks import bench_long_prompts
from kvroute.tokenizer_index import RequestTokenizer


def test_tiny_long_prompt_run(tmp_path: Path) -> None:
    out = tmp_path / "long-prompts.json"
    argv = ["--prompt-tokens", "6000", "--new-tokens", "300,1000", "--index-blocks", "20000", "--repeats", "2"]
    # 40K tokens: a body over the proxy's threshold for preparing in a thread.
    argv += ["--huge-tokens", "40000", "--huge-prompts", "1", "--quiet-s", "0.2", "--out", str(out)]
    assert bench_long_prompts.main([*argv, "--stall-index-blocks", "20000"]) == 0
    report = json.loads(out.read_text())
    assert report["stall_index_blocks"] == 20_000
    for turn in report["turns"]:
        assert turn["exact"]
        assert set(turn["stages"]) == set(bench_long_prompts.STAGES)
        # The index holds the previous turn: the match covers every token but the new turn's.
        assert turn["prompt_tokens"] - turn["new_tokens"] - bench_long_prompts.BLOCK_SIZE <= turn["matched_tokens"]
        assert turn["matched_tokens"] < turn["prompt_tokens"] - turn["new_tokens"] + bench_long_prompts.BLOCK_SIZE
        assert 0 < turn["total"]["low"] <= turn["total"]["median"] <= turn["total"]["high"]
    assert [turn["result_tokens"] for turn in report["turns"]] == [300, 1000]
    by_mode = {stall["mode"]: stall for stall in report["stalls"]}
    assert set(by_mode) == set(bench_long_prompts.MODES)
    # sync routes wholly on the loop; thread prepares off it, so less of its time is the loop's.
    assert by_mode["sync"]["huge_loop_ms"] == by_mode["sync"]["huge_route_ms"]
    assert by_mode["thread"]["huge_loop_ms"][0] < by_mode["thread"]["huge_route_ms"][0]
    assert by_mode["thread"]["huge_tokens"] >= 30_000


def test_a_template_that_peels_the_system_message_renders_incrementally(tmp_path: Path) -> None:
    out = tmp_path / "long-prompts.json"
    template = bench_long_prompts.TEMPLATES / "llama31_style.jinja"
    argv = ["--prompt-tokens", "6000", "--new-tokens", "300", "--index-blocks", "20000", "--repeats", "2"]
    argv += ["--chat-template", str(template), "--added-tokens", ",".join(bench_long_prompts.LLAMA3_ADDED_TOKENS)]
    assert bench_long_prompts.main([*argv, "--huge-tokens", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["renders_incrementally"] and report["chat_template"] == str(template)
    assert all(turn["exact"] for turn in report["turns"])


def test_qwen3s_template_renders_agent_and_chat_turns_exactly(tmp_path: Path) -> None:
    """Its last-query loop: agent turns reuse the remembered render, chat turns (a new
    query each) render whole; the ids equal the tokenizers library's either way."""
    template = bench_long_prompts.TEMPLATES / "qwen3_style.jinja"
    argv = ["--prompt-tokens", "6000", "--new-tokens", "300", "--index-blocks", "20000", "--repeats", "2"]
    argv += ["--chat-template", str(template), "--huge-tokens", "0"]
    for turn in bench_long_prompts.TURN_SHAPES:
        out = tmp_path / f"{turn}.json"
        assert bench_long_prompts.main([*argv, "--turn", turn, "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["renders_incrementally"] and report["turn"] == turn
        assert all(row["exact"] for row in report["turns"])


def test_the_precise_stall_engine_is_filled_then_streams_events() -> None:
    """``--precise``: the approximate index is filled first; then the backends stream
    events, so a routed prompt is predicted from the speculative layer."""
    names = ["http://10.0.1.1:8000", "http://10.0.1.2:8000"]
    engine, candidates = bench_long_prompts.filled_engine(
        RequestTokenizer.default_path(), names, 4_000, 0, precise=True
    )
    assert engine.index_stats().blocks == dict.fromkeys(names, 1)  # each one's first event
    body = {"model": bench_long_prompts.MODEL, "messages": [{"role": "user", "content": "words " * 400}]}
    first = engine.route(bench_long_prompts.CHAT.path, body, {}, candidates)
    again = engine.route(bench_long_prompts.CHAT.path, body, {}, candidates)
    assert again.backend == first.backend and again.predicted_cached_tokens >= 400


def test_typographic_turns_take_the_wide_word_path_exactly(tmp_path: Path) -> None:
    """Turns typeset with curly quotes and dashes: the ids still equal the library's."""
    out = tmp_path / "typographic.json"
    argv = ["--prompt-tokens", "6000", "--new-tokens", "600", "--index-blocks", "20000", "--repeats", "2"]
    assert bench_long_prompts.main([*argv, "--text", "typographic", "--huge-tokens", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["text"] == "typographic" and all(
        row["exact"] and row["text"] == "typographic" for row in report["turns"]
    )


def test_typeset_text_marks_about_one_word_in_eight() -> None:
    text = bench_long_prompts.words(np.random.default_rng(0), 4000)
    typeset = bench_long_prompts.typeset(text, np.random.default_rng(1))
    beyond = sum(not character.isascii() for character in typeset)
    assert typeset.startswith(text.split()[0]) and 0.08 < beyond / len(text.split()) < 0.2
