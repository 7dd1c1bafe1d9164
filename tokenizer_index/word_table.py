"""The ids of words seen before, where compiled code reads them: texts to ids in one call.

:class:`WordTable` keeps each word and its ids in an open-addressing table of fixed-size
slots (a short word and its one or two ids inside its slot, longer ones in two arenas;
the layout is described in :mod:`kvroute.tokenizer_index.kernels`), so
:func:`kvroute.tokenizer_index.kernels.word_ids` cuts texts with a
:class:`~kvroute.tokenizer_index.word_program.WordProgram` and writes their ids without
creating a Python object per word (``word_split.WordSplitter``'s dict costs ~75 ns per
word looked up, ``re`` ~100 ns more to cut it). Words it has not seen it tokenizes and
keeps: with a byte-level BPE inside that same call while the table has room for them
(a request's few new words cost no second call), else after it, growing the table, by the
BPE or the library (one batch per call).

Not thread-safe: the caller holds a lock around :meth:`WordTable.ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import numpy as np

from kvroute.tokenizer_index import kernels
from kvroute.tokenizer_index.bpe_merges import BpeMerges, word_spans
from kvroute.tokenizer_index.word_program import WordProgram

#: Words per slot at most before the slots double (open addressing stays short-probed).
_LOAD = 0.5
_FIRST_SLOTS = 2048
_SLOT_COLUMNS = 4
#: word_ids' BPE arrays where there is no BPE (it learns nothing then).
_NO_BPE = (
    np.zeros(0, dtype=np.int64),
    np.zeros(1, dtype=np.uint64),
    np.zeros(1, dtype=np.int32),
    np.zeros(1, dtype=np.int32),
    np.zeros((1, _SLOT_COLUMNS), dtype=np.uint64),
    np.zeros(0, dtype=np.uint8),
)


@dataclass(frozen=True, slots=True)
class _Lookup:
    """What one :func:`kernels.word_ids` call found."""

    joined: bytes
    text: np.ndarray
    #: The texts' ids one after the other, with a placeholder for each missing word.
    ids: np.ndarray
    #: Where each text's ids end in ``ids``.
    ends: np.ndarray
    #: The (start, end) of each word the table lacks, in order; None when it has them all.
    missing: np.ndarray | None


class WordTable:
    """Words' ids (up to ``max_words`` words of ``max_chars`` UTF-8 bytes in all; past either
    the table starts afresh), for one program (after a ``split`` program, where a
    pre-tokenizer splits text in two steps); ``encode_words`` tokenizes words it lacks
    (each on its own, as the library does), or, for a byte-level BPE model, ``bpe``
    (:mod:`kvroute.tokenizer_index.bpe_merges`) in compiled code."""

    def __init__(
        self,
        program: WordProgram,
        encode_words: Callable[[list[str]], list[list[int]]],
        max_words: int,
        max_chars: int,
        *,
        split: WordProgram | None = None,
        bpe: BpeMerges | None = None,
    ) -> None:
        # What word_ids runs: the split program (or, without one, any program: unread) and
        # whether to run it, then the program.
        self._program = (*(split or program).arrays(), split is not None, *program.arrays())
        self._encode_words = encode_words
        self._bpe = bpe
        self._bpe_arrays = bpe.arrays() if bpe is not None else _NO_BPE
        #: What word_ids may still add: words, bytes, ids (set before each call, counted down).
        self._room = np.zeros(3, dtype=np.int64)
        self._max_words = max_words
        self._max_chars = max_chars
        #: The most bytes one call may bring: its new words always fit a fresh table.
        self._max_call = min(max_words, max_chars)
        #: Words learned by ``bpe`` in compiled code (the others went to ``encode_words``).
        self.bpe_words = 0
        self.clear()

    def __len__(self) -> int:
        return self._words

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes + self._word_bytes.nbytes + self._ids.nbytes

    def ids(self, texts: Sequence[str]) -> list[np.ndarray] | None:
        """The ids of each of ``texts`` (ASCII ones: at most ``max_words`` and ``max_chars``
        bytes in all), word by word; None, having done nothing, if one holds a character the
        programs do not know (any beyond ASCII, unless they were given a marked pattern) or
        texts beyond ASCII pass that bound. Words not in the table are tokenized (by the BPE
        given, else by ``encode_words``) and added: by the BPE in the lookup's own call while
        the table has room for them without growing."""
        found = self._look_up(texts, learn=self._bpe is not None)
        if found is None:
            return None
        out_ids, out_ends = found.ids, found.ends
        if found.missing is not None:
            self._learn_missing(found)
            out_ids = np.empty(len(found.joined), dtype=np.int64)
            kernels.fill_missing(
                found.text, found.ids, found.ends.copy(), found.missing, self._slots, self._word_bytes, self._ids,
                out_ids, out_ends,
            )  # fmt: skip
        ends = out_ends.tolist()
        return [out_ids[start:end] for start, end in zip([0, *ends], ends)]

    def _look_up(self, texts: Sequence[str], *, learn: bool) -> _Lookup | None:
        """One :func:`kernels.word_ids` call over ``texts``: their ids, placeholders where
        the table lacks a word (with ``learn``: one the BPE did not add); None where a
        character is one the programs do not know."""
        wide = not all(text.isascii() for text in texts)  # (isascii reads a flag: O(1))
        lengths: Iterable[int]
        if wide:  # (each text encoded on its own, for where its bytes end)
            encoded = [text.encode("utf-8") for text in texts]
            joined, lengths = b"".join(encoded), map(len, encoded)
        else:
            joined, lengths = "".join(texts).encode("ascii"), map(len, texts)
        if len(joined) > self._max_call:  # (so one call's new words fit, after a clear)
            if wide:  # (a character beyond ASCII takes up to 4 bytes: such texts go to Python)
                return None
            raise ValueError(f"{len(joined)} bytes in one call; at most {self._max_call}")
        text = np.frombuffer(joined, dtype=np.uint8)
        text_ends = np.fromiter(accumulate(lengths), dtype=np.int64, count=len(texts))
        # Byte-level BPE takes at least one byte per id (add() holds every word to it),
        # and a text has at most one word per character: neither array can overflow.
        out_ids = np.empty(len(joined), dtype=np.int64)
        out_ends = np.empty(len(texts), dtype=np.int64)
        missing = np.empty((len(joined), 2), dtype=np.int64)
        room = self._room
        if learn:
            used_bytes, used_ids = self._used.tolist()
            words = min(self._max_words, int(_LOAD * len(self._slots))) - self._words
            chars = min(self._max_chars - self._chars, len(self._word_bytes) - used_bytes)
            room[0], room[1], room[2] = words, chars, len(self._ids) - used_ids
        missed = kernels.word_ids(
            text, text_ends, wide, *self._program, self._slots, self._word_bytes, self._ids,
            learn, *self._bpe_arrays, self._used, room, out_ids, out_ends, missing,
        )  # fmt: skip
        if learn:
            words_left, chars_left, _ = room.tolist()
            if words_left < words:
                self._words += words - words_left
                self._chars += chars - chars_left
                self.bpe_words += words - words_left
        if missed < 0:
            return None
        return _Lookup(joined, text, out_ids, out_ends, missing[:missed] if missed else None)

    def add(self, words: Sequence[str], ids: Sequence[Sequence[int]]) -> None:
        """Remember each of ``words`` (none in the table, each once) with its ids."""
        joined, spans = word_spans([word.encode("utf-8") for word in words])
        self._add(np.frombuffer(joined, dtype=np.uint8), spans, ids)

    def _learn_missing(self, found: _Lookup) -> None:
        """Tokenize and add the words the lookup lacked: by the BPE in compiled code where
        there is one, by ``encode_words`` the rest (words past ``kernels.BPE_MAX_BYTES``)."""
        spans = found.missing
        assert spans is not None
        if self._bpe is not None:
            # Room for every word first (each at most an id per byte, the library's too),
            # so that adding the long ones after cannot start the table afresh.
            chars = int((spans[:, 1] - spans[:, 0]).sum())
            self._make_room(len(spans), chars, chars)
            left = np.empty(len(spans), dtype=np.int64)
            added, added_chars, long_words = kernels.learn_words(
                found.text, spans, *self._bpe.arrays(), self._slots, self._word_bytes, self._ids, self._used, left
            )
            self._words += added
            self._chars += added_chars
            self.bpe_words += added
            spans = spans[left[:long_words]]
        if len(spans):
            self._learn(found.joined, found.text, spans)

    def _learn(self, joined: bytes, text: np.ndarray, spans: np.ndarray) -> None:
        """Tokenize and add the words at ``spans`` of ``text`` (each word once)."""
        first: dict[bytes, int] = {}
        for number, (start, end) in enumerate(spans.tolist()):
            first.setdefault(joined[start:end], number)
        words = [word.decode("utf-8") for word in first]
        self._add(text, spans[list(first.values())], self._encode_words(words))

    def _add(self, text: np.ndarray, spans: np.ndarray, ids: Sequence[Sequence[int]]) -> None:
        """Add the words at ``spans`` of ``text`` (none in the table, each once), with at
        least one id each and at most one per byte, as a byte-level BPE's (:meth:`ids`
        sizes its output so)."""
        lengths = (spans[:, 1] - spans[:, 0]).tolist()
        if any(not 0 < len(word_ids) <= length for word_ids, length in zip(ids, lengths, strict=True)):
            raise ValueError("a word with no ids or more ids than bytes")
        chars = sum(lengths)
        self._make_room(len(lengths), chars, sum(map(len, ids)))
        kernels.add_words(
            text,
            spans,
            np.array(list(chain.from_iterable(ids)), dtype=np.int64),
            np.fromiter(accumulate(map(len, ids)), dtype=np.int64, count=len(ids)),
            self._slots,
            self._word_bytes,
            self._ids,
            self._used,
        )
        self._words += len(lengths)
        self._chars += chars

    def find(self, word: str) -> list[int] | None:
        """The ids of ``word`` (its words, if the program cuts it), if the table has them
        all; nothing is added (for checks and tests)."""
        found = self._look_up([word], learn=False)
        if found is None or found.missing is not None or not word:
            return None
        return found.ids[: found.ends[0]].tolist()  # type: ignore[no-any-return]

    def clear(self) -> None:
        """Forget every word."""
        self._slots = np.zeros((_FIRST_SLOTS, _SLOT_COLUMNS), dtype=np.uint64)
        self._word_bytes = np.zeros(4 * _FIRST_SLOTS, dtype=np.uint8)
        self._ids = np.zeros(_FIRST_SLOTS, dtype=np.int64)
        #: The byte and id arenas' used lengths (updated by the kernel).
        self._used = np.zeros(2, dtype=np.int64)
        self._words = self._chars = 0

    def _make_room(self, words: int, word_bytes: int, ids: int) -> None:
        """Room for this many more words, starting afresh past the table's bounds."""
        if self._words + words > self._max_words or self._chars + word_bytes > self._max_chars:
            self.clear()
        self._reserve(words, word_bytes, ids)

    def _reserve(self, words: int, word_bytes: int, ids: int) -> None:
        """Room for this many more words, bytes and ids (slots moved when they double)."""
        used_bytes, used_ids = self._used.tolist()
        if used_bytes + word_bytes > len(self._word_bytes):
            self._word_bytes = _grown(self._word_bytes, used_bytes + word_bytes)
        if used_ids + ids > len(self._ids):
            self._ids = _grown(self._ids, used_ids + ids)
        needed = self._words + words
        if needed > _LOAD * len(self._slots):
            size = len(self._slots)
            while needed > _LOAD * size:
                size *= 2
            slots = np.zeros((size, _SLOT_COLUMNS), dtype=np.uint64)
            kernels.move_slots(self._slots, slots)
            self._slots = slots


def _grown(array: np.ndarray, needed: int) -> np.ndarray:
    """``array`` copied into one at least twice as long and long enough for ``needed``."""
    grown = np.zeros(max(needed, 2 * len(array)), dtype=array.dtype)
    grown[: len(array)] = array
    return grown
