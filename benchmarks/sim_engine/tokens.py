"""Prompt token ids exactly as the router computes them, and text for generated ids.

Encoding goes through :class:`kvroute.tokenizer_index.RequestTokenizer` (the router's own class:
same chat template rendering, same tokenizer), so the blocks the simulated engine caches
are the blocks the router's index predicts.
"""

from __future__ import annotations

from typing import Any

import jinja2
import numpy as np

from kvroute.tokenizer_index import RequestTokenizer


class TokenizationError(ValueError):
    """The request's prompt or messages cannot be tokenized (a client error)."""


# What RequestTokenizer raises for a malformed request (anything else is a server bug and
# must not be disguised as a 400).
_CLIENT_ERRORS = (ValueError, TypeError, jinja2.TemplateError)


class SimTokenizer:
    """Request -> token ids (router-exact) and token ids -> text."""

    def __init__(self, encoder: RequestTokenizer) -> None:
        self._encoder = encoder
        self.vocab_size: int = encoder.vocab_size
        self.special_ids = frozenset(
            token_id for token_id, added in encoder.backend.get_added_tokens_decoder().items() if added.special
        )

    @classmethod
    def load(cls, path: str | None) -> SimTokenizer:
        """A local Hugging Face tokenizer directory, or the router's offline default."""
        return cls(RequestTokenizer.default() if path is None else RequestTokenizer.from_pretrained(path))

    def encode_chat_body(self, body: dict[str, Any], *, add_generation_prompt: bool | None = None) -> np.ndarray:
        """The prompt of a chat request: its messages through the model's chat template.

        ``add_generation_prompt`` overrides the body's (a generation request passes the value
        validation already read, ``"yes"`` included).
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise TokenizationError("'messages' must be a non-empty list")
        if not all(isinstance(message, dict) for message in messages):
            raise TokenizationError("every message must be an object")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise TokenizationError("'tools' must be a list")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TokenizationError("'chat_template_kwargs' must be an object")
        if add_generation_prompt is None:
            add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise TokenizationError("'add_generation_prompt' must be a boolean")
        try:
            return self._encoder.encode_chat_array(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=kwargs,
            )
        except _CLIENT_ERRORS as exc:
            raise TokenizationError(f"cannot apply the chat template: {exc}") from None

    def encode_prompt(self, prompt: Any) -> np.ndarray:
        """One completion prompt: text or token ids (of a batch, the first; generation encodes each)."""
        if not isinstance(prompt, str | list):
            raise TokenizationError("'prompt' must be a string or a list of token ids")
        try:
            ids = self._encoder.encode_prompt_array(prompt)
        except (*_CLIENT_ERRORS, OverflowError) as exc:
            raise TokenizationError(f"invalid prompt: {exc}") from None
        if len(ids):
            # vLLM's wording, the lowest offending id first.
            lowest, highest = int(ids.min()), int(ids.max())
            if lowest < 0 or highest >= self.vocab_size:
                raise TokenizationError(f"Token id {lowest if lowest < 0 else highest} is out of vocabulary")
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped, as vLLM's detokenizer does)."""
        return self._encoder.decode(token_ids, skip_special_tokens=True)
