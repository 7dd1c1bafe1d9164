"""Prompt token ids exactly as the router computes them, and text for generated ids.

Encoding goes through :class:`tokenizer_index.RequestTokenizer` (the router's own class:
same chat template rendering, same tokenizer), so the blocks the simulated engine caches
are the blocks the router's index predicts. Decoding uses the same tokenizer directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from tokenizer_index import RequestTokenizer


class TokenizationError(ValueError):
    """The request's prompt or messages cannot be tokenized (a client error)."""


_CLIENT_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, jinja2.TemplateError)


class SimTokenizer:
    """Request -> token ids (router-exact) and token ids -> text."""

    def __init__(self, encoder: RequestTokenizer, decoder: Tokenizer) -> None:
        self._encoder = encoder
        self._decoder = decoder
        self.vocab_size = decoder.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            token_id for token_id, added in decoder.get_added_tokens_decoder().items() if added.special
        )

    @classmethod
    def load(cls, path: str | None) -> SimTokenizer:
        """A local Hugging Face tokenizer directory, or the router's offline default."""
        if path is None:
            encoder = RequestTokenizer.default()
            directory = Path(RequestTokenizer.default_path())
        else:
            encoder = RequestTokenizer.from_pretrained(path)
            directory = Path(path)
        return cls(encoder, Tokenizer.from_file(str(directory / "tokenizer.json")))

    def encode_chat_body(self, body: dict[str, Any]) -> list[int]:
        """The prompt of a chat request: its messages through the model's chat template."""
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
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise TokenizationError("'add_generation_prompt' must be a boolean")
        try:
            return list(
                self._encoder.encode_chat(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    chat_template_kwargs=kwargs,
                )
            )
        except _CLIENT_ERRORS as exc:
            raise TokenizationError(f"cannot apply the chat template: {exc}") from None

    def encode_prompt(self, prompt: Any) -> list[int]:
        """A completion prompt: text, token ids, or a batch (its first element)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            # A batch of prompts: the simulator answers the first one, as the router keys it.
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
                raise TokenizationError("a token-id prompt must be a list of integers")
            if any(token < 0 or token >= self.vocab_size for token in prompt):
                raise TokenizationError("token id out of range")
            return list(prompt)
        if not isinstance(prompt, str):
            raise TokenizationError("'prompt' must be a string or a list of token ids")
        try:
            return list(self._encoder.encode_prompt(prompt))
        except _CLIENT_ERRORS as exc:
            raise TokenizationError(f"cannot tokenize the prompt: {exc}") from None

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (special tokens skipped, as vLLM's detokenizer does)."""
        return self._decoder.decode(token_ids, skip_special_tokens=True)
