"""The render memo's key of a conversation's messages against their JSON (differential): equal
exactly when the JSON is, continued exactly when the JSON of the first messages is."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index.messages_key import MessagesKey

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Few values, so that equal and nearly equal messages are drawn often: texts ASCII and not,
# and values JSON writes alike in Python (True and 1, 0 and 0.0 and -0.0, null and "null").
scalars = st.sampled_from([None, True, False, 0, 1, 0.0, -0.0, 1.5, "", "a", "null", "true", "é", "’s", "中"])
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=2), max_leaves=4)
message = st.dictionaries(
    st.sampled_from(["role", "content", "name", "tool_calls"]), values, max_size=3
) | st.sampled_from(
    [{"role": "user", "content": "x"}, {"content": "x", "role": "user"}, {"role": "user", "content": None}]
)
messages = st.lists(message | scalars, max_size=4)  # (a message that is no object: the template refuses it)


def _json(value: Any) -> bytes:
    return orjson.dumps(value)


@SETTINGS
@given(first=messages, second=messages)
def test_keys_are_equal_exactly_when_the_json_is(first: list[Any], second: list[Any]) -> None:
    same = _json(first) == _json(second)
    assert (MessagesKey.apart(first) == MessagesKey.apart(second)) == same
    assert (MessagesKey.whole(first) == MessagesKey.whole(second)) == same


@SETTINGS
@given(first=messages.filter(bool), second=messages, more=messages)  # (the memo keeps no empty conversation)
def test_a_key_is_continued_exactly_by_messages_that_start_with_its_own(
    first: list[Any], second: list[Any], more: list[Any]
) -> None:
    for later in (first + more, second + more, second):
        expected = len(later) >= len(first) and _json(later[: len(first)]) == _json(first)
        for make in (MessagesKey.whole, MessagesKey.apart):
            assert make(first).continued_by(make(later)) == expected


def test_contents_beyond_ascii_are_kept_apart_and_compared_as_text() -> None:
    ascii_only = [{"role": "user", "content": "plain"}]
    typeset = [{"role": "user", "content": "it’s"}, {"role": "assistant", "content": None}]
    assert MessagesKey.of(ascii_only).contents is None
    key = MessagesKey.of(typeset)
    assert key.contents == ("it’s", None) and key.json.isascii()
    assert key.like(typeset) == key and MessagesKey.whole(typeset).like(typeset).contents is None
    # Keys made two ways never continue each other.
    assert not MessagesKey.whole(typeset).continued_by(MessagesKey.apart(typeset))
    assert not key.continued_by(MessagesKey.whole(typeset))


def test_messages_json_cannot_stand_for_exactly_are_refused() -> None:
    class Text(str):
        pass

    with pytest.raises(TypeError):
        MessagesKey.apart([{"role": Text("user"), "content": "é"}])
    with pytest.raises(TypeError):
        MessagesKey.whole([{"role": "user", "content": Text("é")}])
    # A content of a str subclass is left in the JSON, which refuses it.
    with pytest.raises(TypeError):
        MessagesKey.apart([{"role": "user", "content": Text("é")}])


def test_a_key_counts_its_contents_against_the_memo() -> None:
    content = "’" * 10_000  # (two bytes a character in Python)
    key = MessagesKey.apart([{"role": "user", "content": content}])
    assert key.nbytes >= len(key.json) + 2 * len(content)
