"""Short chats filled into skeletons: byte-identical to the whole render under every template, or whole.

Each test compares a skeleton's text with the template rendered as it always was (the
messages converted, then Jinja), under every template the render memo's tests use and a
few written to trip the syntax check.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.benchmarks.overhead import agent_messages
from kvroute.tokenizer_index import RequestTokenizer
from kvroute.tokenizer_index.chat_messages import conversation_from_request, tools_from_request
from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError, tojson
from kvroute.tokenizer_index.render_skeleton import (
    AS_IS,
    DUMPED,
    TRIMMED,
    Skeleton,
    SkeletonRenders,
    marked,
    tools_key,
)
from kvroute.tokenizer_index.template_verbatim import verbatim_check
from tests.tokenizer_index.test_render_memo import ALL_TEMPLATES
from tests.tokenizer_index.test_template_verbatim import FILLED, PARTS_VERBATIM, TOOL_VERBATIM, VERBATIM

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

PLAIN_ROLES = ["system", "developer", "user", "assistant"]
FRAGMENTS = [
    *("the router", " ", "\n", "\t", "中文", "😀", "<|im_end|>", "{{ x }}", "\ue000", "\u2003", "e\u0301"),
    *("<think>", "</think>", "<tool_response>", "</tool_response>", "#"),
]
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=6).map("".join)
conversations = st.lists(st.tuples(st.sampled_from(PLAIN_ROLES), texts), min_size=1, max_size=8)


def render_whole(
    template: ChatTemplate, add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
) -> Callable[[Sequence[Any]], str]:
    def render(messages: Sequence[Any]) -> str:
        conversation = conversation_from_request(messages, template.content_format)
        return template.render(
            conversation,
            tools=tools_from_request(tools),
            add_generation_prompt=add_generation_prompt,
            variables=SPECIAL_TOKENS,
        )

    return render


def as_messages(turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in turns]


@pytest.mark.parametrize("name", sorted(FILLED | VERBATIM.keys() | PARTS_VERBATIM.keys()))
@SETTINGS
@given(turns=conversations, add_generation_prompt=st.booleans())
def test_a_filled_skeleton_is_the_whole_render(
    name: str, turns: list[tuple[str, str]], add_generation_prompt: bool
) -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES.get(name) or VERBATIM.get(name) or PARTS_VERBATIM[name])
    verdict = verbatim_check(template.syntax_tree, parts=template.content_format == "openai")
    assert verdict.refusal is None
    whole = render_whole(template, add_generation_prompt)
    renders = SkeletonRenders(verify_every=1_000_000)
    messages = as_messages(turns)
    try:
        expected: str | None = whole(messages)
    except ChatTemplateError:
        expected = None  # the template refuses the shape: no skeleton, and a whole render raises
    admitted = all(verdict.admits(text) for _, text in turns)
    # Where a named strip may reach a text's end, the skeleton decides (by slot).
    stripped = verdict.strip_characters
    may_refuse = any(text and (text[0] in stripped or text[-1] in stripped) for _, text in turns)
    for _ in range(2):  # built, then found
        text = renders.render(messages, template, add_generation_prompt, whole)
        if expected is None or not admitted:
            assert text is None
        elif may_refuse:
            assert text is None or text == expected
        else:
            assert text == expected


def test_a_shape_is_built_once_and_filled_with_other_texts() -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen25"])
    whole = render_whole(template)
    renders = SkeletonRenders(verify_every=1_000_000)
    rendered: list[int] = []

    def counted(messages: Sequence[Any]) -> str:
        rendered.append(len(messages))
        return whole(messages)

    first = as_messages([("system", "Be brief."), ("user", "Hello?")])
    second = as_messages([("system", "Be long."), ("user", "Bye. " * 50)])
    assert renders.render(first, template, True, counted) == whole(first)
    assert rendered == [2, 2]  # the marked render and the check
    assert renders.render(second, template, True, counted) == whole(second)
    assert rendered == [2, 2] and renders.stats().filled == 2
    # An empty text is another shape (templates test a text's truth).
    empty = as_messages([("system", ""), ("user", "Hello?")])
    assert renders.render(empty, template, True, counted) == whole(empty)
    assert len(rendered) == 4


def test_fields_set_to_null_are_part_of_the_shape() -> None:
    """Clients that dump SDK messages send ``"refusal": null``, ``"tool_calls": null``...:
    such a message fills the skeleton built with the same null fields."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["default"])
    whole = render_whole(template)
    renders = SkeletonRenders(verify_every=1_000_000)
    dumped = {"role": "assistant", "content": "Replica 1.", "refusal": None, "tool_calls": None, "audio": None}
    chat = [{"role": "user", "content": "Which replica?"}, dumped, {"role": "user", "content": "Why?"}]
    assert renders.render(chat, template, True, whole) == whole(chat)
    assert renders.render(chat, template, True, whole) == whole(chat)
    assert renders.stats().filled == 2 and len(renders._skeletons) == 1
    plain = [chat[0], {"role": "assistant", "content": "Replica 1."}, chat[2]]
    assert renders.render(plain, template, True, whole) == whole(plain)
    assert len(renders._skeletons) == 2  # another shape
    assert renders.render([{"role": "user", "content": "hi", "name": None, 3: None}], template, True, whole) is None


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi", "name": "ann"}],
        [{"role": "assistant", "content": "hi", "tool_calls": []}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": None}],
        [{"role": "tool", "content": "42", "name": "f"}],
        [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
        [{"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "1"}}]}],
        [
            {
                "role": "assistant",
                "content": "x",
                "tool_calls": [{"index": 0, "function": {"name": "f", "arguments": ""}}],
            }
        ],
        [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
        [{"role": "tool", "content": "42", "tool_call_id": 7}],
        [{"role": ["user"], "content": "hi"}],
        [{"role": "user", "content": "  \n"}],
        ({"role": "user", "content": "hi"},),
    ],
)
def test_messages_that_are_not_plain_render_whole(messages: Any) -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES["default"])
    assert SkeletonRenders().render(messages, template, True, render_whole(template)) is None


def test_a_skeleton_that_differs_from_the_whole_render_distrusts_its_template() -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES["default"])
    whole = render_whole(template)
    renders = SkeletonRenders(verify_every=2)
    messages = as_messages([("user", "hi")])
    assert renders.render(messages, template, True, whole) == whole(messages)
    key = next(iter(renders._skeletons))
    renders._skeletons[key] = Skeleton("not the template's text", ())
    assert renders.render(messages, template, True, whole) is None  # the second render is checked
    assert renders.stats().mismatches == 1 and renders.refusal(template) is not None
    assert renders.render(messages, template, True, whole) is None  # whole from now on


def test_a_mark_cut_by_the_template_makes_no_skeleton() -> None:
    filled = [True, False]
    assert Skeleton.cut("a" + marked(0) + "b", filled) == Skeleton("a", ((0, AS_IS, "b"),))
    assert Skeleton.cut("a" + marked(0).strip() + "b", filled) == Skeleton("a", ((0, TRIMMED, "b"),))
    assert Skeleton.cut("a" + tojson(marked(0)) + "b", filled) == Skeleton('a"', ((0, DUMPED, '"b'),))
    assert Skeleton.cut("a" + tojson(marked(0).strip()) + "b", filled) == Skeleton('a"', ((0, TRIMMED | DUMPED, '"b'),))
    assert Skeleton.cut("a" + marked(0)[:-1] + "b", filled) is None  # one side trimmed
    assert Skeleton.cut("a" + marked(1), filled) is None  # an empty message's
    assert Skeleton.cut("a" + marked(0)[:3] + "b", filled) is None  # cut into


def test_the_tokenizer_fills_short_plain_chats_and_renders_the_rest_whole() -> None:
    tokenizer = RequestTokenizer.default()
    whole = RequestTokenizer.default()
    whole._skeletons.render = lambda *args: None  # type: ignore[method-assign]  # (as before skeletons)
    chat = as_messages([("system", "You route."), ("user", "Which replica?")])
    before = tokenizer.skeleton_stats().filled  # (the tokenizer's own checks at start render a chat)
    assert tokenizer.render_chat(chat) == whole.render_chat(chat)
    assert tokenizer.skeleton_stats().filled == before + 1
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    other_tools = [{"type": "function", "function": {"name": "g"}}]
    for offered in (tools, tools, other_tools, []):  # a skeleton per tools (the same, then others)
        assert tokenizer.render_chat(chat, tools=offered) == whole.render_chat(chat, tools=offered)
    assert tokenizer.skeleton_stats().filled == before + 5
    before += 4
    requests: list[dict[str, Any]] = [
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"documents": [{"title": "t", "text": "x"}]},
    ]
    for extra in requests:
        assert tokenizer.render_chat(chat, **extra) == whole.render_chat(chat, **extra)
    assert tokenizer.skeleton_stats().filled == before + 1
    # A first turn too long to render its first messages from their skeleton (render_memo's
    # SPLIT_MAX_NEW) goes to the render memo whole, but its anchor alone (the cut for the
    # next turn) with and without the prompt filled.
    long_chat = as_messages([("user", f"turn {number}") for number in range(24)])
    assert tokenizer.render_chat(long_chat) == whole.render_chat(long_chat)
    assert tokenizer.skeleton_stats().filled == before + 3
    longer = [*long_chat, *as_messages([("assistant", "ok"), ("user", "turn 25")])]
    assert tokenizer.render_chat(longer) == whole.render_chat(longer)
    # the anchor and the two new messages filled, behind the remembered turn
    assert tokenizer.skeleton_stats().filled == before + 4 and tokenizer.render_memo_stats().reused == 1
    assert tokenizer.render_chat(chat, add_generation_prompt=False) == whole.render_chat(
        chat, add_generation_prompt=False
    )
    assert tokenizer.skeleton_stats().filled == before + 5


def test_threads_filling_and_evicting_shapes_at_once_get_whole_renders_right() -> None:
    """Huge prompts are prepared in worker threads: skeletons may be built, found and
    evicted by several at once (two shapes' room for eight shapes)."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen25"])
    whole = render_whole(template)
    renders = SkeletonRenders(max_shapes=2, verify_every=1_000_000)
    chats = [as_messages([("user", f"question {n}")] * (1 + n % 8)) for n in range(64)]
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                for messages in chats:
                    text = renders.render(messages, template, True, whole)
                    assert text is None or text == whole(messages)
        except BaseException as failure:
            failures.append(failure)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


# --- chats with tool calls and tool results ----------------------------------------------------

TOOL_FRAGMENTS = [*FRAGMENTS, '"', "\\", "\x01", "\u2028"]
tool_texts = st.lists(st.sampled_from(TOOL_FRAGMENTS) | st.text(max_size=5), max_size=5).map("".join)
#: An argument's value: every JSON type, nested, with the values a shape holds as they are
#: (true, false, null, zeros; "-0.0" prints apart from "0.0").
argument_values = st.recursive(
    tool_texts | st.integers() | st.floats(allow_nan=False) | st.booleans() | st.none() | st.sampled_from([0, -0.0]),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(tool_texts, inner, max_size=2),
    max_leaves=4,
)
arguments = st.one_of(
    st.dictionaries(tool_texts, argument_values, max_size=3).map(json.dumps),
    st.lists(tool_texts, max_size=2).map(json.dumps),
    tool_texts.map(json.dumps),  # arguments that are a JSON text
    st.sampled_from(["", "{not json", "{}", "[]", '{"n": 12345678901234567890123}']),
)
calls = st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": tool_texts, "arguments": arguments})},
    optional={"id": tool_texts, "type": st.just("function")},
)
tool_messages = st.one_of(
    st.tuples(st.sampled_from(PLAIN_ROLES), tool_texts).map(lambda turn: {"role": turn[0], "content": turn[1]}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none() | tool_texts,
            "tool_calls": st.lists(calls, min_size=1, max_size=2),
        }
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": tool_texts}, optional={"tool_call_id": tool_texts}),
)
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": 'Reads "a" file.', "parameters": {}}},
    {"type": "function", "function": {"name": "grep"}},
]
#: The templates whose syntax lets chats with tool calls fill skeletons (the rest render them whole).
TOOL_FILLED = {
    *("prefix_stable", "counted", "marks_last", "raw", "thinking_prompt", "default", "qwen25", "qwen3"),
    *("llama3", "llama3_index", "llama31", "mistral", "mistral_first", "mixtral_last", "qwen3_coder"),
    *("deepseek", "qwen35", "glm45", "glm47"),
}


@pytest.mark.parametrize("name", sorted(ALL_TEMPLATES))
def test_the_known_templates_fill_chats_with_tool_calls_as_expected(name: str) -> None:
    refusal = SkeletonRenders().refusal(ChatTemplate.from_source(ALL_TEMPLATES[name]), tools=True)
    assert (refusal is None) == (name in TOOL_FILLED), refusal


@pytest.mark.parametrize("name", sorted(TOOL_FILLED | TOOL_VERBATIM.keys()))
@SETTINGS
@given(
    messages=st.lists(tool_messages, min_size=1, max_size=6),
    add_generation_prompt=st.booleans(),
    tools=st.sampled_from([None, [], TOOLS]),
)
def test_a_filled_skeleton_with_tool_calls_is_the_whole_render(
    name: str, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict[str, Any]] | None
) -> None:
    template = ChatTemplate.from_source(ALL_TEMPLATES.get(name) or TOOL_VERBATIM[name])
    whole = render_whole(template, add_generation_prompt, tools)
    renders = SkeletonRenders(verify_every=1_000_000)
    try:
        expected: str | None = whole(messages)
    except ChatTemplateError:
        expected = None
    for _ in range(2):  # built, then found
        text = renders.render(messages, template, add_generation_prompt, whole, tools_key(tools) or b"")
        assert text is None or text == expected
    # Other tools are another skeleton: the same messages without tools render as without.
    without = render_whole(template, add_generation_prompt)
    text = renders.render(messages, template, add_generation_prompt, without)
    assert text is None or text == without(messages)


@pytest.mark.parametrize(
    "name", ["default", "qwen25", "qwen3", "llama31", "qwen3_coder", "qwen35", "deepseek", "glm45", "glm47"]
)
def test_an_agents_chat_fills_its_skeleton(name: str) -> None:
    """What an agent sends (tool calls with JSON arguments, tool results) fills a skeleton
    per shape under the templates that print them verbatim, and other texts fill it again."""
    template = ChatTemplate.from_source(ALL_TEMPLATES[name])
    whole = render_whole(template)
    renders = SkeletonRenders(verify_every=1_000_000)
    for number in range(3):
        chat = agent_messages(number, 8, f"You are agent {number}.")
        chat[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": f'a "quoted" {number}', "n": [1, 2]})
        if name == "llama31":  # one call per message, none with a text
            chat[2]["content"] = None
        assert renders.render(chat, template, True, whole) == whole(chat)
    assert renders.stats().filled == 3 and len(renders._skeletons) == 1


def test_arguments_a_template_iterates_join_the_shape_by_their_keys() -> None:
    """Under Qwen 3 Coder's template (one ``<parameter=key>`` element per argument, each value
    as a text or as JSON), the arguments' keys and their values' types are the shape: other
    values fill the same skeleton; other keys, another order or another type build another,
    and so do true, false, null and zeros, which the shape holds as they are."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen3_coder"])
    assert verbatim_check(template.syntax_tree, tools=True).argument_items
    assert not verbatim_check(ChatTemplate.from_source(ALL_TEMPLATES["qwen25"]).syntax_tree, tools=True).argument_items
    whole = render_whole(template)
    renders = SkeletonRenders(verify_every=1_000_000)

    def filled(arguments: dict[str, Any]) -> str | None:
        chat = agent_messages(0, 4, "You are an agent.")
        chat[2]["tool_calls"][0]["function"]["arguments"] = json.dumps(arguments)
        text = renders.render(chat, template, True, whole)
        assert text == whole(chat)
        return text

    first = filled({"path": "a.py", "limit": 10, "scale": 0.5, "deep": {"x": [1]}, "flag": True})
    second = filled({"path": 'b "q".py', "limit": 99, "scale": 1e300, "deep": {"y": ["z", {}]}, "flag": True})
    assert first is not None and "<parameter=limit>\n10\n" in first and '<parameter=deep>\n{"x": [1]}' in first
    assert second is not None and '<parameter=path>\nb "q".py\n' in second and "1e+300" in second
    assert len(renders._skeletons) == 1
    others = [
        {"limit": 10, "path": "a.py", "scale": 0.5, "deep": {"y": 1}, "flag": True},  # another order
        {"path": "a.py", "limit": "10", "scale": 0.5, "deep": {"y": 1}, "flag": True},  # a text for a number
        {"path": "a.py", "limit": 0, "scale": 0.5, "deep": {"y": 1}, "flag": True},  # a zero
        {"path": "a.py", "limit": 10, "scale": -0.0, "deep": {"y": 1}, "flag": True},
        {"path": "a.py", "limit": 10, "scale": 0.5, "deep": {"y": 1}, "flag": None},
    ]
    for number, arguments in enumerate(others, start=2):
        assert filled(arguments) is not None
        assert len(renders._skeletons) == number
    assert renders.stats().filled == 2 + len(others)


def test_qwen3_strips_only_the_answer_after_the_last_query() -> None:
    """Qwen 3's template strips newlines off the start of an answer only where it is the
    last message after the last query: tool results and earlier answers ending or starting
    in newlines fill the skeleton as they are; a last answer starting in one renders whole."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen3"])
    whole = render_whole(template, add_generation_prompt=False)
    renders = SkeletonRenders(verify_every=1_000_000)
    chat = agent_messages(0, 8, "You are an agent.")
    chat[3]["content"] = "\n  12 lines\n\n"
    chat[4]["content"] = "\nReading it again.\n"
    assert chat[-1]["role"] == "tool" and chat[-1]["content"].endswith("\n")
    assert renders.render(chat, template, False, whole) == whole(chat)
    answered = [*chat, {"role": "assistant", "content": "Done.\n"}]
    assert renders.render(answered, template, False, whole) == whole(answered)
    (skeleton,) = [built for key, built in renders._skeletons.items() if len(key[2]) == len(answered)]
    assert skeleton is not None
    last_slot = max(index for index, _, _ in skeleton.slots)  # (the answer's text is the last value)
    assert skeleton.stripped == ((last_slot, "\n", ""),)
    answered[-1]["content"] = "\nDone."
    assert renders.render(answered, template, False, whole) is None
    assert renders.stats().filled == 2


def test_a_gap_either_pad_could_have_made_counts_both_as_lost() -> None:
    """Between two marks with only a newline between them, a render that kept one newline
    pad could have kept either: both slots count as stripped there."""
    skeleton = Skeleton("", ((0, AS_IS, "\n"), (1, AS_IS, "")))
    bare = [mark.strip("\u2003") for mark in (marked(0), marked(1))]
    assert skeleton.lost_pads("\n" + bare[0] + "\n\n" + bare[1] + "\n", "\n") == [(False, True), (True, False)]
    assert skeleton.lost_pads("\n" + bare[0] + "\n\n\n" + bare[1] + "\n", "\n") == [(False, False), (False, False)]
    assert skeleton.lost_pads(bare[0] + "\n" + bare[1], "\n") == [(True, True), (True, True)]
    assert skeleton.lost_pads(bare[1] + "\n" + bare[0], "\n") is None  # another render's marks
    assert skeleton.lost_pads(bare[0] + "x" + bare[1], "\n") is None


@pytest.mark.parametrize("messages", [5, None, {"role": "user", "content": "hi"}, "hi"])
def test_messages_that_are_no_list_are_the_clients_error(messages: Any) -> None:
    """The skeleton's length check must not turn a malformed request (HTTP 400) into a crash."""
    with pytest.raises(ValueError, match="messages must be a list"):
        RequestTokenizer.default().render_chat(messages)


def test_tools_json_cannot_stand_for_exactly_render_whole() -> None:
    """A subclass of str writes as the same JSON as a str: such tools key no skeleton."""

    class Name(str):
        pass

    odd = [{"type": "function", "function": {"name": Name("f")}}]
    assert tools_key(odd) is None and tools_key(None) == b"" and tools_key([]) == b"[]"
    tokenizer, whole = RequestTokenizer.default(), RequestTokenizer.default()
    whole._skeletons.render = lambda *args: None  # type: ignore[method-assign]
    chat = as_messages([("user", "hi")])
    before = tokenizer.skeleton_stats().filled
    assert tokenizer.render_chat(chat, tools=odd) == whole.render_chat(chat, tools=odd)
    assert tokenizer.skeleton_stats().filled == before


@pytest.mark.parametrize("depth", [1_000, 5_000])
def test_arguments_nested_past_what_json_writes_render_whole(depth: int) -> None:
    """Such arguments fill no skeleton: the whole render refuses them (the client's error),
    where writing them here would raise out of the scan."""
    template = ChatTemplate.from_source(ALL_TEMPLATES["qwen3_coder"])
    arguments = '{"a": ' + "[" * depth + "]" * depth + "}"  # (printed through tojson by the template)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert SkeletonRenders().render(chat, template, True, render_whole(template)) is None
    with pytest.raises((ChatTemplateError, ValueError)):
        render_whole(template)(chat)
