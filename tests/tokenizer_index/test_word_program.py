"""The compiled word cutter against ``re``: the same words, in the same order (differential),
and the patterns it leaves to ``re``.

Each word is given ids of its own (``word_fixtures.Registry``), so the ids the compiled
table writes spell out where it cut; the expected ids are those of ``re``'s cut
(``word_split._cut``: the matches, and the text between them kept as words)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index.word_program import word_program
from kvroute.tokenizer_index.word_split import _GPT2_PATTERN, ascii_pattern
from tests.tokenizer_index.test_word_split import ASCII_TEXT
from tests.tokenizer_index.tokenizers_fixtures import LLAMA3_PATTERN, O200K_PATTERN, QWEN2_PATTERN
from tests.tokenizer_index.word_fixtures import Registry, word_table

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKENIZER_PATTERNS = {
    "gpt2": _GPT2_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
    "o200k": O200K_PATTERN,
}
# Patterns no tokenizer ships, for what the program runs: positive lookaheads, (?!) and (?=),
# case-insensitive groups inside and outside alternatives, bounded repeats, literals in a row.
OTHER_PATTERNS = {
    "lookahead": r"a(?=b)|[ab]+(?!c)|(?!)x|c(?=)|\s+(?!\S)|\s",
    "case": r"(?i:ab|c)d?|(?i:e)|[0-9]{2,3}|'(?i:s|re)|\d",
    "literal runs": r"abc|ab|a|b{1,2}c?|[^abc]+",
    "optional suffix": r"[a-z]*[A-Z]+(?i:'s|'re|ab|a)?|[ab]+(?:cd|c)?|[^a-z]",
}


@pytest.fixture(scope="module", params=sorted(TOKENIZER_PATTERNS) + sorted(OTHER_PATTERNS))
def pattern(request: pytest.FixtureRequest) -> re.Pattern[str]:
    name = request.param
    source = TOKENIZER_PATTERNS.get(name)
    translated = ascii_pattern(source) if source is not None else OTHER_PATTERNS[name]
    assert translated is not None
    return re.compile(translated)


@SETTINGS
@given(texts=st.lists(ASCII_TEXT, min_size=1, max_size=4))
def test_words_are_res(pattern: re.Pattern[str], texts: list[str]) -> None:
    registry = Registry()
    table = word_table(pattern, registry)
    for _ in range(2):  # first every word is new, then every word is known
        found = [ids.tolist() for ids in table.ids(texts)]
        assert found == [registry.expected(pattern, text) for text in texts]


@pytest.mark.parametrize(
    "source",
    [
        r"a+?|b",  # lazy
        r"(a)|b",  # a capture: findall returns the group
        r"(?<=a)b|a",  # lookbehind
        r"^a|b",  # anchor
        r"a*|b",  # an alternative that matches nothing
        r"a+(?:bc|d)",  # a branch after a repeat of variable length
        r"(?:ab)+",  # a repeated group
        r"(?s:.)",  # a group's other flags
        r"a(?=bc)",  # a lookahead of more than one character
        r"a(?:bc|d)?e",  # an optional group not last
        r"a(?:b+|c)?",  # an optional group of more than fixed strings
    ],
)
def test_patterns_beyond_the_program_stay_with_re(source: str) -> None:
    assert word_program(re.compile(source)) is None
