"""Helpers for the compiled word cutter's tests: words given ids of their own."""

from __future__ import annotations

import re

import regex

from kvroute.tokenizer_index.word_program import MarkedPattern, word_program
from kvroute.tokenizer_index.word_split import _agreed_code_points, _cut, marked_pattern
from kvroute.tokenizer_index.word_table import WordTable


class Registry:
    """Gives each new word ids of its own: one, or, for words of some lengths, several (so
    the table's words with ids beyond its slots' two are exercised), never more than its
    bytes (as a byte-level BPE)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}

    def encode(self, words: list[str]) -> list[list[int]]:
        for word in words:
            if word not in self.ids:
                number = len(self.ids) + 1
                self.ids[word] = [number] * min(len(word), 1 + len(word) % 4)
        return [self.ids[word] for word in words]

    def expected(self, pattern: re.Pattern[str] | regex.Pattern[str], text: str) -> list[int]:
        return [token for word in (_cut(pattern, text) if text else []) for token in self.encode([word])[0]]


def word_table(
    pattern: re.Pattern[str],
    registry: Registry,
    max_words: int = 1 << 17,
    max_chars: int = 1 << 22,
    split: re.Pattern[str] | None = None,
    *,
    source: str | None = None,
) -> WordTable:
    """A table for ``pattern``'s program (after ``split``'s), its words' ids from ``registry``;
    with ``source`` (the tokenizer's pattern ``pattern`` translates), text beyond ASCII too."""
    program = word_program(pattern, marked(source) if source is not None else None)
    split_program = word_program(split) if split is not None else None
    assert program is not None and (split is None or split_program is not None)
    return WordTable(program, registry.encode, max_words, max_chars, split=split_program)


def marked(source: str) -> MarkedPattern:
    """A tokenizer's pattern marked for the compiled cutter, as ``WordSplitter`` builds it."""
    translated = marked_pattern(source)
    assert translated is not None
    return MarkedPattern(re.compile(translated[0]), translated[1], _agreed_code_points())
