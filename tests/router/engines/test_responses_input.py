"""responses_input: a /v1/responses body as the chat vLLM renders for it.

Token-for-token agreement with real vLLM is the e2e tier's
(``test_agent_requests_are_tokenized_as_vllm_renders_them``); these pin the conversion."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.router.engines.openai import RESPONSES
from kvroute.router.engines.responses_input import ResponsesChat, responses_chat
from kvroute.tokenizer_index import RequestTokenizer

CALL = {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"word": "x"}'}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}


def chat_of(**body: Any) -> ResponsesChat:
    chat = responses_chat(body)
    assert chat is not None
    return chat


def test_instructions_and_a_string_input_are_a_system_and_a_user_message() -> None:
    chat = chat_of(input="hi", instructions="be brief")
    assert chat == ResponsesChat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], None, False
    )
    assert chat_of(input="hi").messages == [{"role": "user", "content": "hi"}]


def test_items_join_the_assistant_message_before_them() -> None:
    """An answer, its reasoning and its function calls are one assistant message, as vLLM
    builds it; a call's output is a tool message; role messages pass as they are."""
    user = {"role": "user", "content": [{"type": "input_text", "text": "look x up"}]}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "on it"}]}
    reasoning = {"type": "reasoning", "id": "r1", "summary": [{"type": "summary_text", "text": "s"}], "content": []}
    output = {"type": "function_call_output", "call_id": "c1", "output": "a letter"}
    chat = chat_of(input=[user, answer, reasoning, CALL, {**CALL, "call_id": "c2"}, output])
    second = {**TOOL_CALL, "id": "c2"}
    assert chat.messages == [
        user,
        {"role": "assistant", "content": "on it", "reasoning": "s", "tool_calls": [TOOL_CALL, second]},
        {"role": "tool", "content": "a letter", "tool_call_id": "c1"},
    ]
    # A call first opens the assistant message; the answer after it fills its content.
    assert chat_of(input=[user, CALL, {"role": "assistant", "content": "done"}]).messages == [
        user,
        {"role": "assistant", "tool_calls": [TOOL_CALL], "content": "done"},
    ]
    # A second answer is a message of its own.
    assert chat_of(input=[answer, answer]).messages == [{"role": "assistant", "content": "on it"}] * 2


def test_function_tools_take_the_chat_form_and_other_kinds_leave_an_empty_list() -> None:
    tool = {"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object"}}
    nested = {"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}}
    assert chat_of(input="hi", tools=[tool, {"type": "web_search"}]).tools == [nested]
    assert chat_of(input="hi", tools=[{"type": "web_search"}]).tools == []
    assert chat_of(input="hi", tools=[]).tools is None


@pytest.mark.parametrize("status", ["in_progress", "incomplete"])
def test_a_last_answer_in_progress_is_continued(status: str) -> None:
    partial = {
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": "Once"}],
    }
    assert chat_of(input=[{"role": "user", "content": "a story"}, partial]).continue_final_message
    assert not chat_of(
        input=[{"role": "user", "content": "a story"}, {**partial, "status": "completed"}]
    ).continue_final_message


@pytest.mark.parametrize(
    "body",
    [
        {"input": "hi", "previous_response_id": "resp_1"},  # history in the engine's store
        {"input": "hi", "conversation": "conv_1"},
        {"input": [{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "..."}]},
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        {"input": [{**CALL, "namespace": "tools"}]},
        {"input": []},
        {"input": 3},
        {"input": ["not an item"]},
    ],
)
def test_prompts_the_router_cannot_know_route_without_one(body: dict[str, Any]) -> None:
    assert responses_chat(body) is None
    assert RESPONSES.prompt is not None and RESPONSES.prompt(RequestTokenizer.default(), body) is None


def test_the_endpoints_prompt_is_the_chat_rendered() -> None:
    tokenizer = RequestTokenizer.default()
    body = {"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": "hi"}, CALL]}
    assert RESPONSES.prompt is not None
    ids = RESPONSES.prompt(tokenizer, body)
    assert ids is not None
    expected = tokenizer.encode_chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [TOOL_CALL]},
        ]
    )
    assert ids.tolist() == expected
