"""New text tokenized word by word from a cache of the words' ids.

A byte-level BPE (GPT-2's, Llama 3's, Qwen's, DeepSeek V3's) first cuts text into words
with its pre-tokenizer's regex (DeepSeek's: three, one after the other) and never merges
across them, so a text's ids are its words' ids joined. An agent's next turn brings a few
thousand characters the piece cache has never seen (a tool result), but mostly words it
has: looked up in Python they cost ~0.1 ms where the tokenizers library takes 0.3-0.9 ms
for the same 2,000 characters (its call, its thread pool and cold caches dominate at that
size; ``benchmarks/README.md``, "Long prompts").

The library's own ``pre_tokenize_str`` costs ten times a Python regex, so the cut is
redone in Python. ASCII text, most of what agents and code send, is cut with ``re``: there
the pattern's Unicode classes have ASCII equivalents (``\\p{L}`` is ``[A-Za-z]``, ``\\s`` is
``[\\t\\n\\v\\f\\r ]``, ...), and every normalizer kvroute accepts here (NFC, NFD, NFKC,
NFKD) leaves ASCII as it is. Other text is normalized with :mod:`unicodedata` and cut with
the ``regex`` module, which reads the pattern's Unicode classes as Oniguruma does (``\\s``
becomes ``\\p{White_Space}``, what Oniguruma means by it), if all its characters are ones
every Unicode table involved agrees on: assigned in Python's :mod:`unicodedata` (Unicode
14 on Python 3.11) and below U+30000 (``regex`` reads some unassigned code points beyond
as letters). Where the pattern runs as a program of the compiled cutter (``word_program.py``:
GPT-2's, Llama 3's, Qwen 2's, o200k's; DeepSeek V3's for ASCII text only), long text is cut
and its words looked up in compiled code instead (``word_table.py``, 2-3x faster per
word): ASCII as the ``re`` pattern cuts it, other text, normalized, as the ``regex`` one
does, its classes evaluated by ``regex`` on every agreed code point
(:func:`marked_pattern`). Anything the translations do not know keeps the library's path. Exactness is
checked three ways: probe texts at construction (:meth:`WordSplitter.agrees`, ASCII and
other text apart), differential tests against the library, and in production every
:data:`VERIFY_EVERY`-th text split here is also tokenized by the library and compared (a
mismatch turns word splitting off). A mismatch costs a prediction, never a wrong answer:
the engine tokenizes the request itself.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from itertools import chain
from typing import Any

import numpy as np
import regex

from kvroute.tokenizer_index import kernels
from kvroute.tokenizer_index.bpe_merges import BpeMerges
from kvroute.tokenizer_index.word_program import MARK_BASE, MarkedPattern, word_program
from kvroute.tokenizer_index.word_table import WordTable

log = logging.getLogger(__name__)

#: Every this many texts tokenized word by word, the library tokenizes one too, to compare.
VERIFY_EVERY = 256
#: Words whose ids are kept (~130 bytes each); past it the cache starts afresh.
MAX_WORDS = 1 << 17
#: And their characters: a client sending long runs of letters (a new 60K-letter "word"
#: per request) fills memory before it fills the count (~8 GB at 131K such words).
#: Vocabulary averages ~7 characters a word, so real text reaches the count first.
MAX_WORD_CHARS = 1 << 22
#: Texts go to the compiled cutter when they have this many characters in all: it costs
#: ~16 ns per character against ~60-100 in Python (``re`` and the dict), but a few us more
#: per call (its arrays, and a second call for new words): in 2026-12 measurements Python
#: was cheaper below ~130 ASCII characters, and below ~60 of text beyond ASCII, which
#: ``regex`` cuts more slowly (``benchmarks/README.md``, "The compiled cutter for short texts").
COMPILED_MIN_CHARS = 128
#: The same where the texts are not all ASCII (and the cutter reads them: ``compiled_wide``).
COMPILED_MIN_CHARS_WIDE = 64
#: Who tokenized a word new to the caches (:meth:`WordSplitter.new_word_counts`).
NEW_WORD_SOURCES = ("bpe", "library")
#: New words of texts cut in Python go to the compiled BPE this many at a time or more.
#: One call costs ~9 us for one word, ~13 us for eight; the library's ~5 us for one, ~30
#: for eight.
BPE_MIN_WORDS = 2
#: Text that is not ASCII is cut here when it has a space at least every this many
#: characters (words that recur); other text, CJK above all, is left to the library.
SPACED_WORD_CHARS = 16

# GPT-2's pre-tokenizer regex: what ByteLevel(use_regex=true) cuts words with.
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_UNICODE_NORMAL_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
#: Text with a code point from here on is left to the library (see the module docstring).
_UNICODE_LIMIT = 0x30000
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
# Punctuation and symbols (DeepSeek's pattern reads them): the ASCII members of each
# general category, as Unicode has them (stable since ASCII was first mapped).
_ASCII_CLASSES.update(
    {
        category: "".join(
            re.escape(chr(point)) for point in range(128) if unicodedata.category(chr(point)).startswith(category)
        )
        for category in ("P", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk", "So")
    }
)
_SHORTHANDS = {"s": _SPACE, "d": "0-9", "w": "A-Za-z0-9_"}
# Texts that exercise every alternative of the usual patterns: contractions in both cases,
# digit runs, punctuation runs before line breaks, every ASCII space, runs of them.
_PROBES = (
    "Hello world, it's 2024! Don'T we'LL see: x=12345; y = [1, 2];\n\n  indent\tTab\r\nEnd  ",
    " \t\x0b\x0c\r\n\x1c\x1d\x1e\x1f \x00\x7f~`!@#$%^&*()_+-={}|[]\\:\";'<>?,./ end",
    "a  b   c\n \n  d\r\r\ne' 's 'S 'sS ''s 've'RE'm 'd 'lL 1234567 12a3 a12 _x x_ __init__()\n",
    "def f(x):\n    return {'k': \"v\"}  # comment\n\n\nclass A(B):\n\tpass\n",
)
# And text that is not ASCII: accents composed and not, every letter category, CJK, emoji,
# digits of other scripts, the spaces beyond ASCII, case folding in contractions.
_UNICODE_PROBES = (
    "Hé\u0301llo naïve café e\u0301clair ǅemal ʰa ﬁne straße İstanbul Ελληνικά русский שלום مرحبا",
    "中文字符，日本語のカタカナ。한국어 😀👍🏽 ½ Ⅻ ٣٤٥ १२३ x\u00a0y\u2003z\u0085w\u3000v\u2028u",
    "it’s DON'ſ we'ＬＬ ｆｕｌｌ\u3000width １２３ ａ\u0308\u0304 \u200b\u200d\ufeff end",
)


class _Untranslatable(Exception):
    """A pattern uses something a translation does not read."""


def _pattern_parts(pattern: str) -> Iterator[tuple[str, bool]]:
    """``pattern`` (Oniguruma syntax, as a tokenizer.json writes it) as its escapes (``\\s``,
    ``\\p{L}``, ...) and single characters, each with whether it is inside a character class;
    ``_Untranslatable`` for anchors (Ruby's match at every line), nested classes and
    unfinished escapes or classes. Inside a class ``^`` (but first) and ``$`` are characters
    (DeepSeek's punctuation class holds both)."""
    in_class = False
    position = 0
    while position < len(pattern):
        character = pattern[position]
        if character == "\\":
            escape = re.match(r"\\[pP]\{\^?\w+\}|\\.", pattern[position:], re.DOTALL)
            if escape is None:
                raise _Untranslatable
            yield escape.group(), in_class
            position += escape.end()
            continue
        if character == "[":
            if in_class:
                raise _Untranslatable  # nested classes, set operations
            in_class = True
            opening = "[^" if pattern.startswith("[^", position) else "["
            yield opening, False
            position += len(opening)
            if pattern.startswith("]", position):
                raise _Untranslatable  # a literal ] first: read differently by some engines
            continue
        if character == "]" and in_class:
            in_class = False
            yield character, False
            position += 1
            continue
        if character in "^$" and not in_class:
            raise _Untranslatable
        yield character, in_class
        position += 1
    if in_class:
        raise _Untranslatable


def ascii_pattern(pattern: str) -> str | None:
    """``pattern`` for ASCII-only text in Python's ``re`` syntax; None where it uses anything
    this does not translate."""
    translated = _translated(pattern, _ascii_part)
    if translated is None:
        return None
    # A class left with no members: one that matches nothing, or, negated, anything.
    translated = translated.replace("[^]", r"[\s\S]").replace("[]", "(?!)")
    return translated if _compiles(re.compile, translated) else None


def _translated(pattern: str, translate_part: Callable[[str, bool], str]) -> str | None:
    try:
        return "".join(translate_part(part, in_class) for part, in_class in _pattern_parts(pattern))
    except _Untranslatable:
        return None


def _compiles(compile_pattern: Callable[[str], object], pattern: str) -> bool:
    try:
        compile_pattern(pattern)
    except (re.error, regex.error):
        return False
    return True


def _ascii_part(part: str, in_class: bool) -> str:
    if part == "^" and in_class:
        return r"\^"  # a class before it may translate to nothing, leaving it first: a negation
    if len(part) < 2 or part[0] != "\\":
        return part
    escaped = part[1]
    if escaped in "pP":
        name = part[3:-1]
        if name not in _ASCII_CLASSES or (in_class and escaped == "P"):
            raise _Untranslatable  # \p{^L}, scripts, properties; a negation inside a class
        members = _ASCII_CLASSES[name]
        return members if in_class else _class(members, negated=escaped == "P")
    if escaped.lower() in _SHORTHANDS:
        if in_class and escaped.isupper():
            raise _Untranslatable
        members = _SHORTHANDS[escaped.lower()]
        return members if in_class else _class(members, negated=escaped.isupper())
    if escaped.isalnum() and escaped not in "rntfvx0":
        raise _Untranslatable  # \b, \A, \h, \R, \k, ...
    return part


def unicode_pattern(pattern: str) -> str | None:
    """``pattern`` for the ``regex`` module: ``\\s`` and ``\\S`` become White_Space classes
    (Python's count \\x1c-\\x1f, Oniguruma's do not); None where it uses anything else that
    may read differently (anchors, ``\\d``, ``\\w``, ``\\b``, ...)."""
    translated = _translated(pattern, _unicode_part)
    return translated if translated is not None and _compiles(_compile_unicode, translated) else None


def _compile_unicode(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern, regex.V0)


def _unicode_part(part: str, in_class: bool) -> str:
    if len(part) < 2 or part[0] != "\\":
        return part
    escaped = part[1]
    if escaped == "s":
        return r"\p{White_Space}"
    if escaped == "S":
        if in_class:
            raise _Untranslatable
        return r"\P{White_Space}"
    if escaped.isalnum() and escaped not in "pPrntfvx0":
        raise _Untranslatable
    return part


def marked_pattern(pattern: str) -> tuple[str, tuple[str, ...]] | None:
    """``pattern`` in Python's ``re`` syntax with each Unicode property (and ``\\s``, read
    as White_Space) a marker character, and the properties in the ``regex`` module's
    syntax, the ``k``-th marked ``MARK_BASE + k`` (``word_program.MarkedPattern``); None
    where it uses anything :func:`unicode_pattern` does not read."""
    properties: list[str] = []

    def marked_part(part: str, in_class: bool) -> str:
        if part == "^" and in_class:
            return r"\^"
        if len(part) < 2 or part[0] != "\\" or part[1] not in "pPsS":
            return _unicode_part(part, in_class)
        escaped = part[1]
        if in_class and escaped in "PS":
            raise _Untranslatable  # a negation inside a class
        written = r"\p{White_Space}" if escaped in "sS" else "\\p" + part[2:]
        if written not in properties:
            properties.append(written)
        marker = chr(MARK_BASE + properties.index(written))
        return marker if in_class else f"[{'^' if escaped in 'PS' else ''}{marker}]"

    translated = _translated(pattern, marked_part)
    if translated is None or not _compiles(re.compile, translated):
        return None
    return translated, tuple(properties)


@cache
def _agreed_code_points() -> np.ndarray:
    """Per code point below :data:`_UNICODE_LIMIT`, whether Python's Unicode tables assign it
    (built once, ~40 ms)."""
    unassigned = {"Cn", "Co", "Cs"}
    category = unicodedata.category
    return np.array([category(chr(point)) not in unassigned for point in range(_UNICODE_LIMIT)], dtype=np.bool_)


def agreed_text(text: str, columns: np.ndarray | None = None) -> bool:
    """Whether every character of ``text`` is one the Unicode tables involved agree on
    (``columns``: :func:`known_columns` of the code points a splitter knows; by default
    :func:`_agreed_code_points`)."""
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    if columns is None:
        columns = _agreed_columns()
    return bool(kernels.known_text(np.frombuffer(encoded, dtype=np.uint8), columns))


def known_columns(points: np.ndarray) -> np.ndarray:
    """Per code point, known (``points``) or not, as a compiled program's ``cmap`` reads it."""
    return np.where(points, 0, kernels.UNKNOWN_COLUMN).astype(np.uint8)


@cache
def _agreed_columns() -> np.ndarray:
    return known_columns(_agreed_code_points())


def normalization_disagreements(normalize: Callable[[str], str], forms: tuple[str, ...]) -> np.ndarray:
    """The agreed code points that the pipeline's normalizer (``normalize``, the library's)
    treats otherwise than :mod:`unicodedata` normalizing to ``forms`` in turn. The library's
    tables are older than Python's: a combining mark it does not know is a starter to it,
    so marks around it are not put in order (U+0899, U+10D27 read as in Unicode 14 by
    Python, left as they are by the library)."""
    points, probes = _normalization_probes()
    theirs = normalize(probes).split("\n")
    ours = probes
    for form in forms:
        ours = unicodedata.normalize(form, ours)  # type: ignore[arg-type]
    mine = ours.split("\n")
    if len(theirs) != len(points) or len(mine) != len(points):  # (a line normalized across its end)
        return points
    return points[[their != my for their, my in zip(theirs, mine, strict=True)]]


@cache
def _normalization_probes() -> tuple[np.ndarray, str]:
    """The agreed code points beyond ASCII a normalizer may move or change (combining
    marks, characters with a decomposition), and a text of one line each that shows how it
    treats them: a mark between marks of the highest and lowest classes (which it orders
    around the mark by the mark's class), any other such character alone (~50 ms, once)."""
    points = np.flatnonzero(_agreed_code_points())
    combining, decomposition = unicodedata.combining, unicodedata.decomposition
    chosen: list[int] = []
    lines: list[str] = []
    for point in points[points >= 128].tolist():
        character = chr(point)
        if combining(character):
            chosen.append(point)
            lines.append("\u0345" + character + "\u0334")  # (ypogegrammeni 240, tilde overlay 1)
        elif decomposition(character):
            chosen.append(point)
            lines.append(character)
    return np.array(chosen, dtype=np.int64), "\n".join(lines)


def _class(members: str, *, negated: bool) -> str:
    if not members:
        return r"[\s\S]" if negated else "(?!)"
    return f"[{'^' if negated else ''}{members}]"


@dataclass(frozen=True)
class WordPatterns:
    """How a pipeline's words are cut in Python: ASCII text with ``ascii`` (``re``), other
    text normalized to each of ``normal_forms`` in turn, then cut with ``unicode``
    (``regex``; None: other text is left to the library). Where the pipeline splits with
    several regexes one after the other (DeepSeek V3's: digit runs, then CJK runs, then
    words), each of ``ascii_before`` (``unicode_before``) first cuts every piece the one
    before it left, matches and the text between them apart, and the last cuts what they
    left."""

    ascii: re.Pattern[str]
    unicode: regex.Pattern[str] | None = None
    normal_forms: tuple[str, ...] = ()
    ascii_before: tuple[re.Pattern[str], ...] = ()
    unicode_before: tuple[regex.Pattern[str], ...] = ()
    #: Each of ``(*ascii_before, ascii)`` marked for the compiled cutter
    #: (:func:`marked_pattern`); empty where other text is left to the library.
    marked: tuple[tuple[str, tuple[str, ...]], ...] = ()


def word_pattern(normalizer: Any, pre_tokenizer: Any, model: Any) -> WordPatterns | None:
    """The regexes cutting text into the words of a pipeline given by the JSON states of its
    normalizer, pre-tokenizer and model; None unless it is a byte-level BPE whose words come
    from regexes (GPT-2's, or isolating ``Split`` s before a ``ByteLevel`` without its own)."""
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("dropout"):
        return None
    normal_forms = tuple(str(part.get("type")) for part in pipeline_parts(normalizer))
    if not set(normal_forms) <= _UNICODE_NORMAL_FORMS:
        return None
    parts = pipeline_parts(pre_tokenizer)
    if len(parts) == 1:
        (part,) = parts
        if not _byte_level(part, use_regex=True):
            return None
        sources = [_GPT2_PATTERN]
    elif len(parts) >= 2:
        *splits, byte_level = parts
        written = [_isolating_regex(split) for split in splits]
        if not _byte_level(byte_level, use_regex=False) or any(source is None for source in written):
            return None
        sources = [source for source in written if source is not None]
    else:
        return None
    ascii_sources = [ascii_pattern(source) for source in sources]
    if any(translated is None for translated in ascii_sources):
        return None
    ascii_compiled = [re.compile(translated) for translated in ascii_sources if translated is not None]
    unicode_sources = [unicode_pattern(source) for source in sources]
    unicode_compiled = [_compile_unicode(source) for source in unicode_sources if source is not None]
    unicode_known = len(unicode_compiled) == len(sources)
    marked = [marked_pattern(source) for source in sources]
    return WordPatterns(
        ascii_compiled[-1],
        unicode_compiled[-1] if unicode_known else None,
        normal_forms,
        tuple(ascii_compiled[:-1]),
        tuple(unicode_compiled[:-1]) if unicode_known else (),
        tuple(pair for pair in marked if pair is not None) if unicode_known and None not in marked else (),
    )


def _isolating_regex(state: dict[str, Any]) -> str | None:
    """The regex of a ``Split`` that keeps its matches and the text between them as words."""
    written = state.get("pattern", {}).get("Regex") if state.get("type") == "Split" else None
    if not isinstance(written, str) or state.get("behavior") != "Isolated" or state.get("invert"):
        return None
    return written


def pipeline_parts(state: Any) -> list[dict[str, Any]]:
    """A pipeline part's JSON description (a normalizer's, a pre-tokenizer's), a Sequence
    flattened into its members; none for None."""
    if state is None:
        return []
    if state.get("type") == "Sequence":
        members = state.get("normalizers") or state.get("pretokenizers") or []
        return [part for member in members for part in pipeline_parts(member)]
    return [state]


def _byte_level(state: dict[str, Any], *, use_regex: bool) -> bool:
    return (
        state.get("type") == "ByteLevel"
        and not state.get("add_prefix_space", False)
        and bool(state.get("use_regex", True)) == use_regex
    )


class WordSplitter:
    """Texts to ids, word by word, from a cache of each word's ids.

    ``encode_words`` tokenizes a batch of words with the library (each on its own, as the
    pre-tokenizer would hand it to the model). Thread-safe as the tokenizer using it is:
    the cache is one dict, read and written an item at a time.
    """

    def __init__(
        self,
        patterns: WordPatterns,
        encode_words: Callable[[list[str]], list[list[int]]],
        *,
        normalize: Callable[[str], str] | None = None,
        bpe: BpeMerges | None = None,
    ) -> None:
        self._ascii = patterns.ascii
        self._unicode = patterns.unicode
        self._normal_forms = patterns.normal_forms
        self._ascii_before = patterns.ascii_before
        self._unicode_before = patterns.unicode_before
        self._looking_around = {
            split.pattern for split in (*self._ascii_before, *self._unicode_before) if "(?" in split.pattern
        }
        self._encode_words = encode_words
        #: The code points text beyond ASCII may hold to be cut here: those the Unicode tables
        #: agree on, less those the pipeline's own normalizer treats otherwise (``normalize``).
        self._known = _agreed_code_points() if self._unicode is not None else np.zeros(0, dtype=np.bool_)
        self._known_columns = _agreed_columns() if self._unicode is not None else known_columns(self._known)
        if self._unicode is not None and self._normal_forms and normalize is not None:
            disagreeing = normalization_disagreements(normalize, self._normal_forms)
            if len(disagreeing):
                self._known = self._known.copy()
                self._known[disagreeing] = False
                self._known_columns = known_columns(self._known)
        self._ids: dict[str, list[int]] = {}
        self._cached_chars = 0  # of the words in _ids
        self._library_words = 0  # new words the library tokenized
        self._bpe_words = 0  # new words of texts cut in Python that the BPE tokenized
        #: Whether the compiled table cuts text beyond ASCII too.
        self._table_wide = False
        self._bpe = bpe if bpe is not None and self._bpe_agrees(bpe) else None
        self._table = self._compiled_table(patterns.marked if self._unicode is not None else ())
        self._table_lock = threading.Lock()

    def _compiled_table(self, marked: tuple[tuple[str, tuple[str, ...]], ...]) -> WordTable | None:
        """Text's words cut and looked up in compiled code, where the patterns run as
        programs and at most one split that can cut ASCII text comes before the last
        (DeepSeek V3's: digit runs, then CJK runs, which no ASCII text has); text beyond
        ASCII too where every pattern has a marked program and every split cuts ASCII."""
        patterns = (*self._ascii_before, self._ascii)
        if marked:
            markings: list[MarkedPattern | None] = [
                MarkedPattern(re.compile(source), properties, self._known) for source, properties in marked
            ]
        else:
            markings = [None] * len(patterns)
        programs = [word_program(pattern, marking) for pattern, marking in zip(patterns, markings, strict=True)]
        *splits, program = programs
        if program is None or any(split is None for split in splits):
            return None
        cutting = [split for split in splits if split is not None and split.matches_ascii]
        if len(cutting) > 1:
            return None
        split = cutting[0] if cutting else None
        self._table_wide = len(cutting) == len(splits) and all(used.wide for used in (program, *cutting))
        return WordTable(program, self._encode_and_keep, MAX_WORDS, MAX_WORD_CHARS, split=split, bpe=self._bpe)

    def _bpe_agrees(self, bpe: BpeMerges) -> bool:
        """Whether ``bpe`` gives the library's ids for every word of the probe texts and of
        texts of the vocabulary's own tokens (``bpe.probe_texts``)."""
        texts = [*_PROBES, *_UNICODE_PROBES, *bpe.probe_texts]
        cut = [text for text in texts if text.isascii() or self._unicode is not None]  # (else words() refuses it)
        words = list(dict.fromkeys(word for text in cut for word in self.words(text)))
        if bpe.agrees(words, self._encode_words):
            return True
        log.warning("byte-level BPE in compiled code differs from the library on probe words; not using it")
        return False

    @property
    def unicode(self) -> bool:
        """Whether text that is not ASCII is cut here too."""
        return self._unicode is not None

    def agrees(self, encode_text: Callable[[list[str]], list[list[int]]]) -> bool:
        """Whether the ASCII probe texts' ids, word by word, equal the library's for the whole
        texts; if the other probes' do not, only ASCII text is cut here from then on."""
        expected = encode_text(list(_PROBES))
        if [self.ids(probe) for probe in _PROBES] != expected:
            return False
        if self._table is not None and _table_ids(self._table, _PROBES) != expected:
            log.warning("word program for %r differs from re on the probe texts; cutting with re", self._ascii.pattern)
            self._table = None
        if self._unicode is not None:
            expected = encode_text(list(_UNICODE_PROBES))
            if [self.ids(probe) for probe in _UNICODE_PROBES] != expected:
                self._unicode = None
                self._table_wide = False
            elif self._table_wide and self._table is not None:
                # (the probes that hold characters the programs do not know, CJK and emoji, give None)
                wide = [_table_ids(self._table, [self._normalized(probe)]) for probe in _UNICODE_PROBES]
                if any(ids is not None and ids != [want] for ids, want in zip(wide, expected, strict=True)):
                    log.warning("word program differs from regex on text beyond ASCII; cutting it in Python")
                    self._table_wide = False
        self.clear()  # the probes' words are no one's: neither kept nor counted
        self._library_words = self._bpe_words = 0
        if self._table is not None:
            self._table.bpe_words = 0
        return True

    @property
    def compiled(self) -> bool:
        """Whether ASCII text is cut and looked up in compiled code (:mod:`word_table`)."""
        return self._table is not None

    @property
    def compiled_wide(self) -> bool:
        """Whether text beyond ASCII is cut and looked up in compiled code too."""
        return self._table is not None and self._table_wide

    @property
    def compiled_bpe(self) -> bool:
        """Whether words new to the compiled table are tokenized in compiled code too
        (a byte-level BPE, :mod:`kvroute.tokenizer_index.bpe_merges`), not by the library."""
        return self._table is not None and self._bpe is not None

    def new_word_counts(self) -> dict[str, int]:
        """Words new to the caches by who tokenized them: ``bpe`` (compiled code), ``library``.
        Counters: they only grow."""
        in_table = self._table.bpe_words if self._table is not None else 0
        return {"bpe": in_table + self._bpe_words, "library": self._library_words}

    def handles(self, text: str) -> bool:
        """Whether ``text`` is cut here: ASCII, or, with a Unicode pattern, text of words
        between spaces (a run of CJK is one word, new in every sentence: the library's one
        call costs less than finding that out) in characters every Unicode table involved
        agrees on."""
        if text.isascii():
            return True
        return (
            self._unicode is not None
            and text.count(" ") * SPACED_WORD_CHARS >= len(text)
            and agreed_text(text, self._known_columns)
        )

    def ids_of(self, texts: list[str]) -> list[list[int] | np.ndarray]:
        """The ids of each of ``texts`` (:meth:`handles` them; at most :data:`MAX_WORDS`
        characters in all, as ``tokenizer.WORD_SPLIT_MAX_CHARS`` keeps them): in one
        compiled call (int64 arrays; the ASCII ones, or all where the program reads text
        beyond ASCII) where there is a word program and they have :data:`COMPILED_MIN_CHARS` in all (:data:`COMPILED_MIN_CHARS_WIDE` where some
        are not ASCII and the program reads them too), else each as :meth:`ids` (lists)."""
        table = self._table
        wide = self._table_wide and not all(text.isascii() for text in texts)
        if table is None or sum(map(len, texts)) < (COMPILED_MIN_CHARS_WIDE if wide else COMPILED_MIN_CHARS):
            return [self.ids(text) for text in texts]
        if wide:
            with self._table_lock:
                found = table.ids([self._normalized(text) for text in texts])
            if found is not None:
                return list(found)
            # (a character the programs do not know: the text beyond ASCII is cut in Python)
        plain = [text for text in texts if text.isascii()]
        with self._table_lock:
            ascii_found = table.ids(plain)
        assert ascii_found is not None  # (the programs know every ASCII character)
        each = iter(ascii_found)
        return [next(each) if text.isascii() else self.ids(text) for text in texts]

    def ids(self, text: str) -> list[int]:
        """The ids of ``text`` (:meth:`handles` it): its words' ids joined; new words
        tokenized in one batch."""
        words = self.words(text)
        cache = self._ids
        found: list[list[int] | None] = list(map(cache.get, words))
        if None in found:
            # Only the new words' places visited in Python: a request brings one or two.
            missing = _places_of_none(found)
            new = list(dict.fromkeys(words[place] for place in missing))
            encoded = dict(zip(new, self._encode_and_keep(new)))
            for place in missing:
                found[place] = encoded[words[place]]
        return list(chain.from_iterable(found))  # type: ignore[arg-type]

    def _encode_and_keep(self, words: list[str]) -> list[list[int]]:
        """The ids of ``words`` (new to the dict, or to the compiled table: short texts, cut
        in Python, then find the words long ones brought), kept in the dict, which starts
        afresh past :data:`MAX_WORDS` words or :data:`MAX_WORD_CHARS` characters. By the
        compiled BPE where there is one, there are :data:`BPE_MIN_WORDS` words or more and
        none is too long for it, else by the library."""
        cache = self._ids
        chars = sum(map(len, words))
        if len(cache) + len(words) > MAX_WORDS or self._cached_chars + chars > MAX_WORD_CHARS:
            cache.clear()
            self._cached_chars = 0
        encoded = None
        if self._bpe is not None and len(words) >= BPE_MIN_WORDS:
            encoded = self._bpe.encode_words(words)
        if encoded is not None:
            self._bpe_words += len(words)
        else:
            encoded = self._encode_words(words)
            self._library_words += len(words)
        cache.update(zip(words, encoded))
        self._cached_chars += chars
        return encoded

    def words(self, text: str) -> list[str]:
        """``text`` (normalized where it is not ASCII) cut into words: the pattern's matches
        and, as the library's isolating split does, the text between them (usual patterns
        leave none)."""
        pattern: re.Pattern[str] | regex.Pattern[str] = self._ascii
        before: tuple[re.Pattern[str] | regex.Pattern[str], ...] = self._ascii_before
        if not text.isascii():
            if self._unicode is None:
                raise ValueError("text that is not ASCII, and no Unicode pattern for this tokenizer")
            pattern, before = self._unicode, self._unicode_before
            text = self._normalized(text)
        if not before:
            return _cut(pattern, text)
        pieces = [text]
        for split in before:
            # A split that never looks around matches in a piece only where it matches in
            # the whole text: one search spares a pass that cuts nothing (CJK runs in ASCII).
            if split.pattern not in self._looking_around and not split.search(text):
                continue
            pieces = [cut for piece in pieces for cut in _isolated(split, piece)]
        return [word for piece in pieces for word in _cut(pattern, piece)]

    def _normalized(self, text: str) -> str:
        """``text`` in each of the pipeline's normal forms in turn."""
        if text.isascii():
            return text
        for form in self._normal_forms:
            text = unicodedata.normalize(form, text)  # type: ignore[arg-type]
        return text

    def clear(self) -> None:
        self._ids.clear()
        self._cached_chars = 0
        if self._table is not None:
            with self._table_lock:
                self._table.clear()

    def __len__(self) -> int:
        return len(self._ids) + (len(self._table) if self._table is not None else 0)


def _table_ids(table: WordTable, texts: tuple[str, ...] | list[str]) -> list[list[int]] | None:
    found = table.ids(texts)
    return None if found is None else [ids.tolist() for ids in found]


def _places_of_none(found: list[Any]) -> list[int]:
    """Where ``found`` holds None (at least once), found by ``list.index`` (C) rather than a
    Python loop over every item."""
    places = [found.index(None)]
    try:
        while True:
            places.append(found.index(None, places[-1] + 1))
    except ValueError:
        return places


def _cut(pattern: re.Pattern[str] | regex.Pattern[str], text: str) -> list[str]:
    """``text`` cut into ``pattern``'s words (its matches, usually all of it)."""
    words: list[str] = pattern.findall(text)
    if sum(map(len, words)) == len(text):
        return words
    if not words:  # (an earlier split's match the last pattern does not cut: a digit run)
        return [text]
    return _isolated(pattern, text)


def _isolated(pattern: re.Pattern[str] | regex.Pattern[str], text: str) -> list[str]:
    """``text`` cut at ``pattern``'s matches, keeping the matches and the text between them."""
    words, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            words.append(text[start : match.start()])
        if match.end() > match.start():
            words.append(match.group())
        start = match.end()
    if start < len(text):
        words.append(text[start:])
    return words
