"""The chat-template sandbox after its fast paths: reads answer as before, nothing unsafe opens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2.ext
import pytest
from jinja2 import Undefined
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from kvroute.tokenizer_index import chat_template
from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError
from tests.paths import REPO

LOOP = (
    "{% for m in messages %}{{ loop.index0 }}{{ '^' if loop.first }}{{ m['content'] }}"
    "{{ '$' if loop.last else ',' }}{% endfor %}"
)
CONVERSATION = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
]


def test_loop_attributes_render() -> None:
    assert ChatTemplate.from_source(LOOP).render(CONVERSATION) == "0^a,1b,2c$"


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{{ loop.__class__.__mro__ }}{% endfor %}",
        "{% for m in messages %}{{ loop._after }}{% endfor %}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_unsafe_access_is_still_refused(source: str) -> None:
    conversation = [dict(message) for message in CONVERSATION]
    try:
        rendered = ChatTemplate.from_source(source).render(conversation)
    except ChatTemplateError:
        return
    # Where the sandbox answers with an undefined value instead, it rendered nothing.
    assert "class" not in rendered and "<" not in rendered and rendered.strip() == ""
    assert conversation == CONVERSATION


def test_template_globals_are_kept() -> None:
    with pytest.raises(ChatTemplateError, match="stop here"):
        ChatTemplate.from_source("{{ raise_exception('stop here') }}").render(CONVERSATION)
    assert ChatTemplate.from_source("{{ strftime_now('%Y') | length }}").render(CONVERSATION) == "4"


# --- the shortcuts answer what the general paths answer ------------------------------------------

GENERAL = ImmutableSandboxedEnvironment()
SANDBOX = chat_template._ENVIRONMENT


def _loop_context() -> LoopContext:
    loop = LoopContext(iter([1, 2]), Undefined, None, 0)
    next(loop)
    return loop


def _attribute_names(obj: object) -> list[str]:
    return sorted({*dir(obj), *dir(type(obj)), "role", "content", "missing", "_private", "__class__"})


def _same(left: Any, right: Any) -> bool:
    if isinstance(left, Undefined) or isinstance(right, Undefined):
        return type(left) is type(right) and str(left._undefined_name) == str(right._undefined_name)
    if callable(left) and not isinstance(left, type):
        # A str's format method comes back wrapped in a fresh formatter each time.
        return type(left) is type(right) and getattr(left, "__name__", None) == getattr(right, "__name__", None)
    return left is right or left == right


@pytest.mark.parametrize(
    "obj",
    [
        {"role": "user", "content": "hi", "keys": "a key that is also a dict method", "items": [1]},
        "a string",
        Namespace(flag=True, index=3, format="{}".format),
        _loop_context(),
    ],
    ids=["dict", "str", "namespace", "loop"],
)
def test_attribute_reads_match_the_general_sandbox(obj: object) -> None:
    for name in _attribute_names(obj):
        assert _same(SANDBOX.getattr(obj, name), GENERAL.getattr(obj, name)), name
        try:
            value = getattr(obj, name)
        except AttributeError:
            continue
        assert SANDBOX.is_safe_attribute(obj, name, value) == GENERAL.is_safe_attribute(obj, name, value), name


TEMPLATES = sorted((REPO / "benchmarks" / "templates").glob("*.jinja"))
AGENT_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Find the file."},
    {
        "role": "assistant",
        "content": "<think>\nlook first\n</think>\n\nSearching.",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "found x"},
    {"role": "tool", "tool_call_id": "c2", "content": "<tool_response>y</tool_response>"},
    {"role": "assistant", "content": "Done.", "reasoning_content": "easy"},
    {"role": "user", "content": "Thanks."},
]
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("path", TEMPLATES, ids=[path.stem for path in TEMPLATES])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["chat", "tools"])
def test_templates_render_as_under_the_general_sandbox(path: Path, tools: list[dict[str, Any]] | None) -> None:
    source = path.read_text()
    general = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], undefined=SANDBOX.undefined
    )
    general.filters["tojson"] = SANDBOX.filters["tojson"]
    general.globals.update(SANDBOX.globals)
    for end in range(1, len(AGENT_CHAT) + 1):
        messages = AGENT_CHAT[:end]
        ours = ChatTemplate.from_source(source)
        try:
            expected = general.from_string(source).render(messages=messages, tools=tools, add_generation_prompt=True)
        except jinja2.TemplateError as exc:  # e.g. Llama 3.1 with tools and no user message yet
            with pytest.raises(ChatTemplateError, match=str(exc)[:40]):
                ours.render([dict(m) for m in messages], tools=tools)
            continue
        assert ours.render([dict(m) for m in messages], tools=tools) == expected


@pytest.mark.parametrize(
    "source",
    [
        "{% set ns = namespace(f='{0.__class__.__mro__}'.format) %}{{ ns.f(messages) }}",
        "{{ 'x'.format.__self__.__class__ }}",
        "{% set ns = namespace(x=1) %}{{ ns.__attrs }}",
        "{{ messages[0].__class__.__subclasses__() }}",
    ],
)
def test_shortcuts_keep_the_sandbox_closed(source: str) -> None:
    try:
        rendered = ChatTemplate.from_source(source).render([dict(message) for message in CONVERSATION])
    except ChatTemplateError:
        return
    assert "class" not in rendered and "<" not in rendered
