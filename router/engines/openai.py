"""The OpenAI-compatible endpoints, as vLLM, SGLang and other OpenAI servers serve them.

Each engine module lists the ones it serves. Prompts: a chat is rendered with the
model's chat template (vLLM, and SGLang unless ``--chat-template`` names one of its
built-in conversation templates), a completion's ``prompt`` is text or token ids (a
batch routes by its first prompt), a Responses request is the chat vLLM makes of it
(:mod:`kvroute.router.engines.responses_input`). The body schemas are what the router
reads; the rest passes through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvroute.router.engines.base import Endpoint
from kvroute.router.engines.responses_input import responses_chat
from kvroute.router.engines.usage import OPENAI_USAGE
from kvroute.tokenizer_index import RequestTokenizer

MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "examples": ["system", "user", "assistant", "tool"]},
        "content": {"type": ["string", "array", "null"]},
        "name": {"type": "string"},
    },
}
_STREAM_FIELDS: dict[str, Any] = {
    "stream": {"type": ["boolean", "null"], "description": "Answer as server-sent events."},
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": {"type": "boolean"}},
    },
}
_GENERATION_FIELDS: dict[str, Any] = {
    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 0},
    "temperature": {"type": ["number", "null"], "minimum": 0},
    "user": {"type": "string", "description": "A session key for sticky routing."},
    "cache_salt": {"type": "string", "description": "Isolates this request's prefix cache (vLLM, SGLang)."},
}


def template_keywords(body: Mapping[str, Any], effort: Any) -> dict[str, Any] | None:
    """The request's ``chat_template_kwargs`` with its reasoning effort, as vLLM 0.32 hands
    them to the template: ``reasoning_effort`` (over the request's own keyword) and, unless
    the request sets it, ``enable_thinking``, false only for the effort ``"none"``. An
    absent effort (or ``"auto"``) adds nothing."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    if isinstance(effort, str) and effort not in ("", "auto"):
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        kwargs["reasoning_effort"] = effort
    return kwargs or None


def chat_prompt(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> np.ndarray | None:
    """The rendered chat's token ids, with the options the engines pass to the template (and
    the template the request brings, which the routing engine lets through only when told
    that the engines trust it)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    template = body.get("chat_template")
    return tokenizer.encode_chat_array(
        messages,
        tools=body.get("tools") or None,
        add_generation_prompt=body.get("add_generation_prompt", True) is not False,
        chat_template_kwargs=template_keywords(body, body.get("reasoning_effort")),
        documents=body.get("documents"),
        continue_final_message=body.get("continue_final_message") is True,
        chat_template=template if isinstance(template, str) else None,
    )


def responses_prompt(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> np.ndarray | None:
    """A Responses request's token ids: the chat vLLM renders for it
    (:mod:`kvroute.router.engines.responses_input`); None with history the engine stored."""
    chat = responses_chat(body)
    if chat is None:
        return None
    reasoning = body.get("reasoning")
    return converted_chat_prompt(
        tokenizer,
        body,
        chat.messages,
        chat.tools,
        effort=reasoning.get("effort") if isinstance(reasoning, dict) else None,
        continue_final_message=chat.continue_final_message,
    )


def converted_chat_prompt(
    tokenizer: RequestTokenizer,
    body: Mapping[str, Any],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    effort: Any = None,
    continue_final_message: bool = False,
) -> np.ndarray:
    """The token ids of the chat another API's request became (Responses, Anthropic
    Messages), rendered with the request's ``chat_template_kwargs`` and reasoning effort
    (:func:`template_keywords`)."""
    return tokenizer.encode_chat_array(
        messages,
        tools=tools,
        add_generation_prompt=not continue_final_message,
        chat_template_kwargs=template_keywords(body, effort),
        continue_final_message=continue_final_message,
    )


def completion_prompt(tokenizer: RequestTokenizer, body: Mapping[str, Any]) -> np.ndarray | None:
    """A completion's ``prompt``: text or token ids; of a batch, the first."""
    return tokenizer.encode_prompt_array(body["prompt"]) if "prompt" in body else None


CHAT = Endpoint(
    "/v1/chat/completions",
    "chat",
    True,
    OPENAI_USAGE,
    True,
    chat_prompt,
    {
        "required": ["model", "messages"],
        "properties": {"messages": {"type": "array", "items": MESSAGE_SCHEMA}, **_STREAM_FIELDS, **_GENERATION_FIELDS},
    },
)
COMPLETIONS = Endpoint(
    "/v1/completions",
    "completions",
    True,
    OPENAI_USAGE,
    True,
    completion_prompt,
    {
        "required": ["model", "prompt"],
        "properties": {"prompt": {"type": ["string", "array"]}, **_STREAM_FIELDS, **_GENERATION_FIELDS},
    },
)
EMBEDDINGS = Endpoint(
    "/v1/embeddings",
    "embeddings",
    True,
    OPENAI_USAGE,
    False,
    None,
    {
        "required": ["model", "input"],
        "properties": {"input": {"type": ["string", "array"]}, "encoding_format": {"type": "string"}},
    },
)
RESPONSES = Endpoint(
    "/v1/responses",
    "responses",
    True,
    OPENAI_USAGE,
    False,
    responses_prompt,
    {
        "required": ["model", "input"],
        "properties": {
            "input": {"type": ["string", "array"]},
            "stream": {"type": ["boolean", "null"]},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 0},
        },
    },
)


#: A stored response's own calls, ``/v1/responses/{response_id}`` and below it: vLLM 0.32
#: serves ``GET`` (``?stream=true&starting_after=N`` resumes a background stream) and
#: ``POST .../cancel``; OpenAI's API also ``DELETE`` and ``GET .../input_items``. They go to
#: the replica that stored the response. ``path`` is the one that names the engines serving
#: them (those serving ``/v1/responses``); the request goes upstream under its own path.
RESPONSE_LOOKUP = Endpoint("/v1/responses", "responses_stored", False, None, False)
#: Those calls' routes: (method, path pattern, OpenAPI operation id).
STORED_RESPONSE_ROUTES = (
    ("GET", "/v1/responses/{response_id}", "responses_retrieve"),
    ("DELETE", "/v1/responses/{response_id}", "responses_delete"),
    ("POST", "/v1/responses/{response_id}/cancel", "responses_cancel"),
    ("GET", "/v1/responses/{response_id}/input_items", "responses_input_items"),
)


def continued_response(path: str, body: Mapping[str, Any]) -> str | None:
    """The stored response a ``/v1/responses`` request continues (``previous_response_id``)."""
    if path != RESPONSES.path:
        return None
    previous = body.get("previous_response_id")
    return previous if isinstance(previous, str) else None
