"""The compiled word cutter against ``re`` (ASCII text) and the ``regex`` module (text beyond
ASCII, where the tokenizer's pattern comes marked): the same words, in the same order
(differential), and the patterns and characters it leaves to Python.

Each word is given ids of its own (``word_fixtures.Registry``), so the ids the compiled
table writes spell out where it cut; the expected ids are those of ``re``'s cut
(``word_split._cut``: the matches, and the text between them kept as words)."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index.kernels import UNKNOWN_COLUMN
from kvroute.tokenizer_index.word_program import word_program
from kvroute.tokenizer_index.word_split import (
    _GPT2_PATTERN,
    _compile_unicode,
    ascii_pattern,
    marked_pattern,
    unicode_pattern,
)
from tests.tokenizer_index.test_word_split import ASCII_TEXT, FRAGMENTS, UNICODE_FRAGMENTS
from tests.tokenizer_index.tokenizers_fixtures import LLAMA3_PATTERN, O200K_PATTERN, QWEN2_PATTERN
from tests.tokenizer_index.word_fixtures import Registry, marked, word_table

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


# Text beyond ASCII a program knows: any character Python's Unicode tables assign below
# U+30000, and the fragments of the word tests (accents composed or not, curly quotes and
# dashes, other scripts, their digits and spaces, case folding in contractions).
WIDE_TEXT = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=("Cn", "Co", "Cs"), max_codepoint=0x2FFFF), max_size=60),
    st.lists(st.sampled_from(FRAGMENTS + UNICODE_FRAGMENTS), max_size=40).map("".join),
)


@pytest.fixture(scope="module", params=sorted(TOKENIZER_PATTERNS))
def tokenizer_pattern(request: pytest.FixtureRequest) -> str:
    return TOKENIZER_PATTERNS[request.param]


@SETTINGS
@given(texts=st.lists(st.one_of(WIDE_TEXT, ASCII_TEXT), min_size=1, max_size=4))
def test_words_beyond_ascii_are_regexs(tokenizer_pattern: str, texts: list[str]) -> None:
    """A tokenizer's pattern, marked: text of any known characters is cut where the
    ``regex`` module cuts it with the same pattern (what ``WordSplitter`` runs in Python)."""
    pattern = re.compile(ascii_pattern(tokenizer_pattern) or "")
    expected_pattern = _compile_unicode(unicode_pattern(tokenizer_pattern) or "")
    registry = Registry()
    table = word_table(pattern, registry, source=tokenizer_pattern)
    for _ in range(2):  # first every word is new, then every word is known
        found = table.ids(texts)
        assert found is not None
        assert [ids.tolist() for ids in found] == [registry.expected(expected_pattern, text) for text in texts]


@pytest.mark.parametrize("character", ["\u0378", "\ue000", "\U00030000", "\U0010fffd"])
def test_characters_a_program_does_not_know_leave_the_text_to_python(character: str) -> None:
    """Unassigned, private use, and past U+30000: the call does nothing and says so."""
    table = word_table(re.compile(ascii_pattern(_GPT2_PATTERN) or ""), Registry(), source=_GPT2_PATTERN)
    assert table.ids(["caf\u00e9 ok", f"a {character} b"]) is None
    assert len(table) == 0
    assert table.ids(["caf\u00e9 ok"]) is not None and len(table) == 2


def test_a_program_without_a_marked_pattern_knows_only_ascii() -> None:
    program = word_program(re.compile(ascii_pattern(_GPT2_PATTERN) or ""))
    assert program is not None and not program.wide and program.matches_ascii
    table = word_table(re.compile(ascii_pattern(_GPT2_PATTERN) or ""), Registry())
    assert table.ids(["caf\u00e9"]) is None
    assert table.ids(["cafe"]) is not None


def test_code_points_that_every_class_treats_alike_share_a_column() -> None:
    """GPT-2's classes (letters, digits, White_Space, and the rest) group every known code
    point beyond ASCII into a few columns: a Latin, a Greek and a Cyrillic letter share one."""
    program = word_program(re.compile(ascii_pattern(_GPT2_PATTERN) or ""), marked(_GPT2_PATTERN))
    assert program is not None and program.wide
    cmap = program.cmap
    assert cmap[ord("\u00e9")] == cmap[ord("\u03a9")] == cmap[ord("\u0436")] != cmap[ord("\u0663")]
    assert cmap[ord("\u00a0")] == cmap[ord("\u3000")] != cmap[ord("\u2019")]
    assert cmap[0x0378] == cmap[0xE000] == UNKNOWN_COLUMN
    assert len(set(cmap[128:].tolist()) - {UNKNOWN_COLUMN}) <= 8


@pytest.mark.parametrize(
    "source",
    [
        r"\d+|\p{L}+",  # \d: other engines read it differently beyond ASCII
        r"[^\P{L}]+",  # a negated property inside a class
        r"\w+",
    ],
)
def test_what_the_marked_translation_cannot_read_it_refuses(source: str) -> None:
    assert marked_pattern(source) is None
