"""Byte-level BPE in compiled code against the tokenizers library (differential): the same
ids for every word a pre-tokenizer cuts, the models it refuses, and a word table that
learns new words with it."""

from __future__ import annotations

import json
import re
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from kvroute.tokenizer_index import kernels
from kvroute.tokenizer_index.bpe_merges import BpeMerges, bpe_merges, byte_characters, token_bytes
from kvroute.tokenizer_index.tokenizer import RequestTokenizer
from kvroute.tokenizer_index.word_program import word_program
from kvroute.tokenizer_index.word_split import _GPT2_PATTERN, WordPatterns, WordSplitter, ascii_pattern
from kvroute.tokenizer_index.word_table import WordTable
from tests.tokenizer_index.test_word_split import ASCII_TEXT
from tests.tokenizer_index.tokenizers_fixtures import (
    LLAMA3_PATTERN,
    O200K_PATTERN,
    QWEN2_PATTERN,
    regex_split_tokenizer,
    train_tokenizer,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TEXT = st.text(
    st.one_of(
        st.sampled_from("abcdefghijklmnopqrstuvwxyz THEQUICK0123456789_-.,:;'\"#/\n\t()[]{}"),
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
    ),
    max_size=80,
)


def _ignoring_merges(tokenizer: Tokenizer, extra: list[str]) -> Tokenizer:
    """``tokenizer`` with ``ignore_merges`` (as Llama 3's) and ``extra`` words in its
    vocabulary that no merge builds, so only the whole-word lookup finds them."""
    state = json.loads(tokenizer.to_str())
    model = state["model"]
    model["ignore_merges"] = True
    characters = byte_characters()
    for word in extra:
        token = "".join(characters[byte] for byte in word.encode())
        model["vocab"].setdefault(token, len(model["vocab"]) + len(state["added_tokens"]))
    return Tokenizer.from_str(json.dumps(state))


def _tokenizers() -> dict[str, Tokenizer]:
    llama3 = regex_split_tokenizer(LLAMA3_PATTERN, ["<|eot_id|>"])
    return {
        "gpt2-style": train_tokenizer("byte_level", ["<|endoftext|>"]),
        "llama3-style": llama3,
        "llama3-style, ignore_merges": _ignoring_merges(llama3, [" router", "abc", " the", " zqx", "202"]),
        "qwen2-style": regex_split_tokenizer(QWEN2_PATTERN, ["<|im_end|>"]),
        "o200k-style": regex_split_tokenizer(O200K_PATTERN, ["<|end|>"]),
        "default": Tokenizer.from_file(str(RequestTokenizer.default_path() / "tokenizer.json")),
    }


TOKENIZERS = _tokenizers()


def _model(tokenizer: Tokenizer) -> dict[str, Any]:
    return json.loads(tokenizer.to_str())["model"]  # type: ignore[no-any-return]


def _words(tokenizer: Tokenizer, text: str) -> list[str]:
    """``text`` as the words the library's pre-tokenizer hands its model (normalized first),
    each as text again."""
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text) if text else []
    words = [(token_bytes(piece) or b"").decode("utf-8", "replace") for piece, _ in pieces]
    return [word for word in words if "\ufffd" not in word]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]


@pytest.fixture(scope="module")
def merges(tokenizer: Tokenizer) -> BpeMerges:
    built = bpe_merges(_model(tokenizer))
    assert built is not None
    return built


def test_byte_characters_are_the_byte_level_alphabet() -> None:
    characters = byte_characters()
    assert len(set(characters)) == 256 and set(characters) == set(pre_tokenizers.ByteLevel.alphabet())
    mapped = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in ["".join(map(chr, range(1, 128))), "é€中😀\u0085\u00a0ÿ"]:
        assert mapped.pre_tokenize_str(text)[0][0] == "".join(characters[byte] for byte in text.encode())
    assert token_bytes("".join(characters)) == bytes(range(256)) and token_bytes("a\u4e2d") is None


@SETTINGS
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_each_word_has_the_librarys_ids(tokenizer: Tokenizer, merges: BpeMerges, texts: list[str]) -> None:
    words = [word for text in texts for word in _words(tokenizer, text)]
    words = [word for word in words if len(word.encode()) <= kernels.BPE_MAX_BYTES]
    expected = [encoding.ids for encoding in tokenizer.encode_batch(words, add_special_tokens=False)]
    assert [merges.encode(word) for word in words] == expected
    assert merges.encode_words(words) == expected  # (one call, as a short text's new words)


def test_the_vocabulary_probes_agree(tokenizer: Tokenizer, merges: BpeMerges) -> None:
    assert merges.probe_texts
    words = [word for text in merges.probe_texts for word in _words(tokenizer, text)]

    def encode(batch: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in tokenizer.encode_batch(batch, add_special_tokens=False)]

    assert merges.agrees(words, encode)
    assert not merges.agrees(words, lambda batch: [[0] for _ in batch])


def test_long_words_are_left_to_the_library(merges: BpeMerges) -> None:
    assert merges.encode("x" * kernels.BPE_MAX_BYTES) is not None
    assert merges.encode("x" * (kernels.BPE_MAX_BYTES + 1)) is None and merges.encode("") is None
    assert merges.encode_words(["a", "x" * kernels.BPE_MAX_BYTES]) is not None
    assert merges.encode_words(["a", "x" * (kernels.BPE_MAX_BYTES + 1)]) is None
    assert merges.encode_words(["a", ""]) is None and merges.encode_words([]) == []


def test_with_ignore_merges_a_whole_word_of_the_vocabulary_is_its_one_id() -> None:
    tokenizer = TOKENIZERS["llama3-style, ignore_merges"]
    merges = bpe_merges(_model(tokenizer))
    plain = bpe_merges({**_model(tokenizer), "ignore_merges": False})
    assert merges is not None and plain is not None
    unreachable = 0
    for word in (" router", "abc", " zqx", "202"):
        expected = tokenizer.encode(word, add_special_tokens=False).ids
        assert len(expected) == 1 and merges.encode(word) == expected
        unreachable += plain.encode(word) != expected  # (a word no merge builds)
    assert unreachable >= 2
    assert merges.encode(" routers") == tokenizer.encode(" routers", add_special_tokens=False).ids


def test_a_pair_listed_twice_keeps_the_librarys_rank() -> None:
    vocab = {character: number for number, character in enumerate(byte_characters())}
    for token in ("ab", "bc", "abc"):
        vocab[token] = len(vocab)
    listed = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "b")]
    library = Tokenizer(models.BPE(vocab=vocab, merges=listed))
    library.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    built = bpe_merges(_model(library))
    assert built is not None
    for word in ("abc", "abcabc", "aab", "bcab"):
        assert built.encode(word) == library.encode(word, add_special_tokens=False).ids


@pytest.mark.parametrize(
    "change",
    [
        {"type": "WordPiece"},
        {"byte_fallback": True},
        {"unk_token": "<unk>"},
        {"dropout": 0.1},
        {"continuing_subword_prefix": "##"},
        {"end_of_word_suffix": "</w>"},
        {"merges": ["a b c"]},
        {"merges": [["a", "zz-not-in-vocab"]]},
    ],
)
def test_what_is_not_a_plain_byte_level_bpe_is_refused(change: dict[str, Any]) -> None:
    model = {**_model(TOKENIZERS["gpt2-style"]), **change}
    assert bpe_merges(model) is None


def test_a_vocabulary_without_every_byte_is_refused() -> None:
    model = _model(TOKENIZERS["gpt2-style"])
    model["vocab"] = {token: number for token, number in model["vocab"].items() if token != byte_characters()[0]}
    assert bpe_merges(model) is None
    assert bpe_merges(_model(train_tokenizer("metaspace_always", ["</s>"]))) is None
    assert bpe_merges(None) is None


def test_a_word_table_learns_new_words_without_the_library() -> None:
    tokenizer = TOKENIZERS["default"]
    merges = bpe_merges(_model(tokenizer))
    program = word_program(re.compile(ascii_pattern(_GPT2_PATTERN) or ""))
    assert merges is not None and program is not None
    calls: list[list[str]] = []

    def library(words: list[str]) -> list[list[int]]:
        calls.append(words)
        return [encoding.ids for encoding in tokenizer.encode_batch(words, add_special_tokens=False)]

    table = WordTable(program, library, 1 << 16, 1 << 20, bpe=merges)
    texts = [
        f"request {number}: fetch id_{number * 7919} from /srv/{number:x} and 'return' it " * 3 for number in range(50)
    ]
    for text in texts:
        assert table.ids([text])[0].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert calls == []
    long_word = "q" * (kernels.BPE_MAX_BYTES + 1)
    text = f"new words{long_word} and more 123456789"
    assert table.ids([text])[0].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert calls == [[" words" + long_word]]  # only the word past BPE_MAX_BYTES, by the library
    assert table.find(" more") is not None


def _bpe_table(tokenizer: Tokenizer, max_words: int = 1 << 16) -> tuple[WordTable, list[int]]:
    """A word table over GPT-2's pattern with ``tokenizer``'s BPE, whose library must not be
    called; and a list that grows by the number of words each lookup left to Python."""
    merges = bpe_merges(_model(tokenizer))
    program = word_program(re.compile(ascii_pattern(_GPT2_PATTERN) or ""))
    assert merges is not None and program is not None

    def library(words: list[str]) -> list[list[int]]:
        raise AssertionError(f"the library was called for {words}")

    table = WordTable(program, library, max_words, 1 << 20, bpe=merges)
    left_to_python: list[int] = []
    learn_missing = table._learn_missing

    def counted(found: Any) -> None:
        left_to_python.append(len(found.missing))
        learn_missing(found)

    table._learn_missing = counted  # type: ignore[method-assign]
    return table, left_to_python


def test_new_words_are_learned_and_written_in_the_lookups_own_call() -> None:
    """A request's few new words: tokenized, added and written in place of their
    placeholders inside the lookup's compiled call, in every text of a call, one met twice."""
    tokenizer = TOKENIZERS["default"]
    table, left_to_python = _bpe_table(tokenizer)
    seen: set[str] = set()
    for number in range(30):
        new = f"zq{number}x"  # several ids each: what follows moves along
        texts = [f"ask {new} and {new} again, then", f" more {number * 7919} about q{new}y", "done"]
        expected = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        assert [ids.tolist() for ids in table.ids(texts)] == expected
        seen.update(word for text in texts for word in re.findall(ascii_pattern(_GPT2_PATTERN) or "", text))
    assert left_to_python == []
    assert len(table) == table.bpe_words == len(seen)
    assert table._chars == sum(len(word) for word in seen)


@SETTINGS
@given(calls=st.lists(st.lists(ASCII_TEXT, min_size=1, max_size=4), min_size=1, max_size=3))
def test_a_bpe_word_table_is_the_library_call_after_call(calls: list[list[str]]) -> None:
    """Texts of new words, several per call, some met again in a later call: the ids the
    library gives, whether learned in the lookup's call or after it."""
    tokenizer = TOKENIZERS["default"]
    table, _ = _bpe_table(tokenizer, max_words=400)
    for texts in calls:
        if sum(map(len, texts)) > 400:  # (one call's bytes are bounded by the table's words)
            continue
        expected = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        assert [ids.tolist() for ids in table.ids(texts)] == expected


def test_new_words_past_the_tables_room_are_learned_after_it_grows() -> None:
    """When the new words do not all fit the table as it is (or one is past
    ``BPE_MAX_BYTES``), the call leaves them all to the path that grows it: still exact."""
    tokenizer = TOKENIZERS["default"]
    table, left_to_python = _bpe_table(tokenizer)
    many = " ".join(f"w{number}q" for number in range(1500))  # more new words than the first slots take
    assert table.ids([many])[0].tolist() == tokenizer.encode(many, add_special_tokens=False).ids
    assert left_to_python and left_to_python[0] >= 1500
    long_word = "k" * (kernels.BPE_MAX_BYTES + 1)
    text = f"short zqv and {long_word} end"
    with pytest.raises(AssertionError, match="the library was called"):  # the long word is the library's
        table.ids([text])
    assert left_to_python[-1] == 5  # all its words, " zqv" too


def test_the_default_tokenizer_learns_words_in_compiled_code() -> None:
    tokenizer = RequestTokenizer.from_pretrained(RequestTokenizer.default_path())
    assert tokenizer.fast_paths().words.endswith(", new words by BPE)")
    texts = [
        f"Tool result {number}: checksum {number * 104729:x}, path /tmp/run{number}/out.log " * 4
        for number in range(40)
    ]
    library = Tokenizer.from_file(str(RequestTokenizer.default_path() / "tokenizer.json"))
    assert tokenizer.new_word_counts() == {"bpe": 0, "library": 0}  # (the start-up probes are no one's)
    for text in texts:
        assert tokenizer.encode_text(text) == library.encode(text, add_special_tokens=False).ids
    learned = tokenizer.new_word_counts()
    assert learned["bpe"] >= 40 and learned["library"] == 0
    text = "A blob: " + "qwertyuiop" * 8 + ", and zqxwv" * 12  # one word of 81 bytes, one short new word
    assert tokenizer.encode_text(text) == library.encode(text, add_special_tokens=False).ids
    counts = tokenizer.new_word_counts()
    assert counts["library"] == 1 and counts["bpe"] > learned["bpe"]
    # Short texts are cut in Python (word_split.COMPILED_MIN_CHARS); their new words too
    # are the BPE's, in one call per text, not the library's.
    units = tokenizer.unit_counts()
    for number in range(20):
        name = "".join(chr(ord("a") + (number * 7 + place * 3) % 26) for place in range(6))
        short = f"Ask zq{name} about wq{name}."
        assert tokenizer.encode_text(short) == library.encode(short, add_special_tokens=False).ids
    cut = {source: count - units[source] for source, count in tokenizer.unit_counts().items()}
    assert cut["words"] == 20 and cut["words_compiled"] == 0  # each cut in Python
    after = tokenizer.new_word_counts()
    assert after["library"] == 1 and after["bpe"] >= counts["bpe"] + 40


def test_a_table_that_fills_with_compiled_words_starts_afresh() -> None:
    tokenizer = TOKENIZERS["default"]

    def letters(number: int) -> str:  # a word no other number gives
        return "".join(chr(ord("a") + int(digit)) for digit in str(number))

    table, _ = _bpe_table(tokenizer, max_words=300)
    sizes = []
    for round_ in range(30):
        text = " ".join(f"q{letters(round_ * 100 + number)}" for number in range(40))
        assert table.ids([text])[0].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
        sizes.append(len(table))
    assert max(sizes) <= 300 and any(after < before for before, after in pairwise(sizes))  # it started afresh


def test_a_tokenizer_that_ignores_merges_learns_words_in_compiled_code() -> None:
    library = TOKENIZERS["llama3-style, ignore_merges"]
    tokenizer = RequestTokenizer(library)
    assert tokenizer.fast_paths().words.endswith(", new words by BPE)")
    for number in range(20):
        text = f"Ask the router {number}: zqx abc{number} 202 x{number * 7}y, then the zqxzqx reply. " * 3
        assert tokenizer.encode_text(text) == library.encode(text, add_special_tokens=False).ids


def test_a_splitter_for_ascii_only_checks_its_bpe_on_ascii_words() -> None:
    """A pipeline whose pattern has no translation beyond ASCII cuts only ASCII text in
    Python: the BPE's vocabulary probes beyond it are not cut (they would raise)."""
    tokenizer = TOKENIZERS["default"]
    merges = bpe_merges(_model(tokenizer))
    assert merges is not None and any(not text.isascii() for text in merges.probe_texts)

    def encode(words: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in tokenizer.encode_batch(words, add_special_tokens=False)]

    splitter = WordSplitter(WordPatterns(re.compile(ascii_pattern(_GPT2_PATTERN) or "")), encode, bpe=merges)
    assert not splitter.unicode and splitter.compiled_bpe
    text = "A new word, zqxvbn, in " * 10
    assert splitter.ids_of([text])[0].tolist() == tokenizer.encode(text, add_special_tokens=False).ids
