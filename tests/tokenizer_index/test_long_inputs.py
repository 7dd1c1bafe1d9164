"""Long inputs: pieces tokenized in chunks cut between words equal the plain library's ids.

The chunk size is set to a few characters here, so short texts are cut at every space between
two letters: each example checks many cuts, where a real prompt has one per ~500 characters.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

from kvroute.tokenizer_index import RequestTokenizer
from kvroute.tokenizer_index import tokenizer as tokenizer_module
from kvroute.tokenizer_index.tokenizer import CHUNK_CHARS, _cut_at_word_spaces
from tests.tokenizer_index.tokenizers_fixtures import (
    LLAMA3_PATTERN,
    O200K_PATTERN,
    QWEN2_PATTERN,
    regex_split_tokenizer,
    train_tokenizer,
)

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]


def _chunking(tokenizer: Tokenizer, chunk_chars: int = 3) -> RequestTokenizer:
    """A tokenizer that caches nothing, so every piece is tokenized (and chunked) each time."""
    return RequestTokenizer(tokenizer, cache_bytes=0, chunk_chars=chunk_chars)


@pytest.fixture(
    scope="module", params=["default", "byte_level", "llama3", "qwen2", "o200k", "metaspace_always", "metaspace_first"]
)
def chunked(request: pytest.FixtureRequest) -> RequestTokenizer:
    """Pipelines whose pieces may be cut between words (each must say so)."""
    kind = request.param
    if kind == "default":
        tokenizer = RequestTokenizer.default().backend
    elif kind in ("byte_level", "metaspace_always", "metaspace_first"):
        tokenizer = train_tokenizer(kind, CHAT_SPECIALS)
    else:
        pattern = {"llama3": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN, "o200k": O200K_PATTERN}[kind]
        tokenizer = regex_split_tokenizer(pattern, CHAT_SPECIALS, normalizer=normalizers.NFC())
    ours = _chunking(tokenizer)
    assert ours.incremental and ours.chunks_long_pieces
    return ours


WORDS = [
    "the",
    "Router",
    "don't",
    "it's",
    "ABC",
    "naïve",
    "e\u0301",
    "a\u0308\u0304",
    "中文字符",
    "日本語",
    "한국어",
    "ǅ",
    "ʰ",
    "ﬁ",
    "İ",
    "½",
    "Ⅻ",
    "x1",
    "42",
    "3.14",
    "_id",
    "😀",
    "👍🏽",
    '{"k": [1, 2]}',
    "<|im_end|>",
    "<|im_start|>",
    "\u200d",
]
SEPARATORS = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n ", "", ".", ", "]
long_texts = st.lists(
    st.tuples(st.sampled_from(WORDS) | st.text(max_size=5), st.sampled_from(SEPARATORS)), min_size=1, max_size=40
).map(lambda pairs: "".join(word + separator for word, separator in pairs))


@SETTINGS
@given(text=long_texts)
def test_chunked_pieces_equal_whole_text(chunked: RequestTokenizer, text: str) -> None:
    expected = chunked.backend.encode(text, add_special_tokens=False).ids
    array = chunked.encode_text_array(text)
    assert array.dtype == np.int64 and array.tolist() == expected
    assert chunked.encode_text(text) == expected


def test_a_long_document_equals_whole_text(chunked: RequestTokenizer) -> None:
    """Cut at the real size: a ~20K-token document in one piece, many chunks."""
    rng = np.random.default_rng(3)
    vocabulary = ["router", "cache", "prefix", "Engine", "naïve", "block", "tokens", "of", "a", "the"]
    document = " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), 15_000))
    document += "\n\n" + "Zürich café 中文 don't " * 500
    chunks = _cut_at_word_spaces(document, CHUNK_CHARS)
    assert len(chunks) > 20 and "".join(chunks) == document
    default_size = RequestTokenizer(chunked.backend, cache_bytes=0)
    expected = chunked.backend.encode(document, add_special_tokens=False).ids
    assert default_size.encode_text_array(document).tolist() == expected


def test_new_chunks_encoded_slice_by_slice_equal_whole_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """New chunks go to the library a slice at a time (so the event loop gets the GIL
    between slices); slices of 7 chunks, the last one short, join to the whole text's ids."""
    monkeypatch.setattr(tokenizer_module, "ENCODE_SLICE_UNITS", 7)
    rng = np.random.default_rng(8)
    vocabulary = ["router", "cache", "prefix", "Engine", "naïve", "block", "tokens", "中文", "don't", "the"]
    document = " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), 6_000))
    # (Without word splitting: its new text would be tokenized word by word, not by the library.)
    ours = RequestTokenizer(RequestTokenizer.default().backend, cache_bytes=0, word_split=False)
    chunks = _cut_at_word_spaces(document, ours.chunk_chars)
    assert len(chunks) > 50 and len(chunks) % 7
    expected = ours.backend.encode(document, add_special_tokens=False).ids
    assert ours.encode_text_array(document).tolist() == expected
    assert ours.encode_text(document) == expected


@SETTINGS
@given(common=long_texts, tails=st.lists(long_texts, min_size=2, max_size=3))
def test_texts_sharing_a_prefix_reuse_its_chunks_exactly(
    chunked: RequestTokenizer, common: str, tails: list[str]
) -> None:
    """With the cache on, each text is built from chunks other texts left there: every
    one must still equal its own whole-text ids."""
    caching = RequestTokenizer(chunked.backend, chunk_chars=3)
    for tail in tails:
        text = common + tail
        expected = chunked.backend.encode(text, add_special_tokens=False).ids
        assert caching.encode_text_array(text).tolist() == expected
        assert caching.encode_text(text) == expected


def test_a_prompt_repeating_a_long_prefix_tokenizes_only_where_it_parts() -> None:
    """A completions prompt that repeats a ~6,000-character document with a new question
    after it looks the document's chunks up instead of tokenizing them."""
    ours = RequestTokenizer.default()
    rng = np.random.default_rng(5)
    vocabulary = ["router", "cache", "prefix", "Engine", "naïve", "block", "tokens", "of", "a", "the"]
    document = " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), 1_000))
    first, second = document + " what is a block", document + " which engine holds it"
    ours.encode_prompt_array(first)
    before = ours.cache_stats()
    ids = ours.encode_prompt_array(second)
    after = ours.cache_stats()
    assert ids.tolist() == ours.backend.encode(second, add_special_tokens=True).ids
    chunks = len(_cut_at_word_spaces(second, ours.chunk_chars))
    assert chunks >= 3 and after.hits - before.hits >= chunks - 2
    assert after.misses - before.misses <= 2


@given(text=long_texts, size=st.integers(1, 12))
def test_cuts_fall_between_letters_and_keep_every_character(text: str, size: int) -> None:
    chunks = _cut_at_word_spaces(text, size)
    assert "".join(chunks) == text
    for left, right in itertools.pairwise(chunks):
        assert len(left) >= size
        assert left[-1].isalpha() and right[0] == " " and right[1].isalpha()


def _no_pre_tokenizer() -> Tokenizer:
    tokenizer = train_tokenizer("byte_level", CHAT_SPECIALS)
    tokenizer.pre_tokenizer = None
    return tokenizer


def _stripping_normalizer() -> Tokenizer:
    tokenizer = train_tokenizer("byte_level", CHAT_SPECIALS)
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    return tokenizer


def _word_pairs_regex() -> Tokenizer:
    """A Split regex that keeps two words together: only the probes can tell."""
    return regex_split_tokenizer(r"\p{L}+ \p{L}+|\s+|\p{L}+|[^\s\p{L}]+", CHAT_SPECIALS)


def _rstrip_token() -> Tokenizer:
    return train_tokenizer("byte_level", CHAT_SPECIALS, [AddedToken("stop", rstrip=True, normalized=False)])


def _unsplit_metaspace() -> Tokenizer:
    tokenizer = train_tokenizer("metaspace_always", CHAT_SPECIALS)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    return tokenizer


def _unsplit_metaspace_first() -> Tokenizer:
    """transformers' conversion of Llama's and Mistral's SentencePiece tokenizers (not legacy):
    a prefix space at the text's start only, and no split at spaces."""
    tokenizer = train_tokenizer("metaspace_first", CHAT_SPECIALS)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return tokenizer


def _word_level_on_characters() -> Tokenizer:
    """A model over whole texts split only by a character class that never cuts at spaces."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^<]+"), behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in CHAT_SPECIALS])
    return tokenizer


@pytest.mark.parametrize(
    "build",
    [
        _no_pre_tokenizer,
        _stripping_normalizer,
        _word_pairs_regex,
        _rstrip_token,
        _unsplit_metaspace,
        _word_level_on_characters,
        _unsplit_metaspace_first,
    ],
)
def test_pipelines_that_look_across_words_are_not_chunked(build: Any) -> None:
    tokenizer = build()
    ours = _chunking(tokenizer)
    assert not ours.chunks_long_pieces
    text = "one two three " * 20 + "<|im_end|>" + " four five" * 30
    assert ours.encode_text_array(text).tolist() == tokenizer.encode(text, add_special_tokens=False).ids


def test_chunking_can_be_turned_off() -> None:
    assert not RequestTokenizer.default(chunk_chars=0).chunks_long_pieces
