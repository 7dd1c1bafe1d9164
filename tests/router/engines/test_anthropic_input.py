"""anthropic_input: a /v1/messages body as the chat vLLM renders for it.

Token-for-token agreement with real vLLM is the e2e tier's
(``test_claude_code_requests_are_tokenized_as_vllm_renders_them``); these pin the
conversion, vLLM 0.32's ``to_chat_completion_request``."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.router.engines.anthropic_input import AnthropicChat, anthropic_chat, system_first_only

BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=0f3a"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "x", "n": 1}}
CALL = {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x", "n": 1}'}}
#: Qwen-style: a system message anywhere but first is an error.
SYSTEM_FIRST = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


def chat_of(merge: bool = False, **body: Any) -> AnthropicChat:
    chat = anthropic_chat(body, merge_inline_system=merge)
    assert chat is not None
    return chat


def test_the_system_prompt_is_one_message_without_the_billing_block() -> None:
    """Claude Code's first system block carries a per-request hash: vLLM drops it, or no
    two requests would share a prefix."""
    chat = chat_of(
        system=[BILLING, {"type": "text", "text": "You help. "}, {"type": "text", "text": "Be brief."}], messages=[]
    )
    assert chat.messages == [{"role": "system", "content": "You help. Be brief."}]
    assert chat_of(system="You help.", messages=[{"role": "user", "content": "hi"}]).messages == [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "hi"},
    ]


def test_an_assistant_turn_and_the_tool_result_after_it() -> None:
    """Thinking is the reasoning, one text block the content, tool uses the calls (input as
    json.dumps writes it); a user's tool result is a tool message before that user's text."""
    answer = [{"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "Looking."}, USE]
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    chat = chat_of(
        messages=[
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [result, {"type": "text", "text": "thanks"}]},
        ]
    )
    assert chat.messages == [
        {"role": "assistant", "reasoning": "hmm", "tool_calls": [CALL], "content": "Looking."},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a\nb"},
        {"role": "user", "content": "thanks"},
    ]
    # A user turn of tool results alone leaves no user message.
    only = chat_of(messages=[{"role": "user", "content": [{**result, "content": "done"}]}])
    assert only.messages == [{"role": "tool", "tool_call_id": "toolu_1", "content": "done"}]
    # Several text blocks stay parts; images become image_url parts.
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    parts = chat_of(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]).messages[0][
        "content"
    ]
    assert parts == [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]


def test_inline_system_messages_stay_or_merge_as_the_template_demands() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": "go"},
    ]
    kept = chat_of(system="S. ", messages=messages).messages
    assert [message["role"] for message in kept] == ["system", "user", "system", "user"]
    merged = chat_of(True, system="S. ", messages=messages).messages
    assert merged == [
        {"role": "system", "content": "S. be terse"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "go"},
    ]
    assert system_first_only(SYSTEM_FIRST)
    assert not system_first_only("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    # As in vLLM's probe, a template that needs what the probe does not define counts too.
    assert system_first_only("{{ strftime_now('%d') }}{% for m in messages %}{{ m.content }}{% endfor %}")


def test_tools_take_the_chat_form() -> None:
    tool = {"name": "lookup", "description": "d", "input_schema": {"type": "object"}}
    chat = chat_of(messages=[], tools=[tool, {**tool, "name": "strict", "strict": True}])
    assert chat.tools == [
        {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}},
        {
            "type": "function",
            "function": {"name": "strict", "description": "d", "parameters": {"type": "object"}, "strict": True},
        },
    ]
    assert chat_of(messages=[]).tools is None


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": [{**USE, "id": None}]}],  # vLLM names it by the clock
        [{"role": "user", "content": [{"type": "tool_addition", "tool": {"name": "x"}}]}],  # changes the tools
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "tool_reference", "tool_name": "x"}],
                    }
                ],
            }
        ],
        [{"role": "user", "content": [{"type": "document", "source": {}}]}],
        [{"role": "user", "content": [3]}],
        "not a list",
    ],
)
def test_what_is_not_converted_exactly_has_no_chat(messages: Any) -> None:
    assert anthropic_chat({"messages": messages}, merge_inline_system=False) is None


def test_malformed_tools_have_no_chat() -> None:
    for tools in ([{"description": "no name"}], ["lookup"], {"name": "x"}):
        assert anthropic_chat({"messages": [], "tools": tools}, merge_inline_system=False) is None
