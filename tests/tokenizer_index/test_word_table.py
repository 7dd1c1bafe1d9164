"""The compiled word table: exact through new words, growth, and a table that fills.

Words get ids of their own (``word_fixtures.Registry``), so the ids spell out the cut."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.tokenizer_index.word_split import _GPT2_PATTERN, _cut, _isolated, ascii_pattern
from tests.tokenizer_index.test_word_split import ASCII_TEXT
from tests.tokenizer_index.tokenizers_fixtures import DEEPSEEK_V3_PATTERNS
from tests.tokenizer_index.word_fixtures import Registry, word_table

GPT2_ASCII = re.compile(ascii_pattern(_GPT2_PATTERN) or "")


def test_a_table_that_fills_starts_afresh_and_stays_exact() -> None:
    pattern = GPT2_ASCII
    registry = Registry()
    table = word_table(pattern, registry, max_words=600)
    for round_ in range(40):
        text = " ".join(f"w{round_}x{number} longerwordnumber{number}" for number in range(20)) + "\n\n"
        assert table.ids([text])[0].tolist() == registry.expected(pattern, text)
        assert len(table) <= 600
    assert table.find(" longerwordnumber") == registry.ids[" longerwordnumber"]  # past 8 bytes: in the arena
    assert table.find(" never") is None


def test_slots_and_arenas_grow() -> None:
    pattern = GPT2_ASCII
    registry = Registry()
    table = word_table(pattern, registry)
    texts = [
        " ".join(f"word{number}abcdefgh{number * 7}" for number in range(start, start + 500)) for start in (0, 500)
    ]
    before = table.nbytes
    assert [ids.tolist() for ids in table.ids(texts)] == [registry.expected(pattern, text) for text in texts]
    assert len(table) >= 1000 and table.nbytes > before
    assert [ids.tolist() for ids in table.ids(texts)] == [registry.expected(pattern, text) for text in texts]


def test_one_call_is_bounded_by_theword_table() -> None:
    table = word_table(re.compile(r"\w+|\W"), Registry(), max_words=10)
    with pytest.raises(ValueError, match="at most 10"):
        table.ids(["a" * 11])


def test_texts_beyond_ascii_past_the_bound_in_bytes_are_left_to_python() -> None:
    """Characters bound the callers (``tokenizer.WORD_SPLIT_MAX_CHARS``); beyond ASCII a
    character takes up to 4 bytes, so such texts past the table's bound in bytes get None."""
    table = word_table(GPT2_ASCII, Registry(), max_words=1000, source=_GPT2_PATTERN)
    assert table.ids(["\u00e9 " * 300]) is not None  # 900 bytes
    assert table.ids(["\u00e9 " * 400]) is None and table.ids(["\u4e2d " * 300]) is None
    with pytest.raises(ValueError, match="at most 1000"):
        table.ids(["e " * 600])


def test_a_word_with_more_ids_than_bytes_is_refused() -> None:
    """The output arrays hold one id per byte of text: a byte-level BPE never has more."""
    table = word_table(re.compile(r"\w+|\W"), Registry())
    with pytest.raises(ValueError, match="more ids than bytes"):
        table.add(["ab"], [[1, 2, 3]])


def test_long_words_fill_the_characters_bound_first() -> None:
    """A client sending a new long run of letters per request: the table starts afresh at
    its characters' bound, long before its count of words."""
    registry = Registry()
    table = word_table(GPT2_ASCII, registry, max_chars=20_000)
    for number in range(30):
        text = f" {'abcdefghij' * 200}{chr(97 + number % 26) * (number + 1)} tail"
        assert table.ids([text])[0].tolist() == registry.expected(GPT2_ASCII, text)
        assert table._chars <= 20_000 and len(table) <= 11  # ten long words at most, and " tail"
    with pytest.raises(ValueError, match="at most 20000"):
        table.ids(["a" * 20_001])


DEEPSEEK_DIGITS, _, DEEPSEEK_WORDS = (re.compile(ascii_pattern(source) or "") for source in DEEPSEEK_V3_PATTERNS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(ASCII_TEXT, min_size=1, max_size=4))
def test_a_split_program_cuts_first(texts: list[str]) -> None:
    """DeepSeek V3's digit runs split off first (an isolating Split), then its words cut in
    each piece, as ``WordSplitter.words`` does with ``re``."""
    registry = Registry()
    table = word_table(DEEPSEEK_WORDS, registry, split=DEEPSEEK_DIGITS)
    words = [
        [word for piece in _isolated(DEEPSEEK_DIGITS, text) for word in _cut(DEEPSEEK_WORDS, piece)] for text in texts
    ]
    expected = [[token for word in text_words for token in registry.encode([word])[0]] for text_words in words]
    for _ in range(2):
        assert [ids.tolist() for ids in table.ids(texts)] == expected
