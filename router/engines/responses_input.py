"""A ``/v1/responses`` request as the chat vLLM renders for it (models without Harmony).

vLLM turns a Responses request into chat messages before its chat template sees them:
``instructions`` become a system message; a string ``input`` is a user message; input items
become messages, where a ``function_call`` or ``reasoning`` item joins the assistant message
before it, a ``function_call_output`` is a tool message and role messages pass as they are.
Function tools, flat in this API, take the chat API's nested form. A last assistant message
or reasoning item still ``in_progress`` or ``incomplete`` is continued rather than answered.

What the engine adds from its own store (``previous_response_id``, ``conversation``) the
router cannot see, nor item kinds it does not read here: for those there is no prompt
(:func:`responses_chat` returns None) and the request routes by load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Items whose status asks the engine to continue them (vLLM's should_continue_final_message).
_PARTIAL = ("in_progress", "incomplete")


@dataclass(frozen=True, slots=True)
class ResponsesChat:
    """The chat a Responses request renders as: messages, tools in the chat API's form, and
    whether the last message is continued (no generation prompt then)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    continue_final_message: bool


def responses_chat(body: Mapping[str, Any]) -> ResponsesChat | None:
    """The chat vLLM renders for ``body``; None where the prompt holds what the router
    cannot know (history the engine stored) or items it does not convert."""
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        return None
    request_input = body.get("input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
        continued = False
    elif isinstance(request_input, list) and request_input:
        for item in request_input:
            if not isinstance(item, Mapping) or not _append_item(messages, item):
                return None
        continued = _continues(request_input[-1])
    else:
        return None
    tools = _chat_tools(body.get("tools"))
    return ResponsesChat(messages, tools, continued)


def _append_item(messages: list[dict[str, Any]], item: Mapping[str, Any]) -> bool:
    """Add one input item to ``messages`` (or to the assistant message it joins); False for
    an item this module does not convert."""
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        if item.get("namespace"):
            return False  # vLLM flattens namespaced tools' names in its own way
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        if previous is not None:
            previous["tool_calls"] = [*(previous.get("tool_calls") or ()), call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return True
    if kind == "reasoning":
        if item.get("encrypted_content"):
            return False  # vLLM refuses it
        text = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = text
        else:
            messages.append({"role": "assistant", "reasoning": text})
        return True
    if kind == "function_call_output":
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        return True
    role = item.get("role")
    if kind not in (None, "message") or not isinstance(role, str):
        return False
    if role == "assistant":
        content = item.get("content")
        answer = content if isinstance(content, str) else _first_text(content)
        if answer is not None:
            if previous is not None and previous.get("content") is None:
                previous["content"] = answer
            else:
                messages.append({"role": "assistant", "content": answer})
            return True
    messages.append(dict(item))
    return True


def _first_text(parts: Any) -> str | None:
    """The text of the first of a list of content parts (vLLM reads only that one)."""
    if isinstance(parts, Sequence) and not isinstance(parts, str) and parts:
        first = parts[0]
        if isinstance(first, Mapping) and isinstance(first.get("text"), str):
            return first["text"]
    return None


def _continues(last: Any) -> bool:
    """Whether the last input item is an assistant message or reasoning still in progress."""
    return (
        isinstance(last, Mapping)
        and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in _PARTIAL
    )


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The function tools in the chat API's nested form (the others are no template's; tools
    of other kinds only leave an empty list, as in vLLM, which some templates tell from none)."""
    if not isinstance(tools, list) or not tools:
        return None
    return [
        {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}
        for tool in tools
        if isinstance(tool, Mapping) and tool.get("type") == "function"
    ]
