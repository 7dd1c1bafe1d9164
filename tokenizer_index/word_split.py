"""New ASCII text tokenized word by word from a cache of the words' ids.

A byte-level BPE (GPT-2's, Llama 3's, Qwen's) first cuts text into words with its
pre-tokenizer's regex and never merges across them, so a text's ids are its words' ids
joined. An agent's next turn brings a few thousand characters the piece cache has never
seen (a tool result), but mostly words it has: looked up in Python they cost ~0.1 ms where
the tokenizers library takes 0.3-0.9 ms for the same 2,000 characters (its call, its thread
pool and cold caches dominate at that size; ``benchmarks/README.md``, "Long prompts").

The library's own ``pre_tokenize_str`` costs ten times a Python regex, so the cut is
redone with Python's ``re``, for ASCII text only: there the pattern's Unicode classes have
ASCII equivalents (``\\p{L}`` is ``[A-Za-z]``, ``\\s`` is ``[\\t\\n\\v\\f\\r ]``, ...), and
every normalizer kvroute accepts here (NFC, NFD, NFKC, NFKD) leaves ASCII as it is.
Anything the translation does not know keeps the library's path. Exactness is checked
three ways: probe texts at construction (:meth:`WordSplitter.agrees`), differential tests
against the library, and in production every :data:`VERIFY_EVERY`-th text split here is
also tokenized by the library and compared (a mismatch turns word splitting off).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import chain
from typing import Any

#: Every this many texts tokenized word by word, the library tokenizes one too, to compare.
VERIFY_EVERY = 256
#: Words whose ids are kept (~130 bytes each); past it the cache starts afresh.
MAX_WORDS = 1 << 17

# GPT-2's pre-tokenizer regex: what ByteLevel(use_regex=true) cuts words with.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_NORMALIZERS_IDENTICAL_ON_ASCII = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
# What each Unicode class and shorthand holds among ASCII characters (Oniguruma's Unicode
# definitions: \s is White_Space, without the \x1c-\x1f that Python's str.isspace() adds).
_SPACE = r"\t\n\x0b\x0c\r "
_ASCII_CLASSES = {
    "L": "A-Za-z",
    "Lu": "A-Z",
    "Ll": "a-z",
    "Lt": "",
    "Lm": "",
    "Lo": "",
    "M": "",
    "Mn": "",
    "Mc": "",
    "Me": "",
    "N": "0-9",
    "Nd": "0-9",
    "Nl": "",
    "No": "",
}
_SHORTHANDS = {"s": _SPACE, "d": "0-9", "w": "A-Za-z0-9_"}
# Texts that exercise every alternative of the usual patterns: contractions in both cases,
# digit runs, punctuation runs before line breaks, every ASCII space, runs of them.
_PROBES = (
    "Hello world, it's 2024! Don'T we'LL see: x=12345; y = [1, 2];\n\n  indent\tTab\r\nEnd  ",
    " \t\x0b\x0c\r\n\x1c\x1d\x1e\x1f \x00\x7f~`!@#$%^&*()_+-={}|[]\\:\";'<>?,./ end",
    "a  b   c\n \n  d\r\r\ne' 's 'S 'sS ''s 've'RE'm 'd 'lL 1234567 12a3 a12 _x x_ __init__()\n",
    "def f(x):\n    return {'k': \"v\"}  # comment\n\n\nclass A(B):\n\tpass\n",
)


def ascii_pattern(pattern: str) -> str | None:
    """``pattern`` (Oniguruma syntax, as a tokenizer.json writes it) for ASCII-only text in
    Python's ``re`` syntax; None where it uses anything this does not translate."""
    if "^" in pattern.replace("[^", "") or "$" in pattern or r"\p{^" in pattern:
        return None  # anchors (Ruby's match at every line) and negated properties
    out: list[str] = []
    in_class = False
    position = 0
    while position < len(pattern):
        character = pattern[position]
        if character == "\\":
            if position + 1 >= len(pattern):
                return None
            escaped = pattern[position + 1]
            if escaped in "pP":
                match = re.match(r"\{(\w+)\}", pattern[position + 2 :])
                if match is None or match.group(1) not in _ASCII_CLASSES:
                    return None
                members = _ASCII_CLASSES[match.group(1)]
                position += 2 + match.end()
                if in_class:
                    if escaped == "P":
                        return None
                    out.append(members)
                else:
                    out.append(_class(members, negated=escaped == "P"))
                continue
            if escaped.lower() in _SHORTHANDS:
                members = _SHORTHANDS[escaped.lower()]
                negated = escaped.isupper()
                if in_class and negated:
                    return None
                out.append(members if in_class else _class(members, negated=negated))
                position += 2
                continue
            if escaped.isalnum() and escaped not in "rntfvx0":
                return None  # \b, \A, \h, \R, \k, ...: not translated
            out.append(pattern[position : position + 2])
            position += 2
            continue
        if in_class:
            if character == "]" and out[-1] not in ("[", "[^"):
                in_class = False
            elif character == "[":
                return None  # nested classes, set operations
        elif character == "[":
            in_class = True
            if pattern.startswith("[^", position):
                out.append("[^")
                position += 2
                continue
        out.append(character)
        position += 1
    if in_class:
        return None
    translated = "".join(out).replace("[^]", r"[\s\S]").replace("[]", "(?!)")
    try:
        re.compile(translated)
    except re.error:
        return None
    return translated


def _class(members: str, *, negated: bool) -> str:
    if not members:
        return r"[\s\S]" if negated else "(?!)"
    return f"[{'^' if negated else ''}{members}]"


def word_pattern(normalizer: Any, pre_tokenizer: Any, model: Any) -> re.Pattern[str] | None:
    """The regex cutting ASCII text into the words of a pipeline given by the JSON states of
    its normalizer, pre-tokenizer and model; None unless it is a byte-level BPE whose words
    come from one regex (GPT-2's, or a ``Split`` before a ``ByteLevel`` without its own)."""
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("dropout"):
        return None
    if not _identical_on_ascii(normalizer):
        return None
    parts = _members(pre_tokenizer)
    if len(parts) == 1:
        (part,) = parts
        if not _byte_level(part, use_regex=True):
            return None
        source = _GPT2_PATTERN
    elif len(parts) == 2:
        split, byte_level = parts
        regex = split.get("pattern", {}).get("Regex") if split.get("type") == "Split" else None
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            return None
        if not _byte_level(byte_level, use_regex=False):
            return None
        source = regex
    else:
        return None
    translated = ascii_pattern(source)
    return None if translated is None else re.compile(translated)


def _members(state: Any) -> list[dict[str, Any]]:
    if state is None:
        return []
    if state.get("type") == "Sequence":
        members = state.get("normalizers") or state.get("pretokenizers") or []
        return [part for member in members for part in _members(member)]
    return [state]


def _identical_on_ascii(normalizer: Any) -> bool:
    return all(part.get("type") in _NORMALIZERS_IDENTICAL_ON_ASCII for part in _members(normalizer))


def _byte_level(state: dict[str, Any], *, use_regex: bool) -> bool:
    return (
        state.get("type") == "ByteLevel"
        and not state.get("add_prefix_space", False)
        and bool(state.get("use_regex", True)) == use_regex
    )


class WordSplitter:
    """ASCII texts to ids, word by word, from a cache of each word's ids.

    ``encode_words`` tokenizes a batch of words with the library (each on its own, as the
    pre-tokenizer would hand it to the model). Thread-safe as the tokenizer using it is:
    the cache is one dict, read and written an item at a time.
    """

    def __init__(self, pattern: re.Pattern[str], encode_words: Callable[[list[str]], list[list[int]]]) -> None:
        self._pattern = pattern
        self._findall = pattern.findall
        self._encode_words = encode_words
        self._ids: dict[str, list[int]] = {}

    def agrees(self, encode_text: Callable[[list[str]], list[list[int]]]) -> bool:
        """Whether the probe texts' ids, word by word, equal the library's for the whole texts."""
        probes = list(_PROBES)
        return [self.ids(probe) for probe in probes] == encode_text(probes)

    def ids(self, text: str) -> list[int]:
        """The ids of ASCII ``text`` (its words' ids joined; new words tokenized in one batch)."""
        words = self.words(text)
        cache = self._ids
        found: list[list[int] | None] = list(map(cache.get, words))
        if None in found:
            new = list(dict.fromkeys(word for word, ids in zip(words, found) if ids is None))
            if len(cache) + len(new) > MAX_WORDS:
                cache.clear()
            encoded = dict(zip(new, self._encode_words(new)))
            cache.update(encoded)
            found = [encoded[word] if ids is None else ids for word, ids in zip(words, found)]
        return list(chain.from_iterable(found))  # type: ignore[arg-type]

    def words(self, text: str) -> list[str]:
        """``text`` cut into words: the pattern's matches and, as the library's isolating
        split does, the text between them (usual patterns leave none)."""
        words: list[str] = self._findall(text)
        if sum(map(len, words)) == len(text):
            return words
        words, start = [], 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                words.append(text[start : match.start()])
            if match.end() > match.start():
                words.append(match.group())
            start = match.end()
        if start < len(text):
            words.append(text[start:])
        return words

    def clear(self) -> None:
        self._ids.clear()

    def __len__(self) -> int:
        return len(self._ids)
