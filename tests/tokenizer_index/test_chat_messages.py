"""The conversion of OpenAI messages: the parts a fast path stands in for, checked against
what it replaces (the library's ``json.loads``; the general ``Mapping`` path)."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index.chat_messages import conversation_from_request, parse_arguments

_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**40), max_value=10**40) | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)
_NUMBERS = st.from_regex(r"\A-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?\Z")
_TEXTS = st.one_of(
    _VALUES.map(json.dumps),
    _VALUES.map(lambda value: json.dumps(value, ensure_ascii=False)),
    _NUMBERS,
    st.text(alphabet='{}[]":,0123456789.eE-+ \\untrfalsNI\ud800', max_size=12),
    st.sampled_from(['{"a": 1, "a": 2}', '"\\ud800"', "NaN", "-Infinity", "1e400", '"a\nb"', "\ufeff{}", "[1,]"]),
)


def _outcome(parse: Any, text: str) -> str:
    try:
        return repr(parse(text))  # (repr: an int is not a float, -0.0 not 0.0, nan is nan)
    except json.JSONDecodeError:
        return "JSONDecodeError"


@settings(max_examples=1000, deadline=None)
@given(_TEXTS)
def test_parse_arguments_is_json_loads(text: str) -> None:
    assert _outcome(parse_arguments, text) == _outcome(json.loads, text)


@pytest.mark.parametrize(
    "text", ["12345678901234567890", "-9223372036854775809", "[18446744073709551616]", "0.1000000000000000055511151231"]
)
def test_numbers_past_64_bits_stay_exact(text: str) -> None:
    assert repr(parse_arguments(text)) == repr(json.loads(text))


def test_a_mapping_that_is_not_a_dict_converts_like_a_dict() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
    messages = [
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "r"},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]
    proxied = [
        MappingProxyType(
            {**message, "tool_calls": [MappingProxyType({**call, "function": MappingProxyType(call["function"])})]}
        )
        if "tool_calls" in message
        else MappingProxyType(message)
        for message in messages
    ]
    expected = conversation_from_request(messages, "string")
    assert conversation_from_request(proxied, "string") == expected
    assert expected[1] == {
        "thinking": "r",
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "function": {"name": "f", "arguments": {"q": 1}}}],
        "reasoning": "r",
        "reasoning_content": "r",
    }
    assert list(expected[1]) == ["thinking", "role", "content", "tool_calls", "reasoning", "reasoning_content"]
