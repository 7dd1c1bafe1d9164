"""Remembered prompts: a next turn that reuses its previous turn's ids equals the whole text's.

The memo's threshold is patched to 0 so that short hypothesis conversations are remembered;
each test tokenizes turn after turn (and branches) and compares every result with the plain
``tokenizers`` library on the rendered text.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index import RequestTokenizer
from kvroute.tokenizer_index import tokenizer as tokenizer_module
from kvroute.tokenizer_index.prompt_memo import (
    MAX_RUNS,
    PER_KEY,
    STORED_DTYPE,
    PromptMemo,
    RememberedPrompt,
    conversation_keys,
)
from tests.tokenizer_index.tokenizers_fixtures import llama3_style_dir, train_tokenizer

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TEMPLATES = {
    # Every turn's text starts with the previous turn's, generation prompt included.
    "prefix_stable": CHATML + GENERATION,
    # The first line changes every turn: nothing can be reused.
    "counted": "{{ messages | length }}\n" + CHATML + GENERATION,
    # The last message renders differently from the same message earlier.
    "marks_last": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (latest){% endif %}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}" + GENERATION
    ),
    # Messages joined as they are: a turn may end inside an added token the next one completes.
    "raw": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    # The generation prompt is not how the answer it asks for is rendered next turn.
    "thinking_prompt": CHATML + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
}

# Added tokens whole and in parts: a message may end inside one that the next completes.
FRAGMENTS = [
    "the router",
    " cache",
    "中文",
    "e\u0301",
    "😀",
    "\n",
    "  ",
    "<|im_end|>",
    "<|im_start|>",
    "<|im_",
    "end|>",
]
contents = st.lists(
    st.sampled_from(FRAGMENTS) | st.text(max_size=6),
    min_size=1,
    max_size=12,
).map("".join)
turns = st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), contents), min_size=1, max_size=8)


@pytest.fixture(scope="module", params=[*sorted(TEMPLATES), "prefix_stable, SentencePiece 'first'"])
def templated(request: pytest.FixtureRequest) -> RequestTokenizer:
    if request.param not in TEMPLATES:
        return request.getfixturevalue("first_scheme")  # type: ignore[no-any-return]
    backend = RequestTokenizer.default().backend
    return RequestTokenizer(backend, chat_templates={"default": TEMPLATES[request.param]}, memo_bytes=1 << 20)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> RequestTokenizer:
    return RequestTokenizer.from_pretrained(llama3_style_dir(tmp_path_factory.mktemp("llama3")))


def _expected(tok: RequestTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return tok.backend.encode(tok.render_chat(messages), add_special_tokens=False).ids  # type: ignore[no-any-return]


def _conversation(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in pairs]


@pytest.fixture(scope="module")
def first_scheme() -> RequestTokenizer:
    """SentencePiece style with a prefix space at the text's start only: pieces are
    tokenized after a context token, the text's first alone."""
    backend = train_tokenizer("metaspace_first", ["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok = RequestTokenizer(backend, chat_templates={"default": TEMPLATES["prefix_stable"]}, memo_bytes=1 << 20)
    assert tok.incremental and tok._context is not None
    return tok


@SETTINGS
@given(history=turns, branches=st.lists(turns, min_size=1, max_size=3))
def test_each_turn_and_branch_equals_the_whole_text(
    templated: RequestTokenizer, history: list[tuple[str, str]], branches: list[list[tuple[str, str]]]
) -> None:
    templated.clear_cache()
    with mock.patch.object(tokenizer_module, "MEMO_MIN_CHARS", 0):
        messages = _conversation(history)
        for end in range(1, len(messages) + 1):
            turn = messages[:end]
            assert templated.encode_chat_array(turn).tolist() == _expected(templated, turn)
        for branch in branches:  # siblings of the last turn, each from the same remembered prefix
            turn = messages + _conversation(branch)
            array = templated.encode_chat_array(turn)
            assert array.tolist() == _expected(templated, turn)
            assert array.flags.writeable and array.flags.owndata
            array[:] = -1  # the caller's to change: the memo keeps its own runs


def test_a_first_scheme_conversation_reuses_its_previous_turn(first_scheme: RequestTokenizer) -> None:
    first_scheme.clear_cache()
    reused = first_scheme.memo_stats().reused
    messages: list[dict[str, Any]] = []
    with mock.patch.object(tokenizer_module, "MEMO_MIN_CHARS", 0):
        for turn in range(6):
            messages.append({"role": "user", "content": f"question {turn}: " + "the router " * 20})
            assert first_scheme.encode_chat_array(messages).tolist() == _expected(first_scheme, messages)
            messages.append({"role": "assistant", "content": f" answer {turn}"})
    assert first_scheme.memo_stats().reused - reused == 5
    assert list(first_scheme._leads) == ["<|im_start|>"]  # every turn's first unit, kept once


def test_a_growing_conversation_reuses_its_previous_turn(llama: RequestTokenizer) -> None:
    rng = np.random.default_rng(5)
    words = ["prefix", "cache", "agent", "tool", "result", "naïve", "中文", "don't"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You route requests. " * 900}]
    llama.clear_cache()
    for turn in range(6):
        messages.append({"role": "user", "content": " ".join(rng.choice(words, 3_000))})
        array = llama.encode_chat_array(messages)
        assert array.tolist() == _expected(llama, messages)
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    stats = llama.memo_stats()
    assert stats.lookups == 6 and stats.reused == 5 and 0 < stats.bytes <= stats.max_bytes


def test_each_turn_adds_a_run_or_two_not_one_per_piece(llama: RequestTokenizer) -> None:
    # Each turn brings several pieces (added tokens cut them); one run per piece made the
    # memo join all of a conversation's ids every few turns.
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You route requests. " * 900}]
    llama.clear_cache()
    for turn in range(1, 9):
        messages += [
            {"role": "user", "content": f"question {turn} " * 40},
            {"role": "assistant", "content": f"answer {turn} " * 40},
        ]
        assert llama.encode_chat_array(messages).tolist() == _expected(llama, messages)
        [remembered] = [entry for _, entry in llama._memo.candidates(conversation_keys(messages))][:1]
        assert len(remembered.runs) <= 2 * turn
        assert len(llama.render_chat(messages).split("<|eot_id|>")) > 2 * turn  # pieces per turn > 1


def test_conversations_sharing_a_last_message_stay_apart() -> None:
    tok = RequestTokenizer.default()
    with mock.patch.object(tokenizer_module, "MEMO_MIN_CHARS", 0):
        first = [{"role": "system", "content": "one " * 50}, {"role": "user", "content": "continue"}]
        second = [{"role": "system", "content": "two " * 50}, {"role": "user", "content": "continue"}]
        for messages in (first, second, first + [{"role": "assistant", "content": "ok"}], second):
            assert tok.encode_chat_array(messages).tolist() == _expected(tok, messages)


def _prompt(text: str, size: int) -> RememberedPrompt:
    ends = np.array([len(text)], dtype=np.int64)
    return RememberedPrompt.of(text, ends, np.array([size], dtype=np.int64), [np.zeros(size, dtype=np.int64)])


@SETTINGS
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=80), data=st.data())
def test_runs_up_to_a_count_join_to_the_first_ids(sizes: list[int], data: st.DataObject) -> None:
    runs = [np.arange(size, dtype=np.int64) + 100 * number for number, size in enumerate(sizes)]
    for run in runs:
        run.flags.writeable = False
    prompt = RememberedPrompt.of("text", np.array([4]), np.array([sum(sizes)]), runs)
    ids = np.concatenate(runs)
    assert prompt.ids.tolist() == ids.tolist()
    # Kept narrowed (half the bytes), given back as int64.
    assert all(run.dtype == STORED_DTYPE for run in prompt.runs) and prompt.ids.dtype == np.int64
    assert len(prompt.runs) == (1 if len(runs) > MAX_RUNS else len(runs))
    count = data.draw(st.integers(0, len(ids)))
    head = prompt.runs_up_to(count)
    assert (np.concatenate(head).tolist() if head else []) == ids[:count].tolist()
    assert not any(run.flags.writeable for run in head)


def test_memo_keeps_a_few_prompts_per_key_within_its_bound() -> None:
    memo = PromptMemo(max_bytes=60_000)
    for number in range(PER_KEY + 2):
        memo.remember(1, _prompt(f"text {number}", 100))
    assert [prompt.text for _, prompt in memo.candidates([1])] == [f"text {n}" for n in range(PER_KEY + 1, 1, -1)]
    memo.remember(1, _prompt(f"text {PER_KEY + 1}", 100))  # the same text replaces its entry
    assert len(memo.candidates([1])) == PER_KEY
    for key in range(2, 200):
        memo.remember(key, _prompt(f"other {key}", 1_000))
        assert memo.stats().bytes <= memo.max_bytes
    assert memo.candidates([1]) == [] and memo.candidates([199])
    memo.remember(7, _prompt("too big", 20_000))  # larger than the whole bound: not kept
    assert memo.candidates([7]) == []
    memo.clear()
    assert memo.stats().entries == 0 and memo.stats().bytes == 0
    with pytest.raises(ValueError):
        PromptMemo(-1)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _turns(memo: PromptMemo[RememberedPrompt], clock: _Clock, conversations: list[int], turn: int) -> int:
    """One turn of each conversation, a second apart: each looks for its turn before and
    builds on it where found; how many found it."""
    found = 0
    for conversation in conversations:
        clock.now += 1
        before = [key for key, _ in memo.candidates([1000 * conversation + turn - 1])]
        found += bool(before)
        entry = _prompt(f"c{conversation} turn {turn}", 80)
        memo.remember(1000 * conversation + turn, entry, supersedes=before[0] if before else None)
    return found


def test_a_superseded_turn_is_evicted_first() -> None:
    """A conversation's next turn, built on its last, makes that entry the first to go:
    conversations each keep their newest turn however many turns they sent."""
    clock = _Clock()
    size = _prompt("c0 turn 0", 80).nbytes
    memo = PromptMemo(max_bytes=4 * size + size // 2, clock=clock)  # room for four entries
    assert [_turns(memo, clock, [0, 1, 2, 3], turn) for turn in range(4)] == [0, 4, 4, 4]
    assert memo.stats().entries == 4 and all(memo.candidates([1000 * c + 3]) for c in range(4))


def test_conversations_past_the_bound_keep_those_held_instead_of_trading_them() -> None:
    """Six conversations in a fixed cycle, room for four: least recently used would evict
    the next to come back every time (no turn would find its last); the memo keeps serving
    the conversations it holds."""
    clock = _Clock()
    size = _prompt("c0 turn 0", 80).nbytes
    memo = PromptMemo(max_bytes=4 * size + size // 2, clock=clock)
    found = [_turns(memo, clock, list(range(6)), turn) for turn in range(8)]
    assert found[0] == 0 and all(count >= 3 for count in found[2:]), found


def test_conversations_that_ended_make_room_for_new_ones() -> None:
    """Entries idle for more than a few of their conversation's gaps are evicted before
    those of conversations still coming back."""
    clock = _Clock()
    size = _prompt("c0 turn 0", 80).nbytes
    memo = PromptMemo(max_bytes=4 * size + size // 2, clock=clock)
    for turn in range(3):
        _turns(memo, clock, [0, 1, 2, 3], turn)
    for turn in range(3, 12):  # 0 and 1 end; 2 and 3 go on, with 4 and 5 new
        _turns(memo, clock, [2, 3, 4, 5], turn)
    held = {conversation for conversation in range(6) if memo.candidates([1000 * conversation + 11])}
    assert held == {2, 3, 4, 5}
