"""Mooncake traces -> token-id prompts with exactly the trace's prefix sharing.

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``
with one hash id per 512-token block of the prompt; two requests whose ``hash_ids`` agree
on their first k entries share their first k*512 prompt tokens (see
``../shared/traces/README.md``). :class:`BlockMapping` turns every hash id into a fixed run of
512 token ids, concatenates a request's runs and cuts the last one to ``input_length``, so
requests sharing k leading hash ids share exactly k*512 leading tokens, whatever tokenizer or
block size the engine uses.

"Exactly" needs care. Two requests that diverge at block k have different ids there, and
their runs must already differ at the first token, else they share k*512+1 tokens. No
function of the id alone can promise that with a vocabulary of a few thousand tokens: in the
conversation trace block 0 has 7,373 different successors, and ids run to 182,789. But the
trace's ids are chained (every id has one parent, its predecessor block), so the mapping
gives each id, at first sight, its rank among its parent's successors as the first token:
siblings differ at token 0 while the parent has at most ``span`` successors (7,373 < 7,700
with the defaults). Tokens 1 and 2 spell the id itself (``id mod span``, ``id // span mod
span``), so runs of distinct ids are distinct; the rest is a counter-based hash (splitmix64)
of (id, position), vectorised, the same on every machine. Ranks depend on the order ids are
first seen, so feed records in trace order (replays do); the same trace prefix then gives
the same prompts everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

#: Tokens per hash id in the Mooncake traces.
TRACE_BLOCK_TOKENS = 512
#: Token ids are drawn from [first_token_id, vocab_size): below first_token_id a byte-level
#: BPE keeps its special tokens and single bytes, which we keep out of prompts.
DEFAULT_VOCAB_SIZE = 8000
DEFAULT_FIRST_TOKEN_ID = 300


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, *, limit: int | None = None) -> list[MooncakeRecord]:
    """The first ``limit`` records (all when None) of a Mooncake JSONL trace."""
    records: list[MooncakeRecord] = []
    with Path(path).open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            try:
                raw = orjson.loads(line)
                records.append(
                    MooncakeRecord(
                        int(raw["timestamp"]),
                        int(raw["input_length"]),
                        int(raw["output_length"]),
                        tuple(int(i) for i in raw["hash_ids"]),
                    )
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace record: {exc}") from exc
    return records


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(counters: np.ndarray) -> np.ndarray:
    """splitmix64's output function over a uint64 array (wrapping arithmetic)."""
    z = counters * _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class BlockMapping:
    """hash id -> a fixed run of ``block_tokens`` token ids in ``[first_token_id, vocab_size)``."""

    __slots__ = ("_rank", "_successors", "block_tokens", "first_token_id", "vocab_size")

    def __init__(
        self,
        *,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        first_token_id: int = DEFAULT_FIRST_TOKEN_ID,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        if vocab_size - first_token_id < 2:
            raise ValueError("vocab_size must exceed first_token_id by at least 2")
        if block_tokens < 3:
            raise ValueError("block_tokens must be at least 3")
        self.vocab_size = vocab_size
        self.first_token_id = first_token_id
        self.block_tokens = block_tokens
        self._rank: dict[int, int] = {}  # id -> rank among its parent's successors
        self._successors: dict[int | None, int] = {}  # parent id -> successors seen

    @property
    def span(self) -> int:
        """How many distinct token ids a run may use."""
        return self.vocab_size - self.first_token_id

    def _ranks(self, hash_ids: tuple[int, ...]) -> list[int]:
        """Each id's sibling rank, assigning ranks to ids seen for the first time."""
        ranks: list[int] = []
        parent: int | None = None
        for hash_id in hash_ids:
            rank = self._rank.get(hash_id)
            if rank is None:
                rank = self._successors.get(parent, 0)
                self._successors[parent] = rank + 1
                self._rank[hash_id] = rank
            ranks.append(rank)
            parent = hash_id
        return ranks

    def runs(self, hash_ids: tuple[int, ...]) -> np.ndarray:
        """The concatenated runs of a request's ids (int64, ``len(hash_ids) * block_tokens``)."""
        ids = np.asarray(hash_ids, dtype=np.uint64)
        positions = np.arange(self.block_tokens, dtype=np.uint64)
        counters = (ids[:, None] * np.uint64(self.block_tokens) + positions[None, :]).ravel()
        span = np.uint64(self.span)
        tokens = (_splitmix64(counters) % span).reshape(len(ids), self.block_tokens)
        tokens[:, 0] = np.asarray(self._ranks(hash_ids), dtype=np.uint64) % span
        tokens[:, 1] = ids % span
        tokens[:, 2] = (ids // span) % span
        return (tokens.astype(np.int64) + self.first_token_id).ravel()

    def prompt_tokens(self, record: MooncakeRecord) -> np.ndarray:
        """The record's prompt: its ids' runs, the last one cut to ``input_length``."""
        if record.input_length > len(record.hash_ids) * self.block_tokens:
            raise ValueError(
                f"input_length {record.input_length} exceeds {len(record.hash_ids)} blocks "
                f"of {self.block_tokens} tokens"
            )
        return self.runs(record.hash_ids)[: record.input_length]
