"""Incremental chat rendering: byte-identical to a whole render under every template, or whole.

Each test renders conversations turn by turn (and in branches) with a tokenizer whose render
memo keeps conversations of any length, and compares every text with the same tokenizer's
whole render (``render_memo_bytes=0``), which is how every chat was rendered before.
Templates whose syntax breaks the prefix property must be refused and rendered whole.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index import RequestTokenizer, chat_template
from kvroute.tokenizer_index.chat_template import ChatTemplate
from kvroute.tokenizer_index.prompt_memo import conversation_keys
from kvroute.tokenizer_index.render_memo import MIN_MESSAGES, RenderMemo, RenderSettings, incremental_render_agrees
from kvroute.tokenizer_index.template_prefix import prefix_shape
from tests.paths import REPO
from tests.tokenizer_index.test_prompt_memo import TEMPLATES
from tests.tokenizer_index.tokenizers_fixtures import (
    LLAMA3_INDEX_TEMPLATE,
    LLAMA3_STYLE_TEMPLATE,
    LLAMA31_STYLE_TEMPLATE,
    MISTRAL_STYLE_TEMPLATE,
    OPENAI_PARTS_TEMPLATE,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALL_TEMPLATES = {
    **TEMPLATES,
    "default": RequestTokenizer.default().chat_template().source,
    "llama3": LLAMA3_STYLE_TEMPLATE,
    "llama3_index": LLAMA3_INDEX_TEMPLATE,
    "llama31": LLAMA31_STYLE_TEMPLATE,
    "qwen25": (REPO / "benchmarks" / "templates" / "qwen25_style.jinja").read_text(),
    # Its messages' texts depend on the position of the last user query: rendered whole.
    "qwen3": (REPO / "benchmarks" / "templates" / "qwen3_style.jinja").read_text(),
    "mistral": MISTRAL_STYLE_TEMPLATE,
    "openai_parts": OPENAI_PARTS_TEMPLATE,
}
INCREMENTAL = {
    *("prefix_stable", "raw", "thinking_prompt", "default", "openai_parts"),
    *("llama3", "llama3_index", "llama31", "marks_last", "qwen25"),
}
#: Those whose message texts depend on their neighbours (the memo renders the last few again).
LOOKAROUND = {"marks_last", "qwen25"}
#: The leading messages each incremental template's renders repeat (the head peels the rest off).
ANCHORS = {"llama3": 2, "llama31": 3}

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
FRAGMENTS = ["the router", " cache", "中文", "e\u0301", "😀", "\n", "  ", "<|im_end|>", "<|im_start|>", "{{ x }}"]
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


@pytest.fixture(scope="module", params=sorted(ALL_TEMPLATES))
def renderers(request: pytest.FixtureRequest) -> Renderers:
    return Renderers(ALL_TEMPLATES[request.param])


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_templates_that_keep_the_prefix_property_are_recognised(name: str) -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    shape = prefix_shape(template.syntax_tree)
    assert shape.stable == (name in INCREMENTAL)
    assert shape.anchors == ANCHORS.get(name, 1)
    assert shape.lookaround == (name in LOOKAROUND)
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
        anchors = prefix_shape(template.syntax_tree).anchors
        remembered = renderers.memo.renders_incrementally(template) and len(history) >= anchors
        assert renderers.memo.render_memo_stats().reused == reused + remembered
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


def test_a_template_that_breaks_the_prefix_property_renders_whole() -> None:
    renderers = Renderers(ALL_TEMPLATES["counted"])
    messages = [{"role": "user" if turn % 2 else "assistant", "content": f"m{turn}"} for turn in range(30)]
    for end in range(1, len(messages) + 1):
        renderers.agree(messages[:end])
    assert renderers.memo.render_memo_stats().lookups == 0
    # The probe conversations alone would have caught it too.
    template = renderers.memo.chat_template()
    assert not incremental_render_agrees(template, renderers.memo.special_tokens)


@pytest.mark.parametrize("name", sorted(LOOKAROUND))
def test_a_template_reading_neighbours_renders_its_last_messages_again(name: str) -> None:
    """Its last message renders differently once another follows (``loop.last``, a tool
    result group closed): spliced as one message, it would differ, and the probes say so;
    with its last few messages rendered again it equals the whole render."""
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    shape = prefix_shape(template.syntax_tree)
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
    # The first two turns (5 and 9 messages) leave too few to render again behind the anchor.
    assert renderers.memo.render_memo_stats().reused == 7


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
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}",
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
    assert prefix_shape(template.syntax_tree).refusal is not None
    renderers = Renderers(source)
    assert not renderers.memo.renders_incrementally(renderers.memo.chat_template())


@pytest.mark.parametrize("name", sorted(ANCHORS))
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


def test_continue_final_message_renders_whole() -> None:
    renderers = Renderers(ALL_TEMPLATES["prefix_stable"])
    messages = [{"role": "user", "content": f"m{turn}"} for turn in range(20)]
    renderers.agree(messages)
    before = renderers.memo.render_memo_stats().lookups
    ongoing = [*messages, {"role": "assistant", "content": "The answer is"}]
    renderers.agree(ongoing, add_generation_prompt=False, continue_final_message=True)
    assert renderers.memo.render_memo_stats().lookups == before


def test_the_memo_stays_within_its_bound() -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES["prefix_stable"])
    memo = RenderMemo(20_000, min_messages=1)
    render_settings = RenderSettings(template, None, None, {}, True)
    for number in range(50):
        memo.render([{"role": "user", "content": f"{number} " * 300}], render_settings)
        assert memo.stats().bytes <= 20_000
    assert 0 < memo.stats().entries < 50
