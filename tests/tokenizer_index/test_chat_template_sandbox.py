"""The chat-template sandbox after its fast paths: loops read as before, nothing unsafe opens."""

from __future__ import annotations

import pytest

from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError

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
