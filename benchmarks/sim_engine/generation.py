"""What the simulated model "says": deterministic tokens, their text, and embeddings.

Outputs are pseudo-random but reproducible: the same prompt, seed, sample index and
``max_tokens`` give the same completion on every replica. Tokens are drawn only from vocabulary entries that
decode on their own to printable text, so a stream's pieces concatenate to exactly the
detokenized completion and every SSE chunk is valid UTF-8.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import numpy as np
import orjson

EMBEDDING_DIM = 64


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's output function over a uint64 array (wrapping arithmetic)."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class OutputVocabulary:
    """The token ids a simulated completion is made of, with their text pre-decoded."""

    def __init__(self, token_ids: np.ndarray, pieces: list[str], seed: int = 0) -> None:
        if len(token_ids) == 0:
            raise ValueError("the tokenizer has no printable single-token pieces to generate")
        self._ids = token_ids.astype(np.int64)
        self._seed = seed
        self._piece: dict[int, str] = dict(zip(self._ids.tolist(), pieces, strict=True))
        # JSON string literals (quotes included) so stream chunks are built by concatenation.
        self._piece_json: dict[int, bytes] = {token: orjson.dumps(text) for token, text in self._piece.items()}

    @classmethod
    def from_decoder(
        cls,
        decode: Callable[[list[int]], str],
        vocab_size: int,
        excluded_ids: Iterable[int] = (),
        seed: int = 0,
    ) -> OutputVocabulary:
        """Keep the ids whose lone decoding is non-empty printable text (no specials)."""
        excluded = set(excluded_ids)
        ids: list[int] = []
        pieces: list[str] = []
        for token in range(vocab_size):
            if token in excluded:
                continue
            text = decode([token])
            if text and text.isprintable() and "\ufffd" not in text:
                ids.append(token)
                pieces.append(text)
        return cls(np.asarray(ids, dtype=np.int64), pieces, seed)

    def completion(self, prompt: np.ndarray, count: int, sample: int = 0) -> np.ndarray:
        """``count`` token ids determined by the prompt, the seed and the sample's index.

        ``sample`` tells apart the choices of one request (``n > 1``). A counter-mode
        splitmix64 stream (a few vector operations) rather than a numpy ``Generator``,
        whose seeding alone costs more than the rest of a request.
        """
        digest = zlib.crc32(prompt.astype(np.int64, copy=False).tobytes())
        start = np.uint64((((self._seed + sample * 0x9E3779B9) & 0xFFFFFFFF) << 32) | digest)
        counter = np.arange(1, count + 1, dtype=np.uint64)
        return self._ids[_splitmix64(counter * _GOLDEN + start) % np.uint64(len(self._ids))]

    def piece(self, token: int) -> str:
        """The text of one generated token."""
        return self._piece[token]

    def piece_json(self, token: int) -> bytes:
        """The text of one generated token as a JSON string literal."""
        return self._piece_json[token]

    def text(self, tokens: Iterable[int]) -> str:
        """The text of generated tokens (equal to the tokenizer's decoding of them)."""
        piece = self._piece
        return "".join(piece[token] for token in tokens)


class Embedder:
    """A deterministic unit vector per token sequence: the normalised sum of token rows."""

    def __init__(self, vocab_size: int, seed: int = 0, dim: int = EMBEDDING_DIM) -> None:
        rng = np.random.default_rng((seed, 0xE3B))
        self._table = rng.standard_normal((max(vocab_size, 1), dim)).astype(np.float32)

    @property
    def dim(self) -> int:
        return int(self._table.shape[1])

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """Float32 vector of length :attr:`dim` (zeros for an empty input)."""
        if len(tokens) == 0:
            return np.zeros(self.dim, dtype=np.float32)
        rows = self._table[np.asarray(tokens, dtype=np.int64) % len(self._table)]
        vector = rows.sum(axis=0)
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector
