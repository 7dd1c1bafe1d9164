"""An Anthropic Messages request (``/v1/messages``) as the chat vLLM renders for it.

vLLM serves the Messages API (what Claude Code speaks) by turning each request into a chat
completion (vLLM 0.32, ``AnthropicServingMessages.to_chat_completion_request``):

* ``system`` (text or text blocks, Claude Code's per-request ``x-anthropic-billing-header``
  block dropped) is one system message;
* a message's text blocks are its content (one text block: a string), ``thinking`` blocks
  its reasoning, ``tool_use`` blocks its tool calls (``input`` as ``json.dumps`` writes it),
  images ``image_url`` parts; a user's ``tool_result`` blocks become tool messages placed
  before that user message;
* system messages inside ``messages`` stay where they are, unless the chat template
  refuses a system message after the first turn: then they are merged into the leading
  one (:func:`system_first_only` probes the template as vLLM does);
* tools take the chat API's form (``input_schema`` as ``parameters``).

Requests this module does not convert exactly (tool additions or removals, tool
references, a ``tool_use`` without an id, unknown block kinds) have no prompt here and
route by load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

#: Claude Code's first system block: a per-request hash vLLM drops (it defeats caching).
BILLING_HEADER = "x-anthropic-billing-header"
#: Content blocks vLLM converts, or accepts and leaves out (``redacted_thinking``).
_KNOWN_BLOCKS = frozenset({"text", "image", "thinking", "redacted_thinking", "tool_use", "tool_result"})


class Unconvertible(ValueError):
    """A request this module cannot turn into vLLM's chat exactly."""


@dataclass(frozen=True, slots=True)
class AnthropicChat:
    """The chat a Messages request renders as: messages and tools in the chat API's form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def anthropic_chat(body: Mapping[str, Any], *, merge_inline_system: bool) -> AnthropicChat | None:
    """The chat vLLM renders for ``body``; None where this module cannot tell it exactly.

    ``merge_inline_system``: the template takes system messages only first
    (:func:`system_first_only`), so later ones join the leading system message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(message, Mapping) for message in messages):
        return None
    try:
        chat: list[dict[str, Any]] = []
        _append_system(chat, body.get("system"), messages if merge_inline_system else ())
        for message in messages:
            _append_message(chat, message, merge_inline_system=merge_inline_system)
        return AnthropicChat(chat, _chat_tools(body.get("tools")))
    except (Unconvertible, KeyError, TypeError, AttributeError):
        return None


@lru_cache(maxsize=64)
def system_first_only(template: str) -> bool:
    """Whether a chat template refuses a system message after a user turn, probed as vLLM
    probes it: a plain sandbox renders system, user, system, user; any template error (a
    variable it does not define included) counts as a refusal."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        environment.from_string(template).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _append_system(chat: list[dict[str, Any]], system: Any, inline: Sequence[Mapping[str, Any]]) -> None:
    parts: list[str] = []
    if isinstance(system, str):
        if system:
            parts.append(system)
    elif system:
        parts += _texts(_blocks(system))
    for message in inline:
        if message.get("role") == "system":
            text = _system_text(message)
            if text:
                parts.append(text)
    if parts:
        chat.append({"role": "system", "content": "".join(parts)})


def _system_text(message: Mapping[str, Any]) -> str | None:
    content = message.get("content")
    if isinstance(content, str):
        return None if content.startswith(BILLING_HEADER) else content
    texts = _texts(_blocks(content))
    return "".join(texts) if texts else None


def _texts(blocks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The texts of a system prompt's text blocks, but the billing header's."""
    return [
        block["text"]
        for block in blocks
        if block.get("type") == "text" and block.get("text") and not block["text"].startswith(BILLING_HEADER)
    ]


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    """Content blocks (vLLM's request model takes a string or a list of blocks)."""
    if not isinstance(content, list) or not all(isinstance(block, Mapping) for block in content):
        raise Unconvertible("content must be a string or a list of blocks")
    return content


def _append_message(chat: list[dict[str, Any]], message: Mapping[str, Any], *, merge_inline_system: bool) -> None:
    role = message.get("role")
    if role == "system":
        text = None if merge_inline_system else _system_text(message)
        if text:
            chat.append({"role": "system", "content": text})
        return
    converted: dict[str, Any] = {"role": role}
    content = message.get("content")
    if isinstance(content, str):
        converted["content"] = content
    else:
        _convert_blocks(chat, converted, _blocks(content))
    if not (role == "user" and "content" not in converted):
        chat.append(converted)


def _convert_blocks(chat: list[dict[str, Any]], converted: dict[str, Any], blocks: Sequence[Mapping[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind not in _KNOWN_BLOCKS:
            raise Unconvertible(f"content block {kind!r}")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if not block.get("id"):
                raise Unconvertible("a tool_use without an id (vLLM names it by the clock)")
            arguments = json.dumps(block.get("input") or {})
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if converted["role"] == "user":
                _append_tool_result(chat, block)
            else:
                content = block.get("content")
                parts.append({"type": "text", "text": f"Tool result: {str(content) if content else ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        converted["content"] = parts[0]["text"]
    elif parts:
        converted["content"] = parts


def _append_tool_result(chat: list[dict[str, Any]], block: Mapping[str, Any]) -> None:
    """A user's tool result: a tool message with its texts (and a user message with its
    images after it), as vLLM places them, before the user message that carried it."""
    content = block.get("content")
    text = ""
    images: list[str] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(item.get("text", ""))
            elif item.get("type") == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif item.get("type") == "tool_reference":
                raise Unconvertible("tool references")
        text = "\n".join(texts)
    chat.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text or ""})
    if images:
        chat.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools in the chat API's form: ``strict`` and ``defer_loading`` only when set,
    as vLLM's function definitions dump them."""
    if tools is None:
        return None
    converted = []
    for tool in tools:
        function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool["input_schema"]}
        for key in ("strict", "defer_loading"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        converted.append({"type": "function", "function": function})
    return converted
