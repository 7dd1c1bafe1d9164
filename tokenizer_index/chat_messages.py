"""OpenAI chat requests -> the conversation a chat template sees, as vLLM builds it.

vLLM does not hand the request's messages to the template as they came. For each message it
keeps ``role`` and ``content`` (always present: ``None`` becomes ``""``), ``tool_calls`` and
``reasoning`` for assistants, ``tool_call_id`` for tools, and ``name``; text parts of a list
content are joined with newlines (the ``"string"`` content format) or kept as typed parts (the
``"openai"`` format); tool-call arguments arrive as JSON strings and are parsed to objects.
Tools are dumped from its pydantic models, so a function without a description renders
``"description": null``. transformers then drops keys whose value is ``None`` and aliases the
reasoning fields. This module reproduces those steps, because the rendered text (and so the
token ids) depends on every one of them.

Media parts (images, audio, video) cannot be rendered the way the engine does (it expands
them into feature tokens); they become a placeholder text carrying a hash of their content
(or of the client's ``uuid``), so equal media give equal routing keys and different media
different ones.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from kvroute.tokenizer_index.chat_template import ContentFormat

_TEXT_FIELDS = {  # part type -> the key holding its text
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_MODALITY = {  # part type -> modality
    "image_url": "image",
    "input_image": "image",
    "image_embeds": "image",
    "image_pil": "image",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio_embeds": "audio",
    "video_url": "video",
}


def media_placeholder(modality: str, payload: Any) -> str:
    """A stable text standing for one media item: ``<image:1f0c...>`` (64-bit content hash)."""
    if isinstance(payload, str):
        data = payload.encode("utf-8", "surrogatepass")
    else:
        data = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=repr)
    digest = hashlib.sha256(modality.encode() + b"\0" + data).hexdigest()[:16]
    return f"<{modality}:{digest}>"


def _part_type(part: Mapping[str, Any]) -> str:
    kind = part.get("type")
    if isinstance(kind, str) and kind:
        return kind
    for key in ("image_url", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds", "video_url"):
        if key in part:
            return key
    raise ValueError("content part without a 'type'")


def _media_payload(part: Mapping[str, Any], kind: str) -> Any:
    """What identifies the media item: the client's uuid if given, else its data or URL."""
    uuid = part.get("uuid")
    if uuid is not None:
        return {"uuid": str(uuid)}
    value = part.get(kind)
    if isinstance(value, Mapping) and "url" in value:
        return value["url"]  # image_url / audio_url / video_url objects; 'detail' is ignored
    return value


def _content_parts(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return content
    raise ValueError(f"message content must be a string, a list of parts or null, not {type(content).__name__}")


def _parse_content(content: Any, content_format: ContentFormat) -> str | list[dict[str, Any]]:
    """A message's content in the template's format; media become hashed placeholders."""
    if isinstance(content, str):  # the common case, kept fast
        return content if content_format == "string" else [{"type": "text", "text": content}]
    texts: list[str] = []
    placeholders: list[str] = []
    parts_out: list[dict[str, Any]] = []
    as_parts = content_format == "openai"
    for part in _content_parts(content):
        if isinstance(part, str):
            text: str | None = part
        elif isinstance(part, Mapping):
            kind = _part_type(part)
            if kind in _TEXT_FIELDS:
                text = part.get(_TEXT_FIELDS[kind])
                if text is None:
                    continue  # vLLM skips text parts without text
                if not isinstance(text, str):
                    raise ValueError(f"content part {kind!r} must hold a string")
            elif kind in _MEDIA_MODALITY:
                placeholder = media_placeholder(_MEDIA_MODALITY[kind], _media_payload(part, kind))
                if as_parts:
                    parts_out.append({"type": "text", "text": placeholder})
                else:
                    placeholders.append(placeholder)
                continue
            elif kind == "tool_reference":
                name = part.get("name")
                if as_parts:
                    parts_out.append({"type": "tool_reference", "name": name})
                    continue
                text = name if isinstance(name, str) else None
                if text is None:
                    continue
            else:
                raise ValueError(f"unsupported chat content part type: {kind!r}")
        else:
            raise ValueError(f"content parts must be objects or strings, not {type(part).__name__}")
        assert text is not None  # every branch above that leaves it None continues
        if as_parts:
            parts_out.append({"type": "text", "text": text})
        else:
            texts.append(text)
    if as_parts:
        return parts_out
    # vLLM's layout for text-only templates: media placeholders first, then the text.
    text_prompt = "\n".join(texts)
    if placeholders:
        return "\n".join([*placeholders, text_prompt] if text_prompt else placeholders)
    return text_prompt


#: A run of digits as long as the shortest integer beyond 64 bits: orjson reads such an
#: integer as a float where ``json`` keeps it whole.
_LONG_DIGITS = re.compile("[0-9]{19}")


def parse_arguments(text: str) -> Any:
    """``json.loads(text)``, as vLLM parses a tool call's arguments (``JSONDecodeError``
    where it fails), by orjson where that gives the same value (~7x faster): not for
    integers past 64 bits, nor NaN, infinities or lone surrogates, which orjson refuses."""
    if _LONG_DIGITS.search(text) is None:
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    try:
        return json.loads(text)
    except RecursionError:  # (orjson refused it first: nested past 1,024)
        raise ValueError("a tool call's arguments are nested too deeply") from None


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """Copies of the tool calls with JSON-string arguments parsed (invalid JSON -> {})."""
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    parsed: list[dict[str, Any]] = []
    for call in calls:
        # (``type() is dict`` first: an ABC's instance check costs ~0.4 us.)
        if not (type(call) is dict or isinstance(call, Mapping)):
            raise ValueError("each tool call needs a 'function' object")
        function = call.get("function")
        if not (type(function) is dict or isinstance(function, Mapping)):
            raise ValueError("each tool call needs a 'function' object")
        function = dict(function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = parse_arguments(arguments)
            except json.JSONDecodeError:
                function["arguments"] = {}
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
        parsed.append({**call, "function": function})
    return parsed


def _conversation_message(message: Any, content_format: ContentFormat) -> dict[str, Any]:
    if not (type(message) is dict or isinstance(message, Mapping)):
        raise ValueError(f"each message must be an object, not {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError("each message needs a string 'role'")
    content = message.get("content")
    if type(content) is not str or content_format != "string":
        content = _parse_content(content, content_format)
        if role == "tool" and isinstance(content, list) and all(part.get("type") == "text" for part in content):
            content = "\n".join(part["text"] for part in content)  # most templates read tool output as text
    result: dict[str, Any] = {"role": role, "content": content}
    # transformers drops keys whose value is None (none is added) and exposes the
    # reasoning under every name templates read.
    reasoning = None
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            calls = _tool_calls(calls)
            if calls:  # an empty list would steer templates off the plain assistant path
                result["tool_calls"] = calls
        reasoning = message.get("reasoning")
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None:
            result["tool_call_id"] = call_id
    name = message.get("name")
    if isinstance(name, str):
        result["name"] = name
    task = message.get("task")
    if isinstance(task, str):
        result["task"] = task
    if role == "developer" and message.get("tools") is not None:
        result["tools"] = message["tools"]
    if reasoning is not None:
        return {"thinking": reasoning, **result, "reasoning_content": reasoning}
    return result


def conversation_from_request(messages: Sequence[Any], content_format: ContentFormat) -> list[dict[str, Any]]:
    """The conversation vLLM renders for these OpenAI messages (fresh dicts; input untouched).

    Raises ``ValueError`` for malformed messages (the client's error: HTTP 400).
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_conversation_message(message, content_format) for message in messages]


def tools_from_request(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """The tools as vLLM dumps them from its pydantic models.

    ``{"type": "function", "function": {"name", "description", "parameters", ...extras}}`` with
    ``None`` for a missing description or parameters; unknown fields are kept after the known
    ones (vLLM's models allow extra fields).
    """
    if tools is None:
        return None
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise ValueError("tools must be a list")
    dumped: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ValueError("each tool needs a 'function' object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise ValueError(f"unsupported tool type: {kind!r}")
        function = tool["function"]
        if not isinstance(function.get("name"), str):
            raise ValueError("each tool function needs a string 'name'")
        function_dump = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
            **{key: value for key, value in function.items() if key not in ("name", "description", "parameters")},
        }
        extras = {key: value for key, value in tool.items() if key not in ("type", "function")}
        dumped.append({"type": "function", "function": function_dump, **extras})
    return dumped
