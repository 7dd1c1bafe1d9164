"""A byte-level BPE model's merges as arrays compiled code runs: new words without the library.

A word the word table (:mod:`kvroute.tokenizer_index.word_table`) has not seen went to the
tokenizers library: ~7 us for one short word, and ~15 us of Python around the call, paid
by nearly every request (a new number, name or identifier). A byte-level BPE's answer for
one word is simple enough to compute where the table is: the word's bytes are ids (GPT-2's
byte-to-character map, then the vocabulary), then the adjacent pair of lowest merge rank
is merged, the leftmost of equals, until no pair has a merge. That is the order in which
the library pops its heap of merges (rank, then position), so the ids are the library's;
tested against it (``tests/tokenizer_index/test_bpe_merges.py``), and each tokenizer's
table is checked on probe words when it is built (:meth:`BpeMerges.agrees`).

Only for models that are exactly that: BPE with no dropout, unknown token, byte fallback,
subword prefix or suffix, every byte in the vocabulary. A model with ``ignore_merges``
(Llama 3's) gives a word the vocabulary holds whole its one id before any merge: its
vocabulary is kept in a word table's slots too, looked up first. Words of more than
``kernels.BPE_MAX_BYTES`` bytes stay with the library (each merge step reads every pair).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import accumulate, pairwise
from typing import Any

import numpy as np

from kvroute.tokenizer_index import kernels

#: Open-addressing tables are at most this full (probes stay short).
_LOAD = 0.7
#: Vocabulary tokens in the probe texts, and per text.
_PROBE_TOKENS = 600
_TOKENS_PER_PROBE = 24


@cache
def byte_characters() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: the character that stands for each byte (printable
    Latin-1 bytes for themselves, the others shifted past 255 in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = {byte: chr(byte) for byte in kept}
    shifted = 0
    for byte in range(256):
        if byte not in characters:
            characters[byte] = chr(256 + shifted)
            shifted += 1
    return tuple(characters[byte] for byte in range(256))


def token_bytes(token: str) -> bytes | None:
    """The bytes a byte-level token (a vocabulary entry) stands for; None where one of its
    characters is not of the byte-level alphabet."""
    values = _byte_values()
    try:
        return bytes(values[character] for character in token)
    except KeyError:
        return None


@cache
def _byte_values() -> dict[str, int]:
    return {character: byte for byte, character in enumerate(byte_characters())}


@dataclass(frozen=True, slots=True)
class BpeMerges:
    """``byte_ids[b]``: the id of byte ``b``; ``keys``/``ranks``/``ids``: each merge's pair
    (:func:`kernels._pair_key`), rank and merged id, in an open-addressing table;
    ``whole_slots``/``whole_bytes``: the vocabulary's tokens (their bytes) and ids in a word
    table's layout (``kernels.SLOT_KEY``...) where the model has ``ignore_merges``, else empty."""

    byte_ids: np.ndarray
    keys: np.ndarray
    ranks: np.ndarray
    ids: np.ndarray
    whole_slots: np.ndarray
    whole_bytes: np.ndarray
    #: Texts of the vocabulary's tokens, to check the merges on (:meth:`agrees`).
    probe_texts: tuple[str, ...] = ()

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.byte_ids, self.keys, self.ranks, self.ids, self.whole_slots, self.whole_bytes

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays())

    def encode(self, word: str) -> list[int] | None:
        """The ids of one word (None if empty or past ``kernels.BPE_MAX_BYTES`` bytes)."""
        encoded = self.encode_words([word])
        return None if encoded is None else encoded[0]

    def encode_words(self, words: Sequence[str]) -> list[list[int]] | None:
        """The ids of each of ``words``; None if one is empty or longer than
        ``kernels.BPE_MAX_BYTES`` bytes. By the kernels a word table runs (learn, then fill
        in), on a table of their own: in one call for a short text's new words
        (``word_split``)."""
        encoded = [word.encode("utf-8") for word in words]
        if not all(0 < len(word) <= kernels.BPE_MAX_BYTES for word in encoded):
            return None
        joined, spans = word_spans(encoded)
        text = np.frombuffer(joined, dtype=np.uint8)
        # A table of its own: slots, and an arena of an id per byte (room for every word's).
        slots = np.zeros((_table_size(len(encoded)), 4), dtype=np.uint64)
        word_bytes, ids = np.empty(len(joined), dtype=np.uint8), np.empty(len(joined), dtype=np.int64)
        used, left = np.zeros(2, dtype=np.int64), np.empty(len(encoded), dtype=np.int64)
        kernels.learn_words(text, spans, *self.arrays(), slots, word_bytes, ids, used, left)
        # Each word as a text of one placeholder (-1 - its number), filled in from the table.
        placeholders = np.arange(-1, -len(encoded) - 1, -1, dtype=np.int64)
        ends = np.arange(1, len(encoded) + 1, dtype=np.int64)
        out, out_ends = np.empty(len(joined), dtype=np.int64), np.empty(len(encoded), dtype=np.int64)
        kernels.fill_missing(text, placeholders, ends, spans, slots, word_bytes, ids, out, out_ends)
        flat, bounds = out.tolist(), out_ends.tolist()
        return [flat[start:end] for start, end in pairwise([0, *bounds])]

    def agrees(self, words: Sequence[str], encode_words: Callable[[list[str]], list[list[int]]]) -> bool:
        """Whether these words' ids equal the library's (``encode_words``, each on its own)."""
        words = [word for word in words if 0 < len(word.encode("utf-8")) <= kernels.BPE_MAX_BYTES]
        return self.encode_words(words) == encode_words(words)


def word_spans(words: Sequence[bytes]) -> tuple[bytes, np.ndarray]:
    """``words`` joined, and each one's (start, end) in the join: what the kernels read."""
    ends = list(accumulate(map(len, words)))
    return b"".join(words), np.array(list(pairwise([0, *ends])), dtype=np.int64).reshape(-1, 2)


def bpe_merges(model: Mapping[str, Any] | None) -> BpeMerges | None:
    """The merges of a tokenizer's ``model`` (its tokenizer.json entry), or None where the
    model is not a plain byte-level BPE."""
    if model is None or model.get("type") != "BPE":
        return None
    if any(model.get(option) for option in ("dropout", "unk_token", "byte_fallback")):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    vocab: Mapping[str, int] = model.get("vocab") or {}
    byte_ids = [id_ for id_ in map(vocab.get, byte_characters()) if id_ is not None]
    if len(byte_ids) != 256:
        return None
    lefts: list[int] = []
    rights: list[int] = []
    merged: list[int] = []
    for merge in model.get("merges") or ():
        pair = _pair(merge)
        if pair is None:
            return None
        left, right, both = vocab.get(pair[0]), vocab.get(pair[1]), vocab.get(pair[0] + pair[1])
        if left is None or right is None or both is None:
            return None  # (the library refuses such a model)
        lefts.append(left)
        rights.append(right)
        merged.append(both)
    if max([*byte_ids, *merged], default=0) >= 1 << 31:
        return None
    size = _table_size(len(merged))
    keys = np.zeros(size, dtype=np.uint64)
    ranks = np.zeros(size, dtype=np.int32)
    merged_ids = np.zeros(size, dtype=np.int32)
    kernels.add_merges(
        np.array(lefts, dtype=np.int64), np.array(rights, dtype=np.int64), np.array(merged, dtype=np.int64),
        keys, ranks, merged_ids,
    )  # fmt: skip
    whole = _whole_words(vocab) if model.get("ignore_merges") else None
    if model.get("ignore_merges") and whole is None:
        return None
    whole_slots, whole_bytes = whole or (np.zeros((1, 4), dtype=np.uint64), np.zeros(1, dtype=np.uint8))
    return BpeMerges(
        np.array(byte_ids, dtype=np.int64), keys, ranks, merged_ids, whole_slots, whole_bytes, _probe_texts(vocab)
    )


def _table_size(entries: int) -> int:
    """A power of two at least ``entries / _LOAD``."""
    return 1 << max(4, (int(entries / _LOAD) + 1).bit_length())


def _whole_words(vocab: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The vocabulary's tokens as bytes, with their ids, in a word table's slots and byte
    arena (:func:`kernels.add_words`); None where a token is not byte-level text."""
    words: list[bytes] = []
    word_ids: list[int] = []
    for token, id_ in vocab.items():
        word = token_bytes(token)
        if word is None:
            return None
        if word:  # (no word is empty)
            words.append(word)
            word_ids.append(id_)
    joined, spans = word_spans(words)
    slots = np.zeros((_table_size(len(words)), 4), dtype=np.uint64)
    word_bytes = np.zeros(max(1, len(joined)), dtype=np.uint8)
    used = np.zeros(2, dtype=np.int64)
    ids = np.array(word_ids, dtype=np.int64)
    kernels.add_words(
        np.frombuffer(joined, dtype=np.uint8), spans, ids, np.arange(1, len(ids) + 1, dtype=np.int64),
        slots, word_bytes, np.zeros(1, dtype=np.int64), used,
    )  # fmt: skip
    return slots, word_bytes[: max(1, int(used[0]))].copy()


def _probe_texts(vocab: Mapping[str, int]) -> tuple[str, ...]:
    """About :data:`_PROBE_TOKENS` tokens spread over the vocabulary (merged early and
    late), their bytes as text, :data:`_TOKENS_PER_PROBE` to a text."""
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    texts = []
    for token in tokens[:: max(1, len(tokens) // _PROBE_TOKENS)]:
        raw = token_bytes(token)
        if raw is not None:
            texts.append(raw.decode("utf-8", errors="ignore"))
    return tuple("".join(texts[at : at + _TOKENS_PER_PROBE]) for at in range(0, len(texts), _TOKENS_PER_PROBE))


def _pair(merge: Any) -> tuple[str, str] | None:
    """A merge as tokenizer.json writes it: ``"a b"`` (older files) or ``["a", "b"]``."""
    if isinstance(merge, str):
        parts = merge.split(" ")
        return (parts[0], parts[1]) if len(parts) == 2 else None
    if isinstance(merge, list) and len(merge) == 2 and all(isinstance(part, str) for part in merge):
        return merge[0], merge[1]
    return None
