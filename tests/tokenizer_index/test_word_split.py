"""New ASCII text tokenized word by word: the Python cut into words, the word cache, and
the ids of whole texts, compared with the tokenizers library (differential)."""

from __future__ import annotations

import json
import logging
import re
import threading
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers

from kvroute.tokenizer_index import RequestTokenizer, word_split
from kvroute.tokenizer_index.tokenizer import VERIFY_EVERY, WORD_SPLIT_MAX_CHARS
from kvroute.tokenizer_index.word_split import (
    COMPILED_MIN_CHARS,
    WordPatterns,
    WordSplitter,
    agreed_text,
    ascii_pattern,
    unicode_pattern,
    word_pattern,
)
from tests.tokenizer_index.tokenizers_fixtures import (
    DEEPSEEK_V3_PATTERNS,
    LLAMA3_PATTERN,
    O200K_PATTERN,
    QWEN2_PATTERN,
    regex_split_tokenizer,
    train_tokenizer,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
SPACES = " \t\n\x0b\x0c\r"
# ASCII texts as tools print them: words, contractions, numbers, code, runs of spaces.
FRAGMENTS = [
    "the", " Router", "don't", "IT'S", "we'Ll", "'s", "x1", "12345", "3.14", "__init__", "()", " {", "}\n",
    "  ", "\n\n", "\r\n", "\t", " \t ", "\x0b", "\x0c", "\x1c", "\x00", "!!", " ?", "-->", "'", '"', "=",
    "a", "Z", " 0", "1,234", "\n    ", "'re'", "e'", "''",
]  # fmt: skip
ASCII_TEXT = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=80),
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
)
# Text that is not only ASCII: accents composed or not, letters of every category, CJK,
# emoji, other scripts' digits, spaces beyond ASCII, case folding, full-width forms; and
# any character Python's Unicode tables assign (what the word path takes beyond ASCII).
UNICODE_FRAGMENTS = [
    "é", "e\u0301", "naïve", "ǅ", "ʰ", "ﬁ", "ß", "İ", "ſ", "'ſ", "Ω", "中文", "日本語", "한국어", "😀", "👍🏽",
    "½", "Ⅻ", "٣٤", "१२", "\u00a0", "\u2003", "\u0085", "\u3000", "\u2028", "\u200b", "\ufeff", "ＬＬ", "１２",
    "a\u0308\u0304", "\u0301", "’s", "–", "…", "Ελληνικά", "русский", "שלום", "مرحبا", "ไทย",
]  # fmt: skip
TEXT = st.one_of(
    ASCII_TEXT,
    st.text(alphabet=st.characters(exclude_categories=("Cn", "Co", "Cs"), max_codepoint=0x2FFFF), max_size=60),
    st.lists(st.sampled_from(FRAGMENTS + UNICODE_FRAGMENTS), max_size=30).map("".join),
)


def _library_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


@pytest.fixture(scope="module", params=["default", "byte_level", "llama3", "qwen2", "o200k", "deepseek_v3"])
def library(request: pytest.FixtureRequest) -> Tokenizer:
    """Byte-level BPEs whose words come from regexes (GPT-2's, or Splits before ByteLevel:
    one, or DeepSeek V3's three one after the other)."""
    kind = request.param
    if kind == "default":
        return RequestTokenizer.default().backend
    if kind == "byte_level":
        return train_tokenizer("byte_level", CHAT_SPECIALS)
    patterns = {
        "llama3": LLAMA3_PATTERN,
        "qwen2": QWEN2_PATTERN,
        "o200k": O200K_PATTERN,
        "deepseek_v3": DEEPSEEK_V3_PATTERNS,
    }[kind]
    return regex_split_tokenizer(patterns, CHAT_SPECIALS, normalizer=normalizers.NFC())


@pytest.fixture(scope="module")
def ours(library: Tokenizer) -> RequestTokenizer:
    """The library's tokenizer in kvroute, caching no pieces: every piece is new text."""
    tokenizer = RequestTokenizer(library, cache_bytes=0)
    assert tokenizer._words is not None
    return tokenizer


def _splitter(tokenizer: Tokenizer) -> WordSplitter:
    state = json.loads(tokenizer.to_str())
    patterns = word_pattern(state["normalizer"], state["pre_tokenizer"], state["model"])
    assert patterns is not None
    splitter = WordSplitter(patterns, lambda words: _library_ids(tokenizer, words))
    assert splitter.agrees(lambda texts: _library_ids(tokenizer, texts))
    return splitter


@SETTINGS
@given(text=TEXT)
def test_words_joined_are_the_librarys_ids(library: Tokenizer, text: str) -> None:
    splitter = _splitter(library)
    assert splitter.unicode  # (words() cuts any text it has characters for; handles() picks)
    normalized = library.normalizer.normalize_str(text) if library.normalizer is not None else text
    assert "".join(splitter.words(text)) == normalized
    assert splitter.ids(text) == _library_ids(library, [text])[0]
    # The cut is the library's own: its pre-tokenizer finds the same words.
    library_words = [word for word, _ in library.pre_tokenizer.pre_tokenize_str(normalized)]
    assert library_words == [library.pre_tokenizer.pre_tokenize_str(word)[0][0] for word in splitter.words(text)]


def test_known_words_come_from_the_cache() -> None:
    library = RequestTokenizer.default().backend
    asked: list[list[str]] = []

    def encode(words: list[str]) -> list[list[int]]:
        asked.append(words)
        return _library_ids(library, words)

    splitter = WordSplitter(WordPatterns(re.compile(ascii_pattern(r" ?\p{L}+|\s+") or "")), encode)
    assert splitter.ids("hello world hello") == _library_ids(library, ["hello world hello"])[0]
    assert asked == [["hello", " world", " hello"]] and len(splitter) == 3
    splitter.ids(" world hello")
    assert len(asked) == 1  # every word known


@SETTINGS
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_many_texts_ids_are_the_librarys(library: Tokenizer, texts: list[str]) -> None:
    """Many texts at once, in compiled code where the pattern runs as a program and they are
    long enough (beyond ASCII too, where it does: all but DeepSeek V3's), else word by word
    in Python."""
    splitter = _splitter(library)
    handled = [text for text in texts if splitter.handles(text)]
    long = [(text + " ") * (COMPILED_MIN_CHARS // (len(text) + 1) + 1) for text in handled]
    for batch in (handled, long):  # short texts (Python), then long ones (compiled, if it can)
        for _ in range(2):  # new words, then known ones
            assert [list(ids) for ids in splitter.ids_of(batch)] == _library_ids(library, batch)


def test_which_patterns_run_in_compiled_code(library: Tokenizer) -> None:
    """GPT-2's, Llama 3's, Qwen 2's, o200k's patterns, and DeepSeek V3's three splits (on
    ASCII text, digit runs and then its words: its CJK runs cut nothing there); text beyond
    ASCII too, but DeepSeek V3's (its CJK split would cut it: the kernel runs one split)."""
    splitter = _splitter(library)
    assert splitter.compiled
    deepseek = len(word_split.pipeline_parts(json.loads(library.to_str())["pre_tokenizer"])) > 2
    assert splitter.compiled_wide != deepseek


def test_threads_share_the_compiled_table() -> None:
    """The router tokenizes on its event loop and, for large bodies, in worker threads: the
    table (its kernels release the GIL) is used under a lock, and every text stays exact."""
    library = RequestTokenizer.default().backend
    splitter = _splitter(library)
    assert splitter.compiled
    failures: list[str] = []

    def tokenize(thread: int) -> None:
        for number in range(30):
            text = " ".join(f"w{thread}x{number}y{word} common words here" for word in range(20))
            if [list(ids) for ids in splitter.ids_of([text])] != _library_ids(library, [text]):
                failures.append(text)

    threads = [threading.Thread(target=tokenize, args=(thread,)) for thread in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_long_text_beyond_ascii_past_the_compiled_bound_is_cut_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled table is bounded in bytes, the callers in characters: spaced CJK of the
    callers' most characters takes ~3 bytes each; such a batch goes to Python, exactly."""
    monkeypatch.setattr(word_split, "MAX_WORDS", 4_000)
    library = RequestTokenizer.default().backend
    splitter = _splitter(library)
    texts = ["中文 字符 " * 300, "plain words " * 100]  # 1,800 characters, ~5,700 bytes
    assert splitter.compiled_wide and all(map(splitter.handles, texts))
    assert [list(ids) for ids in splitter.ids_of(texts)] == _library_ids(library, texts)


def test_the_word_cache_is_bounded_in_characters(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long runs of letters, new in every text, start the cache afresh at its bound in
    characters, not only in words."""
    monkeypatch.setattr(word_split, "MAX_WORD_CHARS", 5_000)
    library = RequestTokenizer.default().backend
    splitter = _splitter(library)
    for number in range(20):
        text = f"x {'qwertyuiop' * 100}{'z' * number} y"
        assert splitter.ids(text) == _library_ids(library, [text])[0]
        assert splitter._cached_chars <= 5_000 and len(splitter._ids) < 10


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"\p{L}+|\p{N}{1,3}", "[A-Za-z]+|[0-9]{1,3}"),
        (r"[^\r\n\p{L}\p{N}]?\p{L}+", r"[^\r\nA-Za-z0-9]?[A-Za-z]+"),
        (r"\s+(?!\S)|\s+", r"[\t\n\x0b\x0c\r ]+(?![^\t\n\x0b\x0c\r ])|[\t\n\x0b\x0c\r ]+"),
        (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}]+", "[A-Z]*[a-z]+"),
        (r"(?i:'s|'t)|\P{L}", r"(?i:'s|'t)|[^A-Za-z]"),
        (r"[\p{Lo}]|x", "(?!)|x"),
        # Punctuation and symbols; ^ and $ inside a class are characters, ^ kept literal.
        (r"[\p{M}^$]|\p{S}", r"[\^$]|[\$\+<=>\^`\|\~]"),
        (r"[\p{P}]", r"""[!"\#%\&'\(\)\*,\-\./:;\?@\[\\\]_\{\}]"""),
    ],
)
def test_unicode_classes_become_their_ascii_members(pattern: str, translated: str) -> None:
    assert ascii_pattern(pattern) == translated


@pytest.mark.parametrize(
    "pattern",
    [r"^\p{L}+", r"\p{L}+$", r"\p{Han}+", r"[^\S\r\n]+", r"[\P{L}x]", r"\b\w+", r"[[a-z]&&[^b]]", r"\p{L", r"a|^b"],
)
def test_what_it_cannot_translate_it_refuses(pattern: str) -> None:
    assert ascii_pattern(pattern) is None


@pytest.mark.parametrize(
    ("pattern", "translated"),
    [
        (r"\s+(?!\S)|\s+", r"\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+"),
        (r"[^\s\p{L}\p{N}]+", r"[^\p{White_Space}\p{L}\p{N}]+"),
        (r"(?i:'s)|\p{N}{1,3}", r"(?i:'s)|\p{N}{1,3}"),
    ],
)
def test_unicode_patterns_read_spaces_as_oniguruma_does(pattern: str, translated: str) -> None:
    assert unicode_pattern(pattern) == translated


@pytest.mark.parametrize("pattern", [r"^\p{L}+", r"\d+", r"\w+", r"[^\S\r\n]+", r"\b\p{L}"])
def test_what_the_unicode_translation_cannot_read_it_refuses(pattern: str) -> None:
    assert unicode_pattern(pattern) is None


def test_characters_the_unicode_tables_may_disagree_on_are_left_to_the_library() -> None:
    assert agreed_text("") and agreed_text("abc") and agreed_text("中文 naïve 😀 \u00a0")
    assert not agreed_text("A\U0003d000")  # the regex module reads this unassigned one as a letter
    assert not agreed_text("x\u0378")  # unassigned
    assert not agreed_text("\ue000")  # private use
    words = RequestTokenizer.default()._words
    assert words is not None
    assert words.handles("naïve café, déjà vu: straße über alles")  # words between spaces
    assert not words.handles("中文字符，日本語のカタカナ。")  # one run of letters, new in every sentence
    assert not words.handles("naïve café \ue000")


def test_marks_the_librarys_normalizer_orders_otherwise_are_left_to_it() -> None:
    """The library's normalization tables are older than Python's: U+0899 and U+10D27
    (combining marks of Unicode 14 and 11) are starters to it, so it leaves them in the order
    Python's NFC swaps. A splitter given the pipeline's normalizer leaves text holding them
    to the library; the ids stay the library's either way."""
    tokenizer = RequestTokenizer.default()
    text = "naïve words " * 60 + "then \U00010d27\u0899 marks"
    normalize = tokenizer.backend.normalizer.normalize_str
    assert normalize(text) != unicodedata.normalize("NFC", text)
    disagreeing = word_split.normalization_disagreements(normalize, ("NFC",))
    assert {0x0899, 0x10D27} <= set(disagreeing.tolist()) and 0x0301 not in disagreeing
    words = tokenizer._words
    assert words is not None and not words.handles(text) and words.handles(text.replace("\U00010d27\u0899", "e\u0301"))
    assert words.compiled_wide
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode_text(text) == ids and RequestTokenizer(tokenizer.backend).encode_text(text) == ids


def test_only_byte_level_bpes_with_isolating_regex_splits_split_by_words() -> None:
    def pattern_of(tokenizer: Tokenizer) -> WordPatterns | None:
        state = json.loads(tokenizer.to_str())
        return word_pattern(state["normalizer"], state["pre_tokenizer"], state["model"])

    assert pattern_of(train_tokenizer("byte_level", CHAT_SPECIALS)) is not None
    deepseek = pattern_of(regex_split_tokenizer(DEEPSEEK_V3_PATTERNS, CHAT_SPECIALS))
    assert deepseek is not None and len(deepseek.ascii_before) == len(deepseek.unicode_before) == 2
    removing = regex_split_tokenizer(LLAMA3_PATTERN, CHAT_SPECIALS)
    removing.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="removed"),
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    assert pattern_of(removing) is None  # a split that drops text is not a cut into words
    assert pattern_of(train_tokenizer("metaspace_always", CHAT_SPECIALS)) is None
    lowercased = regex_split_tokenizer(LLAMA3_PATTERN, CHAT_SPECIALS, normalizer=normalizers.Lowercase())
    assert pattern_of(lowercased) is None  # a normalizer that changes ASCII
    assert RequestTokenizer(train_tokenizer("metaspace_always", CHAT_SPECIALS))._words is None


@SETTINGS
@given(
    parts=st.lists(
        st.one_of(TEXT, st.sampled_from(CHAT_SPECIALS), st.text(max_size=8)),  # any text: unassigned too
        max_size=12,
    )
)
def test_the_tokenizers_ids_stay_the_librarys(library: Tokenizer, ours: RequestTokenizer, parts: list[str]) -> None:
    """Through RequestTokenizer: new pieces (some ending in an added token) by words, those
    with characters the Unicode tables may disagree on by the library."""
    text = "".join(parts)
    assert ours.encode_text(text) == _library_ids(library, [text])[0]
    assert ours.encode_text_array(text).tolist() == _library_ids(library, [text])[0]


def test_text_past_the_limit_goes_to_the_library() -> None:
    ours = RequestTokenizer.default(cache_bytes=0)
    assert ours._words is not None
    text = "word " * (WORD_SPLIT_MAX_CHARS // 5 + 1)
    before = len(ours._words)
    assert ours.encode_text(text) == _library_ids(ours.backend, [text])[0]
    assert len(ours._words) == before  # not one word looked up


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_a_text_the_check_finds_different_stops_word_splitting(
    caplog: pytest.LogCaptureFixture, compiled: bool
) -> None:
    """Short texts are cut in Python (the dict), long ones in compiled code (the table):
    either cache gone wrong is caught by the periodic check."""
    ours = RequestTokenizer.default()
    words = ours._words
    assert words is not None and words._table is not None
    tail = " filler" * (COMPILED_MIN_CHARS // 7) if compiled else ""
    if compiled:
        words._table.add(["hello"], [[7]])  # as if the cut or the table had gone wrong
    else:
        words.ids("hello")
        words._ids["hello"] = [7]
    first = f"hello 0{tail}"
    assert ours.encode_text(first) != _library_ids(ours.backend, [first])[0]  # cached wrong, unchecked
    with caplog.at_level(logging.ERROR):
        for number in range(1, VERIFY_EVERY + 1):
            ours.encode_text(f"hello {number}{tail}")
    assert ours._words is None and "differed from the library" in caplog.text
    # What it had cached is forgotten: the text tokenized wrong before the check is right now.
    assert ours.encode_text(first) == _library_ids(ours.backend, [first])[0]


def test_a_token_that_takes_the_space_before_it_leaves_its_unit_to_the_library() -> None:
    """An ``lstrip`` added token swallows the whitespace before it: its unit's text, cut off
    before it, would keep that space as a word of its own."""
    library = train_tokenizer("byte_level", CHAT_SPECIALS, [AddedToken("<mask>", lstrip=True, normalized=False)])
    ours = RequestTokenizer(library, cache_bytes=0)
    assert ours._words is not None
    for text in (" <mask>", "hello  <mask> world", "a\n<mask>", "<mask> x <mask>"):
        assert ours.encode_text(text) == _library_ids(library, [text])[0]


def test_text_between_matches_is_a_word_too() -> None:
    """A pattern that leaves text unmatched: the library's isolating split keeps it as words."""
    isolating = pre_tokenizers.Split(Regex(r"\p{L}+"), behavior="isolated")
    splitter = WordSplitter(
        WordPatterns(re.compile(ascii_pattern(r"\p{L}+") or "")), lambda words: [[len(w)] for w in words]
    )
    for text in ("ab, cd", ", ab", "ab ,", "", "  "):
        assert splitter.words(text) == [word for word, _ in isolating.pre_tokenize_str(text)]


@given(st.lists(st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=2)), min_size=1).filter(lambda x: None in x))
def test_places_of_none_are_every_none_in_order(found: list[list[int] | None]) -> None:
    assert word_split._places_of_none(found) == [place for place, ids in enumerate(found) if ids is None]
