"""Incremental chat rendering: byte-identical to a whole render under every template, or whole.

Each test renders conversations turn by turn (and in branches) with a tokenizer whose render
memo keeps conversations of any length, and compares every text with the same tokenizer's
whole render (``render_memo_bytes=0``), which is how every chat was rendered before.
Templates whose syntax breaks the prefix property must be refused and rendered whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.utils import Namespace

from kvroute.tokenizer_index import RequestTokenizer, chat_template
from kvroute.tokenizer_index.chat_messages import conversation_from_request
from kvroute.tokenizer_index.chat_template import ChatTemplate
from kvroute.tokenizer_index.prompt_memo import conversation_keys
from kvroute.tokenizer_index.render_memo import (
    CARRIED_MIN_MESSAGES,
    LOOKAROUND_WINDOW,
    MIN_MESSAGES,
    SPLIT_MAX_NEW,
    RenderMemo,
    RenderSettings,
    incremental_render_agrees,
)
from kvroute.tokenizer_index.template_prefix import (
    CarriedState,
    PrefixShape,
    _report_state,
    prefix_shape,
    template_shape,
)
from tests.paths import REPO
from tests.tokenizer_index.test_prompt_memo import TEMPLATES
from tests.tokenizer_index.tokenizers_fixtures import (
    LLAMA3_INDEX_TEMPLATE,
    LLAMA3_STYLE_TEMPLATE,
    LLAMA31_STYLE_TEMPLATE,
    MISTRAL_FIRST_TEMPLATE,
    MISTRAL_STYLE_TEMPLATE,
    MIXTRAL_LAST_TEMPLATE,
    OPENAI_PARTS_TEMPLATE,
)

DEEPSEEK_TEMPLATE = (REPO / "benchmarks" / "templates" / "deepseek_v3_style.jinja").read_text()
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALL_TEMPLATES = {
    **TEMPLATES,
    "default": RequestTokenizer.default().chat_template().source,
    "llama3": LLAMA3_STYLE_TEMPLATE,
    "llama3_index": LLAMA3_INDEX_TEMPLATE,
    "llama31": LLAMA31_STYLE_TEMPLATE,
    "qwen25": (REPO / "benchmarks" / "templates" / "qwen25_style.jinja").read_text(),
    # Its messages' texts depend on the position of the last user query (a last-match loop).
    "qwen3": (REPO / "benchmarks" / "templates" / "qwen3_style.jinja").read_text(),
    # Groups tool results by loop.previtem and loop.nextitem.
    "qwen3_coder": (REPO / "benchmarks" / "templates" / "qwen3_coder_style.jinja").read_text(),
    # Roles checked to alternate by the loop position's parity (loop.index0 % 2).
    "mistral": MISTRAL_STYLE_TEMPLATE,
    "mistral_first": MISTRAL_FIRST_TEMPLATE,
    "mixtral_last": MIXTRAL_LAST_TEMPLATE,
    "gemma3": (REPO / "benchmarks" / "templates" / "gemma3_style.jinja").read_text(),
    # Carries state from message to message in a namespace, and gathers system messages.
    "deepseek": DEEPSEEK_TEMPLATE,
    "openai_parts": OPENAI_PARTS_TEMPLATE,
    # Every text through a macro (printed as it is when a string), then trimmed and tested.
    "qwen35": (REPO / "benchmarks" / "templates" / "qwen35_style.jinja").read_text(),
    # Every text through a macro printing a list of parts' texts (its content format is parts).
    "glm45": (REPO / "benchmarks" / "templates" / "glm45_style.jinja").read_text(),
    # GLM 4.5's with tool calls written compactly and reasoning kept on request (clear_thinking).
    "glm47": (REPO / "benchmarks" / "templates" / "glm47_style.jinja").read_text(),
}
INCREMENTAL = {
    *("prefix_stable", "raw", "thinking_prompt", "default", "openai_parts"),
    *("llama3", "llama3_index", "llama31", "marks_last", "qwen25", "qwen3", "qwen3_coder"),
    *("mistral", "mistral_first", "mixtral_last", "gemma3", "deepseek", "qwen35", "glm45", "glm47"),
}
#: Those whose message texts depend on their neighbours (the memo renders the last few again).
LOOKAROUND = {"marks_last", "qwen25", "qwen3", "qwen3_coder", "mixtral_last", "qwen35", "glm45", "glm47"}
#: Those whose message texts depend on their positions' parity (a window keeps it).
PARITY = {"mistral", "mistral_first", "mixtral_last", "gemma3"}
#: The leading messages each incremental template's renders repeat (the head peels the rest off).
ANCHORS = {"llama3": 2, "llama31": 3, "mistral_first": 2, "mixtral_last": 2, "gemma3": 2, "qwen3_coder": 2}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}},
        },
    }
]
_CALL = {"id": "call-1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
FRAGMENTS = [
    *("the router", " cache", "中文", "e\u0301", "😀", "\n", "  ", "<|im_end|>", "<|im_start|>", "{{ x }}"),
    *("<tool_response>", "</tool_response>", "<think>", "</think>"),
]
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), min_size=0, max_size=6).map("".join)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.sampled_from(["call-1", "call-2"]),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["search", "read"]), "arguments": st.sampled_from(['{"q": "x"}', "{}", "bad"])}
            ),
        }
    ),
    min_size=1,
    max_size=2,
)


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "assistant", "tool", "system", "developer"]))
    result: dict[str, Any] = {"role": role, "content": draw(texts | st.none())}
    if role == "assistant" and draw(st.booleans()):
        result["tool_calls"] = draw(tool_calls)
    if role == "assistant" and draw(st.booleans()):
        result["reasoning"] = draw(texts)
    if role == "tool":
        result["tool_call_id"] = draw(st.sampled_from(["call-1", "call-2"]))
    if draw(st.booleans()):
        result["name"] = draw(st.sampled_from(["ann", "bob"]))
    return result


conversations = st.lists(message(), min_size=1, max_size=9)


class Renderers:
    """A tokenizer with a render memo for conversations of any length, and one without."""

    def __init__(self, source: str) -> None:
        backend = RequestTokenizer.default().backend
        specials = {"bos_token": "<s>", "eos_token": "</s>"}
        self.memo = RequestTokenizer(backend, chat_templates={"default": source}, special_tokens=specials)
        self.memo._render_memo.min_messages = 1  # short hypothesis conversations are remembered too
        self.memo._render_memo.carried_min_messages = 1
        self.whole = RequestTokenizer(
            backend, chat_templates={"default": source}, special_tokens=specials, render_memo_bytes=0
        )

    def agree(self, messages: list[dict[str, Any]], **options: Any) -> bool:
        """Both render ``messages`` alike: the same text (True), or the same kind of refusal."""
        try:
            expected = self.whole.render_chat(messages, **options)
        except ValueError as refusal:
            with pytest.raises(type(refusal)):
                self.memo.render_chat(messages, **options)
            return False
        assert self.memo.render_chat(messages, **options) == expected
        return True

    def agree_turn_by_turn(
        self,
        messages: list[dict[str, Any]],
        turn: Callable[[int], list[dict[str, Any]]],
        numbers: range,
        **options: Any,
    ) -> None:
        """Add ``turn(number)`` to ``messages`` for each of ``numbers``; after each, both render alike."""
        for number in numbers:
            messages += turn(number)
            assert self.agree(messages, **options)


@pytest.fixture(scope="module", params=sorted(ALL_TEMPLATES))
def renderers(request: pytest.FixtureRequest) -> Renderers:
    return Renderers(ALL_TEMPLATES[request.param])


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_templates_that_keep_the_prefix_property_are_recognised(name: str) -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    shape = template_shape(template)
    assert shape.stable == (name in INCREMENTAL)
    assert shape.anchors == ANCHORS.get(name, 1)
    assert shape.lookaround == (name in LOOKAROUND)
    assert shape.parity == (name in PARITY)
    assert (shape.carried is not None) == (name == "deepseek")
    renderers = Renderers(ALL_TEMPLATES[name])
    assert renderers.memo.renders_incrementally(renderers.memo.chat_template()) == (name in INCREMENTAL)


@SETTINGS
@given(history=conversations, branches=st.lists(conversations, min_size=1, max_size=3), data=st.data())
def test_each_turn_and_branch_renders_as_the_whole(
    renderers: Renderers, history: list[dict[str, Any]], branches: list[list[dict[str, Any]]], data: st.DataObject
) -> None:
    renderers.memo.clear_cache()
    tools = data.draw(st.sampled_from([None, TOOLS]))
    for end in range(1, len(history) + 1):
        renderers.agree(history[:end], tools=tools, add_generation_prompt=data.draw(st.booleans()))
    for branch in branches:  # siblings of the last turn, each continuing the same remembered turn
        renderers.agree(history + branch, tools=tools, add_generation_prompt=data.draw(st.booleans()))
    reused = renderers.memo.render_memo_stats().reused
    if renderers.agree(history, tools=tools) and conversation_keys(history):  # the same conversation again
        template = renderers.memo.chat_template()
        shape = template_shape(template)
        remembered = renderers.memo.renders_incrementally(template) and len(history) >= shape.anchors
        # (A state-carrying template renders a retry through a window, where one fits.)
        reused_now = renderers.memo.render_memo_stats().reused - reused
        assert reused_now == remembered or (shape.carried is not None and reused_now < remembered)
    renderers.agree(history, tools=None if tools else TOOLS)  # other tools: nothing reused
    renderers.agree(history + branches[0], chat_template_kwargs={"extra": 1}, continue_final_message=False)


def test_a_long_conversation_renders_only_its_new_messages() -> None:
    renderers = Renderers(ALL_TEMPLATES["default"])
    renderers.memo._render_memo.min_messages = MIN_MESSAGES
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You route requests."}]
    long_renders = 0
    for turn in range(MIN_MESSAGES + 4):
        messages.append({"role": "user", "content": f"question {turn}"})
        renderers.agree(messages, tools=TOOLS)
        long_renders += len(messages) >= MIN_MESSAGES
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    stats = renderers.memo.render_memo_stats()
    # Remembered from the first render of MIN_MESSAGES messages on; every later one reuses.
    assert stats.lookups == long_renders > 1 and stats.reused == long_renders - 1
    assert 0 < stats.bytes <= stats.max_bytes


#: Per template, renderers for the first-turn test (made once: a tokenizer probes a template at its first use).
_FIRST_TURN_RENDERERS: dict[str, Renderers] = {}


@pytest.mark.parametrize("name", sorted(INCREMENTAL))
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(history=st.lists(message(), min_size=MIN_MESSAGES, max_size=MIN_MESSAGES + SPLIT_MAX_NEW + 1), data=st.data())
def test_a_conversations_first_long_turn_renders_as_the_whole(
    name: str, history: list[dict[str, Any]], data: st.DataObject
) -> None:
    """A first turn of MIN_MESSAGES or more (nothing remembered) renders its first messages
    from their skeleton and the rest after them where it can: as the whole render, under
    every template the memo takes, and its next turn continues it."""
    renderers = _FIRST_TURN_RENDERERS.get(name) or _FIRST_TURN_RENDERERS.setdefault(
        name, Renderers(ALL_TEMPLATES[name])
    )
    renderers.memo._render_memo.min_messages = MIN_MESSAGES
    renderers.memo.clear_cache()
    tools = data.draw(st.sampled_from([None, TOOLS]))
    renderers.agree(history, tools=tools, add_generation_prompt=data.draw(st.booleans()))
    renderers.agree(history + data.draw(st.lists(message(), max_size=3)), tools=tools)


@pytest.mark.parametrize("name", ["default", "glm45", "qwen3", "qwen35", "llama31", "gemma3", "qwen3_coder"])
def test_a_first_long_turn_renders_its_first_messages_from_their_skeleton(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under templates whose short chats fill skeletons, a new conversation's first turn of
    16 messages renders the first 14 so and the last 2 after them (not every message); not
    where a last-match loop must run in Jinja (Qwen 3.5's reads a text through a macro),
    which costs more."""
    renderers = Renderers(ALL_TEMPLATES[name])
    renderers.memo._render_memo.min_messages = MIN_MESSAGES
    split = RenderMemo._render_split
    results: list[object] = []

    def spied(self: RenderMemo, *args: Any) -> object:
        result = split(self, *args)
        if self is renderers.memo._render_memo:  # (not the probes' own memos)
            results.append(result)
        return result

    monkeypatch.setattr(RenderMemo, "_render_split", spied)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You route requests."}]
    while len(messages) < MIN_MESSAGES:
        messages += [{"role": "user", "content": f"q{len(messages)}"}, {"role": "assistant", "content": "a"}]
    messages = messages[:MIN_MESSAGES]
    assert renderers.agree(messages)
    assert len(results) == 1 and (results[0] is None) == (name == "qwen35")
    stats = renderers.memo.render_memo_stats()
    assert (stats.lookups, stats.reused, stats.entries) == (1, 0, 1)


def test_a_template_that_breaks_the_prefix_property_renders_whole() -> None:
    renderers = Renderers(ALL_TEMPLATES["counted"])
    messages = [{"role": "user" if turn % 2 else "assistant", "content": f"m{turn}"} for turn in range(30)]
    for end in range(1, len(messages) + 1):
        renderers.agree(messages[:end])
    assert renderers.memo.render_memo_stats().lookups == 0
    # The probe conversations alone would have caught it too.
    template = renderers.memo.chat_template()
    assert not incremental_render_agrees(template, renderers.memo.special_tokens)


@pytest.mark.parametrize("name", sorted(LOOKAROUND - PARITY))  # (parity templates take no tool messages)
def test_a_template_reading_neighbours_renders_its_last_messages_again(name: str) -> None:
    """Its last message renders differently once another follows (``loop.last``, a tool
    result group closed): spliced as one message, it would differ, and the probes say so;
    with its last few messages rendered again it equals the whole render."""
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    shape = template_shape(template)
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    assert not incremental_render_agrees(template, specials)  # as if it read no neighbour
    assert incremental_render_agrees(template, specials, shape)
    renderers = Renderers(ALL_TEMPLATES[name])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You route requests."}]
    for turn in range(8):
        messages.append({"role": "user", "content": f"question {turn}"})
        messages.append({"role": "assistant", "content": None, "tool_calls": [_CALL]})
        messages += [{"role": "tool", "tool_call_id": "call-1", "content": f"r{turn}.{n}"} for n in range(2)]
        assert renderers.agree(messages, tools=TOOLS)
    # The first two turns (5 and 9 messages) leave too few to render again behind the anchor
    # (under a last-query template, from the last query on: the same here).
    assert renderers.memo.render_memo_stats().reused == 7


@pytest.mark.parametrize("name", sorted(PARITY))
def test_a_template_checking_that_roles_alternate_renders_each_message_at_its_parity(name: str) -> None:
    """Mistral's and Gemma's templates refuse a message whose role does not match its loop
    position's parity. Behind the anchors alone, the new messages of every other turn would
    sit at the other parity (refused, or rendered as the other role) and the probes say so;
    with one remembered message between, every turn equals the whole render."""
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    shape = template_shape(template)
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    if not shape.lookaround:  # (a lookaround template whose window is refused renders whole)
        assert not incremental_render_agrees(template, specials, replace(shape, parity=False))
    assert incremental_render_agrees(template, specials, shape)
    for system in ([], [{"role": "system", "content": "You route requests."}]):
        renderers = Renderers(ALL_TEMPLATES[name])
        messages = [*system]
        rendered = 0
        for turn in range(16):  # one message a turn: the new ones start at either parity
            messages.append({"role": "assistant" if turn % 2 else "user", "content": f"message {turn}"})
            rendered += renderers.agree(messages, add_generation_prompt=turn % 2 == 0)
        if name == "mistral" and system:  # refuses a system message: nothing rendered, nothing remembered
            assert rendered == 0
            continue
        assert rendered == 16
        expected = sum(_reuses(shape, end - 1) for end in range(len(system) + 2, len(messages) + 1))
        assert renderers.memo.render_memo_stats().reused == expected


def _deepseek_turn(number: int) -> list[dict[str, Any]]:
    call = {"id": f"call-{number}", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    return [
        {"role": "assistant", "content": None if number % 2 else "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call-{number}", "content": f"result {number}"},
    ]


def test_a_template_carrying_state_remembers_only_conversations_where_that_pays() -> None:
    """Continuing a turn under a state-carrying template costs two reported renders of a
    window, what ~40 messages cost whole: a shorter conversation renders whole and is not
    remembered; from CARRIED_MIN_MESSAGES messages on it is, and its next turns continue."""
    renderers = Renderers(DEEPSEEK_TEMPLATE)
    memo = renderers.memo._render_memo
    memo.min_messages, memo.carried_min_messages = MIN_MESSAGES, CARRIED_MIN_MESSAGES
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": "Find it."},
    ]
    turns = (CARRIED_MIN_MESSAGES - len(messages)) // 2
    renderers.agree_turn_by_turn(messages, _deepseek_turn, range(turns - 1), tools=TOOLS)
    assert len(messages) < CARRIED_MIN_MESSAGES and memo.stats().lookups == memo.stats().entries == 0
    renderers.agree_turn_by_turn(messages, _deepseek_turn, range(turns - 1, turns + 3), tools=TOOLS)
    assert (memo.stats().lookups, memo.stats().reused) == (4, 3)  # remembered at 40, continued after


def test_a_template_carrying_state_renders_agent_turns_incrementally() -> None:
    """DeepSeek's template keeps whether a tool call and a tool output came before and whether
    the last message was a tool's: a window of the last four messages ends in the states the
    whole render did, so every turn after the first renders only its new messages."""
    renderers = Renderers(DEEPSEEK_TEMPLATE)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You route requests."},
        {"role": "user", "content": "Find it."},
    ]
    renderers.agree_turn_by_turn(messages, _deepseek_turn, range(12), tools=TOOLS)
    # A window of four pays from 9 remembered messages on: the turns that make 12-26 reuse.
    assert renderers.memo.render_memo_stats().reused == 8
    # A final answer, then the user's next question; then the same request again.
    messages += [{"role": "assistant", "content": "Found."}, {"role": "user", "content": "Again."}]
    assert renderers.agree(messages, tools=TOOLS)
    assert renderers.agree(messages, tools=TOOLS, add_generation_prompt=False)
    assert renderers.memo.render_memo_stats().reused == 10


def test_a_state_no_window_reaches_renders_whole() -> None:
    """A tool call sets a flag for good: a window of the last four messages that holds none
    misses it, the wider one of sixteen holds it while it is among them, and past that the
    conversation renders whole (always the same text). A late system message changes the
    head the gathering loop writes: whole."""
    renderers = Renderers(DEEPSEEK_TEMPLATE)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    chat = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]
    assert renderers.agree(messages)
    reuses = []
    for turn in range(24):  # the tool call at messages 30 and 31
        before = renderers.memo.render_memo_stats().reused
        messages += _deepseek_turn(0) if turn == 14 else chat
        assert renderers.agree(messages)
        reuses.append(renderers.memo.render_memo_stats().reused - before)
    # Renders of 4, 6, ..., 50 messages. A window is at most half of what was remembered:
    # four from 9 remembered messages on, sixteen from 33. The call is within the last four
    # remembered up to 34, within the last sixteen up to 46; then nothing reaches its flag.
    assert reuses == [0] * 4 + [1] * 13 + [1] * 6 + [0]
    reused = renderers.memo.render_memo_stats().reused
    assert renderers.agree([*messages, {"role": "system", "content": "late"}, {"role": "user", "content": "u"}])
    assert renderers.memo.render_memo_stats().reused == reused


def test_a_namespace_the_head_writes_over_its_tools_carries_no_state() -> None:
    """DeepSeek R1's template builds its tool text in a namespace declared under ``if
    tools`` and written in a loop over the tools: once a render, not once a message, so it
    needs no report; the messages loop's own namespace still does."""
    source = (
        "{% set ns = namespace(tool=false) %}"
        "{% if tools %}{% set tool_ns = namespace(text='') %}"
        "{% for tool in tools %}{% set tool_ns.text = tool_ns.text + tool['function']['name'] %}{% endfor %}"
        "{{ tool_ns.text }}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% set ns.tool = true %}{% endif %}"
        "{{ m['role'] }}{{ '*' if ns.tool else '' }}:{{ m['content'] }}|{% endfor %}"
    )
    shape = prefix_shape(ChatTemplate.from_source(source).syntax_tree)
    assert shape.refusal is None and shape.carried is not None
    renderers = Renderers(source)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    renderers.agree_turn_by_turn(messages, _deepseek_turn, range(8), tools=TOOLS)
    assert renderers.memo.render_memo_stats().reused == 4  # from 9 remembered messages on


def test_a_state_that_never_repeats_renders_whole_and_the_same() -> None:
    """A namespace counting the messages: no window ends in the whole render's count."""
    source = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}"
    shape = prefix_shape(ChatTemplate.from_source(source).syntax_tree)
    assert shape.carried is not None
    renderers = Renderers(source)
    messages = [{"role": "user", "content": f"m{turn}"} for turn in range(30)]
    for end in range(1, len(messages) + 1):
        assert renderers.agree(messages[:end])
    assert renderers.memo.render_memo_stats().reused == 0


def test_a_state_json_cannot_write_is_never_taken_for_another() -> None:
    """A namespace holding an escaped string (a ``str`` subclass JSON refuses to stand for):
    its state is unknown, so no window is trusted, and a late system message the window
    does not hold still shows in every later message."""
    source = (
        "{% set ns = namespace(x='') %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set ns.x = m['content'] | e %}{% endif %}[{{ ns.x }}]{{ m['content'] }}"
        "{% endfor %}"
    )
    renderers = Renderers(source)
    messages = [
        {"role": "system", "content": "s0"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "<1>"},
    ]
    for number in range(12):
        messages.append({"role": "user", "content": f"m{number}"})
        assert renderers.agree(messages)
    assert renderers.memo.render_memo_stats().reused == 0


def test_the_report_reads_this_jinjas_namespaces() -> None:
    """The report reads a namespace's attributes where this Jinja keeps them; anything else
    reports an unknown state, which no window matches."""
    mark = CarriedState.MARK
    assert _report_state(Namespace(b=1, a="x")) == mark + '[[["a","x"],["b",1]]]' + mark
    assert _report_state(Namespace(a="x", b=1)) == _report_state(Namespace(b=1, a="x"))
    assert _report_state({"a": 1}) == mark + CarriedState.UNKNOWN + mark


def test_a_message_holding_the_state_mark_renders_as_the_template_does() -> None:
    """A message that holds the report's mark cuts the instrumented render in the wrong
    places: such a conversation renders as the template does, and is not remembered."""
    renderers = Renderers(DEEPSEEK_TEMPLATE)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "x" + CarriedState.MARK + "y"}]
    renderers.agree_turn_by_turn(messages, _deepseek_turn, range(8))
    assert renderers.memo.render_memo_stats().reused == 0


def _reuses(shape: PrefixShape, remembered: int) -> bool:
    """Whether a parity template's turn after one of ``remembered`` messages reuses it: always,
    but where a lookaround template's window (its last three, one more for parity) would
    reach into the anchors."""
    if not shape.lookaround:
        return remembered >= shape.anchors
    start = remembered - LOOKAROUND_WINDOW
    return start - (start - shape.anchors) % 2 >= shape.anchors


# Qwen 3's last-query loop, cut down: the texts of assistant messages after the last user
# query (not a wrapped tool result) show their reasoning.
_LAST_MATCH_HEAD = (
    "{% set ns = namespace(flag=true, last=messages|length - 1) %}"
    "{% for message in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}"
    "{% if ns.flag and message.role == 'user' and not message.content.startswith('<r>') %}"
    "{% set ns.flag = false %}{% set ns.last = index %}{% endif %}{% endfor %}"
)
_LAST_MATCH_BODY = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}[{{ m.reasoning_content }}]{% endif %}|{% endfor %}"
)


@pytest.mark.parametrize(
    "source",
    [
        # Reads another message, the list's length, or positions other than the first.
        "{% for m in messages %}{{ messages[loop.index0 - 1]['role'] }}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{{ m['content'] }}{% if loop.first or true %}{{ messages[loop.index0 + 1] }}{% endif %}"
        "{% endfor %}",
        "{% for m in messages %}{{ loop.last or messages[loop.index0 - 1]['role'] }}{% endfor %}",
        "{% for m in messages %}{{ loop.index0 == 0 or messages[loop.index0 - 2]['role'] }}{% endfor %}",
        "{% set rest = messages[1:] %}{% for m in rest %}{{ loop.first or messages[loop.index0 - 1] }}{% endfor %}",
        "{% for m in messages %}{{ loop.index }}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{{ m['content'] }}{{ loop.cycle('a', 'b') }}{% endfor %}",
        "{% set rest = messages[1:] %}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ rest | length }}",
        "{% set messages = messages | reverse %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% for m in messages %}{% endfor %}",
        "{% for m in messages if m['content'] %}{{ m['content'] }}{% endfor %}",
        "{% if messages | length > 1 %}x{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # Carries state from one message to the next.
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}",
        "{% set j = joiner(',') %}{% for m in messages %}{{ j() }}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{{ m['content'] }}{{ [1, 2] | random }}{% endfor %}",
        "{{ strftime_now(m) }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "{% set f = strftime_now %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # Peels messages where it may run more than once, or other than the first.
        "{% for t in tools %}{% set messages = messages[1:] %}{% endfor %}{% for m in messages %}{{ m }}{% endfor %}",
        "{% macro peel() %}{% set messages = messages[1:] %}{% endmacro %}{% for m in messages %}{{ m }}{% endfor %}",
        "{% set messages = messages[2:] %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "{% set messages = messages[:-1] %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "{% set rest = messages[1:] %}{% for m in rest %}{{ rest | length }}{{ m['content'] }}{% endfor %}",
        "{% set rest = messages[1:] %}{% for m in rest %}{% set rest = 1 %}{{ m['content'] }}{% endfor %}",
        "{% set rest = messages[1:] %}{% for m in rest %}{{ m }}{% endfor %}{% set messages = rest %}",
        "{% for m in messages %}{% if loop.index0 == 1 %}x{% endif %}{{ m['content'] }}{% endfor %}",
        # Reads its position other than by its parity.
        "{% for m in messages %}{% if loop.index0 % 3 == 0 %}x{% endif %}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{% if loop.revindex0 % 2 == 0 %}x{% endif %}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{% if (loop.index0 + 1) % 2 %}x{% endif %}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{% if loop.index0 is divisibleby(2) %}x{% endif %}{{ m['content'] }}{% endfor %}",
        "{% for m in messages %}{% for p in m['content'] %}{{ loop.index0 % 2 }}{% endfor %}{{ loop.index0 }}{% endfor %}",
        # Carries state with a peel, a neighbour or parity; folds that output or read positions.
        "{% set ns = namespace(n=0) %}{% set messages = messages[1:] %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m['content'] }}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ loop.last }}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = 1 %}{{ loop.index0 % 2 }}{% endfor %}",
        "{% set ns = namespace(s='') %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% for m in messages %}{% set ns.s = ns.s + m['content'] %}{% endfor %}{{ ns.s }}",
        "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s ~ loop.index0 %}{% endfor %}"
        "{{ ns.s }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # Does something between two loops over the messages before the messages loop.
        "{% set ns = namespace(s='', t='') %}{% for m in messages %}{% set ns.s = ns.s + m['role'] %}{% endfor %}"
        "{{ ns.s }}{% for m in messages %}{% set ns.s = m['role'] %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # Writes a namespace declared elsewhere than the head's top level, or from a macro.
        "{% if true %}{% set ns = namespace(n=0) %}{% endif %}"
        "{% for m in messages %}{% set ns.n = 1 %}{{ m['content'] }}{% endfor %}",
        "{% set ns = namespace(n=0) %}{% macro bump() %}{% set ns.n = 1 %}{% endmacro %}"
        "{% for m in messages %}{{ bump() }}{{ m['content'] }}{% endfor %}",
        # Carries state and reads the last message after the loop.
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = 1 %}{{ m['content'] }}{% endfor %}"
        "{{ messages[-1]['role'] }}",
        # Its parity and a last match: the match's window place would not keep it.
        _LAST_MATCH_HEAD + _LAST_MATCH_BODY.replace("{{ m.role }}:", "{{ loop.index0 % 2 }}{{ m.role }}:"),
        # Writes after the messages whatever the generation prompt, or reads it before.
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}a{% else %}b{% endif %}",
        "{% for m in messages %}{{ m['content'] }}{% if add_generation_prompt %}!{% endif %}{% endfor %}",
        # No single loop over the messages.
        "{{ messages[0]['content'] }}",
        "{% if true %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endif %}",
    ],
)
def test_syntax_that_may_break_the_prefix_property_is_refused(source: str) -> None:
    template = ChatTemplate.from_source(source)
    assert template_shape(template).refusal is not None
    renderers = Renderers(source)
    assert not renderers.memo.renders_incrementally(renderers.memo.chat_template())


@pytest.mark.parametrize(
    "source",
    [
        _LAST_MATCH_HEAD + _LAST_MATCH_BODY,
        # The position written straight into the namespace; the comparison the other way round.
        _LAST_MATCH_HEAD.replace("{% set index = (messages|length - 1) - loop.index0 %}", "").replace(
            "ns.last = index", "ns.last = (messages|length - 1) - loop.index0"
        )
        + _LAST_MATCH_BODY.replace("loop.index0 > ns.last", "ns.last < loop.index0"),
    ],
)
def test_a_last_match_loop_is_recognised(source: str) -> None:
    shape = prefix_shape(ChatTemplate.from_source(source).syntax_tree)
    assert shape.stable and shape.last_match is not None and shape.windowed
    renderers = Renderers(source)
    assert renderers.memo.renders_incrementally(renderers.memo.chat_template())


@pytest.mark.parametrize(
    ("head", "body"),
    [
        # The test reads more than the message: another message, the position, the namespace.
        ("message.role == 'user'", "messages[0].role == 'user'"),
        ("message.role == 'user'", "loop.index0 > 2"),
        ("message.role == 'user'", "ns.last > 2"),
        # The namespace starts elsewhere than the last message, or keeps more.
        ("last=messages|length - 1", "last=0"),
        ("flag=true, last=messages|length - 1", "flag=true, last=messages|length - 1, more=1"),
        # The match is kept other than as the position, or with more state.
        ("{% set ns.last = index %}", "{% set ns.last = index + 1 %}"),
        ("{% set ns.flag = false %}", "{% set ns.flag = false %}{% set ns.more = 1 %}"),
        ("{% set ns.flag = false %}", ""),
        ("{% endif %}{% endfor %}", "{% endif %}{{ message.content }}{% endfor %}"),
        ("{% endif %}{% endfor %}", "{% else %}{% set ns.flag = true %}{% endif %}{% endfor %}"),
        ("messages[::-1]", "messages[1:][::-1]"),
    ],
)
def test_last_match_loops_of_another_shape_are_refused(head: str, body: str) -> None:
    source = _LAST_MATCH_HEAD.replace(head, body) + _LAST_MATCH_BODY
    assert source != _LAST_MATCH_HEAD + _LAST_MATCH_BODY
    assert prefix_shape(ChatTemplate.from_source(source).syntax_tree).refusal is not None


@pytest.mark.parametrize(
    "body",
    [
        # The match read other than compared with a message's position, or the flag read.
        "{% for m in messages %}{{ m.content }}{{ ns.last }}{% endfor %}",
        "{% for m in messages %}{{ m.content }}{% if ns.flag %}!{% endif %}{% endfor %}",
        "{% for m in messages %}{% if loop.index > ns.last %}{{ m.content }}{% endif %}{% endfor %}",
        "{% for m in messages %}{% if loop.index0 > ns.last + 1 %}{{ m.content }}{% endif %}{% endfor %}",
        "{% for m in messages %}{% for c in m.content %}{{ loop.index0 > ns.last }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}{{ ns.last }}{% endif %}",
        # Written again after the loop, or a second reverse loop.
        "{% set ns.last = 0 %}" + _LAST_MATCH_BODY,
        "{% for m in messages[::-1] %}{% endfor %}" + _LAST_MATCH_BODY,
    ],
)
def test_a_last_match_read_other_than_by_position_is_refused(body: str) -> None:
    tree = ChatTemplate.from_source(_LAST_MATCH_HEAD + body).syntax_tree
    assert prefix_shape(tree).refusal is not None


#: GLM's last-match loop: forward, each match's position written over the last; -1 for none.
_FORWARD_MATCH_HEAD = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
)


def test_a_forward_last_match_loop_is_recognised() -> None:
    """GLM's form: the last match, or none (every message then reads as after it, not as the
    last message of Qwen 3's form): a conversation whose first match comes in a later turn
    renders that turn whole, and every turn as the whole template does."""
    source = _FORWARD_MATCH_HEAD + _LAST_MATCH_BODY
    shape = prefix_shape(ChatTemplate.from_source(source).syntax_tree)
    assert shape.stable and shape.windowed and shape.last_match is not None and shape.last_match.none_before_all
    system, user, answer = (
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "r"},
    )
    assert shape.last_match.find([system, user, answer, user, answer]) == 3
    assert shape.last_match.find([system, answer, answer]) is None
    renderers = Renderers(source)
    messages: list[dict[str, Any]] = [system]
    for turn in range(6):  # no match yet: every answer shows its reasoning
        messages.append({**answer, "content": f"a{turn}"})
        assert renderers.agree(messages)
    messages.append(user)  # the first match: every answer before it loses its reasoning
    assert renderers.agree(messages) and "[r]" not in renderers.memo.render_chat(messages)
    for turn in range(6):
        messages += [{**answer, "content": f"b{turn}"}, {**user, "content": f"q{turn}"}]
        assert renderers.agree(messages)
    assert renderers.memo.render_memo_stats().reused >= 10


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("last=-1", "last=0"),  # a match could be told from none only by the loop
        ("last=-1", "last=-1, more=1"),
        ("ns.last = loop.index0", "ns.last = loop.index"),
        ("ns.last = loop.index0 %}", "ns.last = loop.index0 %}{% set ns.more = 1 %}"),
        ("m.role == 'user'", "messages[0].role == 'user'"),  # the test reads more than the message
        ("m.role == 'user'", "loop.first"),
        ("{% endif %}{% endfor %}", "{% endif %}{{ m.content }}{% endfor %}"),
        ("{% endif %}{% endfor %}", "{% else %}{% set ns.last = -1 %}{% endif %}{% endfor %}"),
        ("{% for m in messages %}", "{% for m in messages[1:] %}"),
    ],
)
def test_forward_last_match_loops_of_another_shape_are_refused(old: str, new: str) -> None:
    head = _FORWARD_MATCH_HEAD.replace(old, new)
    assert head != _FORWARD_MATCH_HEAD
    assert prefix_shape(ChatTemplate.from_source(head + _LAST_MATCH_BODY).syntax_tree).refusal is not None


@pytest.mark.parametrize("name", ["qwen3", "glm45", "glm47"])
@SETTINGS
@given(history=conversations)
def test_a_last_match_found_in_python_is_the_one_the_template_finds(name: str, history: list[dict[str, Any]]) -> None:
    """Qwen 3's test of a message (role, content a string, its ends) and GLM's (role) run in
    Python: on the converted messages (GLM's on the messages as sent too), the match is the
    template's own loop's."""
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    last_match = template_shape(template).last_match
    assert last_match is not None and (last_match.roles is not None or last_match.message_test is not None)
    in_jinja = replace(last_match, roles=None, message_test=None)
    converted = conversation_from_request(history, template.content_format)
    for start in (0, len(history) // 2):
        assert last_match.find(converted, start) == in_jinja.find(converted, start)
        if last_match.roles is not None:
            assert last_match.find(history, start) == in_jinja.find(converted, start)


def test_qwen3s_last_query_in_python_skips_wrapped_tool_results() -> None:
    """The Python test takes a user turn wrapped in tool-response tags at both ends for no
    query, as the template does; one wrapped at one end only is a query."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen3"])
    last_match = template_shape(template).last_match
    assert last_match is not None and last_match.message_test is not None
    in_jinja = replace(last_match, roles=None, message_test=None)
    wrapped, half = "<tool_response>r</tool_response>", "<tool_response>r"
    for texts, expected in (
        ([wrapped, "q", wrapped], 1),
        (["q", half], 1),
        (["q", "</tool_response>" + wrapped], 1),
        ([wrapped, wrapped], None),
    ):
        messages = [{"role": "user", "content": text} for text in texts]
        converted = conversation_from_request(messages, template.content_format)
        assert last_match.find(converted) == in_jinja.find(converted) == expected


@pytest.mark.parametrize("role", [["user"], {"user": 1}, None, 3])
def test_a_malformed_role_after_a_remembered_turn_is_the_clients_error(role: object) -> None:
    """GLM's last-match loop runs in Python on the new messages as sent: a role that is no
    text (unhashable too) is refused as the whole render refuses it, not crashed on."""
    renderers = Renderers(ALL_TEMPLATES["glm45"])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert renderers.agree(messages)
    assert not renderers.agree([*messages, {"role": "assistant", "content": "b"}, {"role": role, "content": "x"}])


@pytest.mark.parametrize("name", ["glm45", "glm47"])
def test_glm_chats_and_agents_render_from_the_remembered_turn(name: str) -> None:
    """GLM 4.5's and 4.7's templates: a chat's answers show their reasoning only after the
    last user turn; each turn renders as the whole template does, from the remembered one."""
    renderers = Renderers(ALL_TEMPLATES[name])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You help."}]
    for turn in range(20):
        messages.append({"role": "user", "content": f"question {turn}"})
        assert renderers.agree(messages)
        messages.append({"role": "assistant", "content": f"<think>hm {turn}</think>answer {turn}"})
    assert "hm 18" not in renderers.memo.render_chat(messages) and "hm 19" in renderers.memo.render_chat(messages)
    chat_reused = renderers.memo.render_memo_stats().reused
    assert chat_reused >= 15
    renderers.agree_turn_by_turn(messages, _qwen3_agent_turn, range(8), tools=TOOLS)
    assert renderers.memo.render_memo_stats().reused >= chat_reused + 6


#: Qwen 3.5's last-match loop: each text through a macro printing a string as it is, then
#: trimmed into a name, which an inner test reads; a raise where no message matched.
_MACRO = (
    "{% macro show(c, counted=false) %}{% if c is string %}{{ c }}{% elif c is iterable %}"
    "{% for p in c %}{% set seen.n = seen.n + 1 %}{{ p.text }}{% endfor %}{% endif %}{% endmacro %}"
    "{% set seen = namespace(n=0) %}"
)
_NESTED_LAST_MATCH = (
    "{% if not messages %}{{ raise_exception('none') }}{% endif %}"
    "{% set ns = namespace(flag=true, last=messages|length - 1) %}"
    "{% for message in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}"
    "{% if ns.flag and message.role == 'user' %}{% set text = show(message.content) | trim %}"
    "{% if not text.startswith('<r>') %}{% set ns.flag = false %}{% set ns.last = index %}{% endif %}"
    "{% endif %}{% endfor %}{% if ns.flag %}{{ raise_exception('no query') }}{% endif %}"
    "{% for m in messages %}{% set content = show(m.content, true) | trim %}{{ m.role }}:{{ content }}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}[after]{% endif %}|{% endfor %}"
)


def test_a_last_match_through_a_macro_renders_incrementally() -> None:
    """Qwen 3.5's form: the macro read through where contents reach the template as strings
    (the content format), refused elsewhere; every turn renders as the whole template does,
    and later turns from the remembered one."""
    source = _MACRO + _NESTED_LAST_MATCH
    tree = ChatTemplate.from_source(source).syntax_tree
    assert prefix_shape(tree).refusal is not None  # (the macro writes a namespace for parts)
    shape = prefix_shape(tree, string_contents=True)
    assert shape.refusal is None and shape.last_match is not None
    assert shape.last_match.find([{"role": "user", "content": " q "}, {"role": "user", "content": "<r>x"}]) == 0
    renderers = Renderers(source)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "question"}]
    for turn in range(12):
        messages += [{"role": "assistant", "content": f"answer {turn}"}, {"role": "user", "content": f"<r>{turn}"}]
        assert renderers.agree(messages)
    assert renderers.memo.render_memo_stats().reused > 0


@pytest.mark.parametrize(
    "change",
    [
        ("show(message.content)", "show(message.role)"),  # the macro handed something else
        ("show(m.content, true)", "show(m, true)"),
        ("{{ raise_exception('no query') }}", "{{ raise_exception('no query') }}x"),  # text where none matched
        ("{% if ns.flag %}{{ raise", "{% if not ns.flag %}{{ raise"),
        ("{% set text = show(message.content) | trim %}", "{% set text = show(message.content) ~ ns.last %}"),
    ],
)
def test_a_last_match_through_a_macro_otherwise_is_refused(change: tuple[str, str]) -> None:
    old, new = change
    source = (_MACRO + _NESTED_LAST_MATCH).replace(old, new)
    assert source != _MACRO + _NESTED_LAST_MATCH
    assert prefix_shape(ChatTemplate.from_source(source).syntax_tree, string_contents=True).refusal is not None


def test_running_the_last_match_loop_leaves_the_template_as_parsed() -> None:
    """Compiling the loop alone optimises its tree in place: it runs on copies."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen3"])
    last_match = template_shape(template).last_match
    assert last_match is not None
    assert last_match.find([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == 0
    assert template.syntax_tree == ChatTemplate.from_source(ALL_TEMPLATES["qwen3"]).syntax_tree  # parsed afresh
    assert template_shape(template).last_match is not None


def _qwen3_agent_turn(number: int) -> list[dict[str, Any]]:
    call = {**_CALL, "id": f"call-{number}"}
    return [
        {"role": "assistant", "content": f"<think>\nstep {number}\n</think>\n\nCalling.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call-{number}", "content": f"result {number}"},
    ]


def test_qwen3_agent_turns_render_incrementally_and_a_new_query_from_the_last() -> None:
    """An agent's tool turns after its user's query reuse the remembered render (the query
    carried in the window, so the newest turns show their reasoning as in the whole render);
    a new query makes the turns after the last one render without their reasoning, so its
    turn renders again from the last query on."""
    renderers = Renderers(ALL_TEMPLATES["qwen3"])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You act."},
        {"role": "user", "content": "Do the task."},
    ]
    renderers.agree_turn_by_turn(messages, _qwen3_agent_turn, range(10), tools=TOOLS)
    stats = renderers.memo.render_memo_stats()
    assert stats.reused == stats.lookups - 1 == 9  # from the second turn on (4 messages), every one
    rendered = renderers.memo.render_chat(messages, tools=TOOLS)
    assert "<think>\nstep 9\n</think>" in rendered and "<think>\nstep 0\n</think>" in rendered
    messages.append({"role": "user", "content": "<tool_response>\nlate result\n</tool_response>"})
    assert renderers.agree(messages, tools=TOOLS)  # a wrapped tool result is no query: reused
    messages.append({"role": "user", "content": "Now another task."})
    assert renderers.agree(messages, tools=TOOLS)  # a query: every step's reasoning gone
    assert "step 9" not in renderers.memo.render_chat(messages, tools=TOOLS)
    renderers.agree_turn_by_turn(messages, _qwen3_agent_turn, range(10, 14), tools=TOOLS)
    # Two retries (the render_chat calls), the wrapped result, the new query's turn and
    # every turn after it.
    assert renderers.memo.render_memo_stats().reused == stats.reused + 3 + 1 + 4


def test_a_qwen3_chats_follow_up_questions_render_from_the_last_question() -> None:
    """Each turn of a chat brings a new query: the answers after the last one lose their
    reasoning, so each turn renders the last question, its answer and the new question
    again, and reuses everything before."""
    renderers = Renderers(ALL_TEMPLATES["qwen3"])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You help."}]
    for turn in range(24):
        messages.append({"role": "user", "content": f"question {turn}"})
        assert renderers.agree(messages)
        assert renderers.agree(messages, add_generation_prompt=False)  # and again, without
        messages.append({"role": "assistant", "content": f"<think>\nhm {turn}\n</think>\n\nanswer {turn}"})
    assert "hm 22" not in renderers.memo.render_chat(messages[:-1])  # an earlier answer's reasoning
    stats = renderers.memo.render_memo_stats()
    # Every render but the first two questions' (the window from the last question on would
    # reach into the anchor), retries included.
    assert stats.reused == stats.lookups - 2 == 2 * 24 + 1 - 2
    # Tool turns after the chat's last query reuse the render as before.
    messages += _qwen3_agent_turn(0)
    assert renderers.agree(messages)
    assert renderers.memo.render_memo_stats().reused == stats.reused + 1


@pytest.mark.parametrize("name", sorted(set(ANCHORS) - LOOKAROUND))
def test_templates_that_peel_messages_render_long_conversations_incrementally(name: str) -> None:
    renderers = Renderers(ALL_TEMPLATES[name])
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You route requests."}]
    for turn in range(12):
        messages.append({"role": "user", "content": f"question {turn}"})
        assert renderers.agree(messages, tools=TOOLS)
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    stats = renderers.memo.render_memo_stats()
    # Every turn from the one that holds the anchors on is remembered and reused by the next.
    assert stats.reused == 12 - (ANCHORS[name] + 1) // 2


class _Clock:
    """``datetime`` for the chat template module, at a day the test sets."""

    today = datetime(2026, 12, 1, 23, 59)

    @classmethod
    def now(cls) -> datetime:
        return cls.today


def test_a_render_made_on_another_day_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "datetime", _Clock)
    renderers = Renderers(ALL_TEMPLATES["llama31"])
    messages = [{"role": "user" if turn % 2 == 0 else "assistant", "content": f"m{turn}"} for turn in range(20)]
    assert renderers.agree(messages)
    assert "01 Dec 2026" in renderers.memo.render_chat(messages)
    reused = renderers.memo.render_memo_stats().reused
    monkeypatch.setattr(_Clock, "today", datetime(2026, 12, 2, 0, 1))
    longer = [*messages, {"role": "user", "content": "next day"}]
    assert renderers.agree(longer)
    assert renderers.memo.render_memo_stats().reused == reused  # yesterday's render is not today's
    assert "02 Dec 2026" in renderers.memo.render_chat(longer)
    assert renderers.memo.render_memo_stats().reused == reused + 1  # today's is


def test_values_json_cannot_tell_apart_are_not_reused() -> None:
    renderers = Renderers("{% for m in messages %}{{ m['role'] }}:{{ m['tool_calls'] }}.{% endfor %}")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"flag": 1}}}
    messages: list[dict[str, Any]] = [{"role": "assistant", "content": "a", "tool_calls": [call]}]
    renderers.agree(messages)
    # True and 1 are equal in Python, not in JSON or in the text.
    flagged = {**call, "function": {"name": "f", "arguments": {"flag": True}}}
    renderers.agree([{"role": "assistant", "content": "a", "tool_calls": [flagged]}, {"role": "user", "content": "b"}])

    class Text(str):
        pass

    renderers.agree([{"role": "user", "content": Text("a")}, {"role": "user", "content": "b"}])


def test_messages_changed_in_place_are_rendered_as_they_are_now() -> None:
    renderers = Renderers(ALL_TEMPLATES["default"])
    messages = [{"role": "user", "content": f"m{turn}"} for turn in range(20)]
    renderers.agree(messages)
    messages[3]["content"] = "changed"
    renderers.agree([*messages, {"role": "assistant", "content": "x"}])


def test_a_conversation_beyond_ascii_is_compared_by_its_texts() -> None:
    """Its key keeps the contents apart (compared as text, no UTF-8 copy each turn): the turn
    that brings its first such text switches it over, later turns reuse, and a text changed
    in place is seen."""
    renderers = Renderers(ALL_TEMPLATES["default"])
    renderers.memo._render_memo.min_messages = MIN_MESSAGES
    messages = [{"role": "user" if turn % 2 else "assistant", "content": f"m{turn}"} for turn in range(MIN_MESSAGES)]

    def remembered() -> list[Any]:
        return [entry for entries in renderers.memo._render_memo._memo._by_key.values() for entry in entries]

    renderers.agree(messages)
    assert [entry.messages.contents for entry in remembered()] == [None]  # ASCII: its JSON whole
    for turn in range(4):
        messages.append({"role": "user", "content": f"it’s turn {turn} \u2014 \u201cquoted\u201d"})
        renderers.agree(messages, tools=TOOLS if turn == 3 else None)
    stats = renderers.memo.render_memo_stats()
    assert stats.reused == 3  # (the fourth turn's other tools: rendered whole)
    latest = max(remembered(), key=lambda entry: entry.count)
    assert latest.messages.contents is not None and latest.messages.json.isascii()
    messages[MIN_MESSAGES + 1]["content"] = "changed \u2019"
    messages.append({"role": "assistant", "content": "x"})
    renderers.agree(messages, tools=TOOLS)  # (the remembered turn held the old text: whole)
    assert renderers.memo.render_memo_stats().reused == 3
    renderers.agree([*messages, {"role": "user", "content": "z \u00e9"}], tools=TOOLS)
    assert renderers.memo.render_memo_stats().reused == 4


def test_continue_final_message_renders_whole() -> None:
    renderers = Renderers(ALL_TEMPLATES["prefix_stable"])
    messages = [{"role": "user", "content": f"m{turn}"} for turn in range(20)]
    renderers.agree(messages)
    before = renderers.memo.render_memo_stats().lookups
    ongoing = [*messages, {"role": "assistant", "content": "The answer is"}]
    renderers.agree(ongoing, add_generation_prompt=False, continue_final_message=True)
    assert renderers.memo.render_memo_stats().lookups == before


def test_a_render_that_differs_from_the_whole_distrusts_its_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary: a render from a remembered turn is compared with the whole render (here
    every one); one that differs is replaced by the whole render, and the template renders
    whole from then on."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["default"])
    settings = RenderSettings(template, None, None, {}, True, template_shape(template))
    memo = RenderMemo(1 << 20, min_messages=1, verify_every=1)
    messages = [{"role": "user", "content": "first"}]
    assert memo.render(messages, settings) == settings.render_whole(messages)
    messages += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "second"}]
    assert memo.render(messages, settings) == settings.render_whole(messages)  # verified, equal
    assert memo.stats().mismatches == 0 and memo.stats().reused == 1

    original = RenderMemo._render_after  # make the path from a remembered turn lie

    def lying(self: RenderMemo, *args: Any) -> Any:
        rendered = original(self, *args)
        return None if rendered is None else replace(rendered, text=rendered.text + "!")

    monkeypatch.setattr(RenderMemo, "_render_after", lying)
    messages += [{"role": "assistant", "content": "b"}, {"role": "user", "content": "third"}]
    assert memo.render(messages, settings) == settings.render_whole(messages)
    assert memo.stats().mismatches == 1
    monkeypatch.setattr(RenderMemo, "_render_after", original)
    messages += [{"role": "assistant", "content": "c"}, {"role": "user", "content": "fourth"}]
    reused = memo.stats().reused
    assert memo.render(messages, settings) == settings.render_whole(messages)
    assert memo.stats().reused == reused  # whole from then on


def test_the_memo_stays_within_its_bound() -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES["prefix_stable"])
    memo = RenderMemo(20_000, min_messages=1)
    render_settings = RenderSettings(template, None, None, {}, True)
    for number in range(50):
        memo.render([{"role": "user", "content": f"{number} " * 300}], render_settings)
        assert memo.stats().bytes <= 20_000
    assert 0 < memo.stats().entries < 50
