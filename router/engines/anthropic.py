"""The Anthropic Messages endpoints as vLLM serves them (``/v1/messages``: Claude Code's API).

* Prompt: the chat vLLM makes of the request (:mod:`kvroute.router.engines.anthropic_input`),
  rendered with the model's chat template like any chat.
* Usage: ``usage.input_tokens`` counts only the prompt tokens neither read from nor written
  to the cache: the prompt is their sum with ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens``, and the cached part is ``cache_read_input_tokens``. A
  stream carries it in ``message_start`` and, complete, in its last ``message_delta``.
* ``/v1/messages/count_tokens`` is passed through (no usage, nothing cached).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np

from kvroute.router.engines.anthropic_input import anthropic_chat, system_first_only
from kvroute.router.engines.base import Endpoint
from kvroute.router.engines.openai import converted_chat_prompt, template_keywords
from kvroute.router.engines.usage import Usage, UsageFormat, is_count
from kvroute.router.errors import ANTHROPIC_ERRORS
from kvroute.tokenizer_index import RequestTokenizer

_CONTENT: dict[str, Any] = {"type": ["string", "array"]}
_MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string", "examples": ["user", "assistant"]}, "content": _CONTENT},
}


def messages_prompt(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> np.ndarray | None:
    """A Messages request's token ids: the chat vLLM renders for it; None where the
    conversion cannot tell it exactly."""
    chat = anthropic_chat(body, merge_inline_system=_merges_inline_system(tokenizer))
    if chat is None:
        return None
    return converted_chat_prompt(tokenizer, body, chat.messages, chat.tools, effort=_effort(tokenizer, body))


def _effort(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> str | None:
    """The reasoning effort vLLM gives the chat: ``output_config.effort``, unless thinking is
    disabled, which asks for :func:`disabled_thinking_effort`."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        return disabled_thinking_effort(tokenizer)
    output = body.get("output_config")
    effort = output.get("effort") if isinstance(output, dict) else None
    return effort if isinstance(effort, str) else None


#: Anthropic's efforts (vLLM's AnthropicEffort), for the probe below.
EFFORTS = ("low", "medium", "high", "xhigh", "max")


@lru_cache(maxsize=16)
def disabled_thinking_effort(tokenizer: RequestTokenizer) -> str:
    """The effort vLLM asks for when a request disables thinking (its ``auto`` choice):
    ``none``, unless the template fails on it or renders it as one of the thinking efforts
    (it then ignores it), when ``low``. Probed once per tokenizer, as vLLM probes once."""
    hello = [{"role": "user", "content": "Hi"}]

    def rendered(effort: str) -> str | None:
        keywords = template_keywords({}, effort)
        try:
            return tokenizer.render_chat(hello, chat_template_kwargs=keywords)
        except ValueError:
            return None

    without = rendered("none")
    if without is None or any(rendered(effort) == without for effort in EFFORTS):
        return "low"
    return "none"


@lru_cache(maxsize=16)
def _merges_inline_system(tokenizer: RequestTokenizer) -> bool:
    """Whether vLLM merges inline system messages for this tokenizer's templates: when the
    template for requests without tools or the one with tools takes system messages first
    only (vLLM probes both, once; so does this, per tokenizer)."""
    return any(system_first_only(tokenizer.chat_template(tools=tools).source) for tools in (False, True))


def anthropic_usage(obj: Any) -> Usage | None:
    """The usage of a Messages response, or of its stream's ``message_start`` (under
    ``message``) or ``message_delta`` event."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        message = obj.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if not isinstance(usage, dict):
            return None
    uncached = usage.get("input_tokens")
    read = usage.get("cache_read_input_tokens")
    written = usage.get("cache_creation_input_tokens")
    if not is_count(uncached) or any(value is not None and not is_count(value) for value in (read, written)):
        return None
    return Usage(prompt_tokens=uncached + (read or 0) + (written or 0), cached_tokens=read)


ANTHROPIC_USAGE = UsageFormat(b'"usage"', anthropic_usage)

MESSAGES = Endpoint(
    "/v1/messages",
    "messages",
    True,
    ANTHROPIC_USAGE,
    False,
    messages_prompt,
    {
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            "messages": {"type": "array", "items": _MESSAGE_SCHEMA},
            "system": _CONTENT,
            "max_tokens": {"type": "integer", "minimum": 0},
            "stream": {"type": ["boolean", "null"]},
            "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
        },
    },
    errors=ANTHROPIC_ERRORS,
)
COUNT_TOKENS = Endpoint(
    "/v1/messages/count_tokens",
    "count_tokens",
    True,
    None,
    False,
    None,
    {"required": ["model", "messages"], "properties": {"messages": {"type": "array", "items": _MESSAGE_SCHEMA}}},
    errors=ANTHROPIC_ERRORS,
)
