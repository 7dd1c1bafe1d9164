"""A workload's chat requests sent over another API, and each API's stream read back.

``kvroute bench --wire responses`` sends every chat request as OpenAI's Responses API
(``/v1/responses``: ``instructions``, input items, function calls and their outputs, flat
function tools) and ``--wire messages`` as Anthropic's Messages API (``/v1/messages``, what
Claude Code speaks: a ``system`` field, ``tool_use`` and ``tool_result`` blocks), and
``--wire tokens`` as vLLM's scale-out deployments do: the chat rendered into token ids by
the engine's own renderer (``/v1/chat/completions/render``, through the router), then
generated from them (``/inference/v1/generate``, which the router routes by those ids;
TTFT counts from before the render). Each carries the same conversation, so vLLM renders
the same prompt for it as for the chat: the offline bounds, computed from the chat bodies,
still hold.

:data:`STREAMS` says, per endpoint, which streamed event carries generated text (TTFT) and
where the usage is; the usage readers are the router's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvroute.benchmarks.workloads import CHAT_ENDPOINT, WorkloadRequest
from kvroute.router.engines.anthropic import MESSAGES, anthropic_usage
from kvroute.router.engines.openai import RESPONSES
from kvroute.router.engines.usage import Usage, usage_from_object
from kvroute.router.engines.vllm import GENERATE_TOKENS

RESPONSES_ENDPOINT = RESPONSES.path
MESSAGES_ENDPOINT = MESSAGES.path
TOKENS_ENDPOINT = GENERATE_TOKENS.path
#: Where a request to an endpoint is rendered first; its body is the chat to render.
RENDERED_BY = {TOKENS_ENDPOINT: CHAT_ENDPOINT + "/render"}
#: The APIs a chat request can be sent over (``--wire``).
WIRES = ("chat", "responses", "messages", "tokens")


def on_wire(request: WorkloadRequest, wire: str) -> WorkloadRequest:
    """``request`` as ``wire`` sends it (requests other than chats go as they are)."""
    if wire == "chat" or request.endpoint != CHAT_ENDPOINT:
        return request
    if wire == "responses":
        return replace(request, endpoint=RESPONSES_ENDPOINT, body=responses_body(request.body))
    if wire == "messages":
        return replace(request, endpoint=MESSAGES_ENDPOINT, body=messages_body(request.body))
    if wire == "tokens":
        return replace(request, endpoint=TOKENS_ENDPOINT)  # the chat, rendered at send time
    raise ValueError(f"unknown wire {wire!r}: one of {', '.join(WIRES)}")


def responses_body(chat: Mapping[str, Any]) -> dict[str, Any]:
    """A chat body as a Responses request: a leading system message as ``instructions``,
    answers as output messages, tool calls as function calls, tool messages as their outputs."""
    messages = list(chat["messages"])
    body: dict[str, Any] = {"model": chat["model"], "max_output_tokens": chat.get("max_tokens", 16)}
    if messages and messages[0]["role"] == "system":
        body["instructions"] = messages.pop(0)["content"]
    items: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant":
            if message.get("content"):
                text = {"type": "output_text", "text": message["content"]}
                items.append({"type": "message", "role": "assistant", "content": [text]})
            items += [
                {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
                for call_id, name, arguments in _calls(message)
            ]
        elif role == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
        else:
            items.append({"role": role, "content": message["content"]})
    body["input"] = items
    if chat.get("tools"):
        body["tools"] = [{"type": "function", **tool["function"]} for tool in chat["tools"]]
    return body


def messages_body(chat: Mapping[str, Any]) -> dict[str, Any]:
    """A chat body as an Anthropic Messages request: the system message as ``system``, tool
    calls as ``tool_use`` blocks after the answer's text, tool messages as ``tool_result``
    blocks of the user turn that follows (with that turn's text after them)."""
    body: dict[str, Any] = {"model": chat["model"], "max_tokens": chat.get("max_tokens", 16)}
    turns: list[dict[str, Any]] = []
    for message in chat["messages"]:
        role, content = message["role"], message.get("content")
        if role == "system":
            body["system"] = content
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
            blocks += [
                {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}
                for call_id, name, arguments in _calls(message)
            ]
            turns.append({"role": "assistant", "content": blocks})
        else:
            block = (
                {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": content}
                if role == "tool"
                else {"type": "text", "text": content}
            )
            if turns and turns[-1]["role"] == "user":
                turns[-1]["content"].append(block)
            else:
                turns.append({"role": "user", "content": [block]})
    body["messages"] = turns
    if chat.get("tools"):
        body["tools"] = [
            {"name": f["name"], "description": f.get("description"), "input_schema": f.get("parameters") or {}}
            for f in (tool["function"] for tool in chat["tools"])
        ]
    return body


def _calls(message: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(id, function name, JSON arguments) of an assistant message's tool calls."""
    return [
        (call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in message.get("tool_calls") or ()
    ]


@dataclass(frozen=True, slots=True)
class StreamFormat:
    """How one endpoint's stream says it produced text, and where its usage is."""

    has_text: Callable[[dict[str, Any]], bool]
    usage: Callable[[Any], Usage | None]
    #: Ask for the usage chunk with ``stream_options`` (OpenAI's chat and completions).
    stream_options: bool = False


def _chat_has_text(chunk: dict[str, Any]) -> bool:
    """A chat delta's or a completion's text."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta.get("content") if isinstance(delta, dict) else choice.get("text"):
            return True
    return False


def _responses_has_text(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.output_text.delta" and bool(event.get("delta"))


def _messages_has_text(event: dict[str, Any]) -> bool:
    delta = event.get("delta")
    return event.get("type") == "content_block_delta" and isinstance(delta, dict) and bool(delta.get("text"))


def _tokens_have_text(chunk: dict[str, Any]) -> bool:
    """A token-in generation's chunk with generated ids (or text)."""
    return any(choice.get("token_ids") or choice.get("text") for choice in chunk.get("choices") or ())


CHAT_STREAM = StreamFormat(_chat_has_text, usage_from_object, stream_options=True)
#: Per endpoint; any other is read as a chat's.
STREAMS: dict[str, StreamFormat] = {
    RESPONSES_ENDPOINT: StreamFormat(_responses_has_text, usage_from_object),
    MESSAGES_ENDPOINT: StreamFormat(_messages_has_text, anthropic_usage),
    TOKENS_ENDPOINT: StreamFormat(_tokens_have_text, usage_from_object, stream_options=True),
}


def stream_of(request: WorkloadRequest) -> StreamFormat:
    """How the answer to ``request`` streams."""
    return STREAMS.get(request.endpoint, CHAT_STREAM)


def streaming_body(request: WorkloadRequest, rendered: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``request``'s body (or, for an endpoint in :data:`RENDERED_BY`, what rendering it
    gave) asking for a stream, and for its usage where the API needs asking."""
    body = {**(request.body if rendered is None else rendered), "stream": True}
    if stream_of(request).stream_options:
        body["stream_options"] = {"include_usage": True}
    return body
