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

    def encode_chat_body(self, body: dict[str, Any], *, add_generation_prompt: bool) -> np.ndarray:
        """The prompt of a validated chat request: its messages through the model's chat template.

        Validation has typed the body's fields; ``add_generation_prompt`` is the value it read
        (``"yes"`` included).
        """
        try:
            return self._encoder.encode_chat_array(
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
        except _CLIENT_ERRORS as exc:
            raise TokenizationError(f"cannot apply the chat template: {exc}") from None

    def encode_prompt(self, prompt: str | list[int]) -> np.ndarray:
        """One validated completion prompt: text or token ids (of a batch, the first; generation encodes each)."""
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
