"""A tokenizer's pre-tokenizer regex as a program the compiled word cutter runs.

Python's ``re`` costs ~100 ns per word it finds (a 600-character user turn: ~10 us); the
same cut in compiled code (:func:`kvroute.tokenizer_index.kernels.word_ids`) costs ~2 us.
The patterns tokenizers use (GPT-2's, Llama 3's, Qwen 2's, o200k's, in their ASCII
translation by :func:`~kvroute.tokenizer_index.word_split.ascii_pattern`) are alternatives
of short sequences of greedy character-class repeats, with one-character lookaheads and,
last, an optional group of fixed strings (o200k's contractions): a program of such *items*
per alternative, tried in order with backtracking, is what ``re`` does with them. Patterns
with anything else (lazy or possessive repeats, other repeated groups, captures,
lookbehinds, anchors, an alternative that can match nothing, a branch after a repeat)
get no program and stay with ``re``.

The pattern is read with ``re``'s own parser and every character class is evaluated by
``re`` itself on each of the 128 ASCII characters, so classes, escapes, ranges, negations
and case-insensitive groups mean exactly what they mean to ``re``. Tested against
``re.findall`` (``tests/tokenizer_index/test_word_program.py``).

Text beyond ASCII runs too where the tokenizer's pattern comes as well *marked*
(:class:`MarkedPattern`: its Unicode properties as marker characters ``re`` parses like
any other): the marked pattern must parse to the same items, and each of its classes is
evaluated by the ``regex`` module (which reads ``\\p{L}`` as Oniguruma does) on every code
point the caller knows. Code points that every class treats alike share a column of the
program's class table (a Latin letter and a Cyrillic one are both ``\\p{L}`` only), so
the table has 256 columns: the ASCII characters, then up to 127 such groups, then one for
the characters the program does not know, which leave the text to Python.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import numpy as np
import regex

from kvroute.tokenizer_index.kernels import (
    CLASS_COLUMNS,
    ITEM_FAIL,
    ITEM_FOLLOWED_BY,
    ITEM_NOT_FOLLOWED_BY,
    ITEM_OPTIONAL_SUFFIX,
    ITEM_REPEAT,
    UNKNOWN_COLUMN,
)

try:  # re's parser and compiler: private modules, present since Python 3.11
    from re import _compiler as re_compiler  # type: ignore[attr-defined]
    from re import _constants as re_constants  # type: ignore[attr-defined]
    from re import _parser as re_parser  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a Python that moved them: every pattern stays with re
    re_parser = None

#: The most a repeat without an upper bound can take (a text's length never reaches it).
UNBOUNDED = 1 << 40
ASCII = 128
#: A marked pattern's first marker: the Unicode property ``MarkedPattern.properties[0]``
#: (supplementary private use, beyond every code point a program reads).
MARK_BASE = 0xF0000


class _Refused(Exception):
    """The pattern uses something the program does not run."""


#: Which characters a class holds: the ASCII ones as a tuple of 128 (:func:`_members`), or
#: every code point's as an array (:func:`_wide_members`); empty for none.
Members = tuple[bool, ...] | np.ndarray
MembersOf = Callable[[tuple[Any, Any], bool], Members]


@dataclass(frozen=True, slots=True)
class MarkedPattern:
    """A tokenizer's pattern for text beyond ASCII, in ``re``'s syntax: each Unicode
    property (``\\p{L}``, ``\\s`` as White_Space, ...) is the marker character
    ``MARK_BASE + k``, where ``properties[k]`` is the property in the ``regex`` module's
    syntax. ``known``: per code point below its length, whether a program may read it."""

    pattern: re.Pattern[str]
    properties: tuple[str, ...]
    known: np.ndarray


@dataclass(frozen=True, slots=True)
class Item:
    kind: int
    members: Members
    least: int = 0
    most: int = 0
    #: An optional suffix's strings, each a class per character, in the order tried.
    strings: tuple[tuple[Members, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class WordProgram:
    """The arrays :func:`kernels.word_ids` runs: ``classes[c, column]`` whether the
    characters of ``column`` (ASCII character ``column`` below 128; beyond, those ``cmap``
    maps to it) are in class ``c``; ``items[i]`` = (kind, class, least, most), for an
    optional suffix (kind, its first string in ``suffixes``, how many, 0); alternative ``a``
    is items ``ends[a-1]..ends[a]-1``; ``starts[column]`` = (how many, then which)
    alternatives can begin with its characters, in order; ``suffixes[s]`` = (length, then a
    class per character); ``cmap[point]`` the column of a code point beyond ASCII
    (``UNKNOWN_COLUMN`` for those it does not know)."""

    classes: np.ndarray
    items: np.ndarray
    ends: np.ndarray
    starts: np.ndarray
    suffixes: np.ndarray
    cmap: np.ndarray

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.classes, self.items, self.ends, self.starts, self.suffixes, self.cmap

    @property
    def matches_ascii(self) -> bool:
        """Whether some alternative can start with an ASCII character (DeepSeek's run of
        CJK cannot: on ASCII text its split cuts nothing)."""
        return bool(self.starts[:ASCII, 0].any())

    @property
    def wide(self) -> bool:
        """Whether it reads characters beyond ASCII (it was given a marked pattern)."""
        return bool((self.cmap[ASCII:] != UNKNOWN_COLUMN).any())


def word_program(pattern: re.Pattern[str], marked: MarkedPattern | None = None) -> WordProgram | None:
    """``pattern``'s program (ASCII text; with ``marked``, where that reads as the same
    items, text beyond it too), or None where it uses what the program does not run."""
    alternatives = _parsed(pattern, _members)
    if alternatives is None:
        return None
    if not alternatives or any(_can_be_empty(alternative) for alternative in alternatives):
        return None  # findall's empty matches: not worth running here
    if not all(_runnable(alternative) for alternative in alternatives):
        return None
    wide = _wide_columns(alternatives, marked) if marked is not None else None
    return _program(alternatives, wide)


def _parsed(pattern: re.Pattern[str], members_of: MembersOf) -> list[list[Item]] | None:
    """``pattern``'s alternatives, classes evaluated by ``members_of``; None where it uses
    what the program does not run."""
    if re_parser is None or pattern.flags & ~(re.UNICODE | re.IGNORECASE):
        return None
    try:
        parsed = re_parser.parse(pattern.pattern, pattern.flags)
        return _alternatives(parsed.data, ignore_case=bool(pattern.flags & re.IGNORECASE), members_of=members_of)
    except (_Refused, re.error, regex.error, RecursionError):
        return None


def _alternatives(nodes: Sequence[Any], *, ignore_case: bool, members_of: MembersOf) -> list[list[Item]]:
    """A parsed sequence as the flat alternatives it is, in ``re``'s order of trying them."""
    alternatives: list[list[Item]] = [[]]
    for op, argument in nodes:
        if op in _ONE_CHARACTER:
            item = Item(ITEM_REPEAT, members_of((op, argument), ignore_case), 1, 1)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op is re_constants.MAX_REPEAT and (argument[0], argument[1]) == (0, 1) and not _one_character(argument[2]):
            item = _optional_suffix(argument[2], ignore_case, members_of)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op is re_constants.MAX_REPEAT:
            least, most, repeated = argument
            if not _one_character(repeated):
                raise _Refused("a repeat of more than one character")
            most = UNBOUNDED if most is re_constants.MAXREPEAT else most
            item = Item(ITEM_REPEAT, members_of(repeated.data[0], ignore_case), least, most)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op in (re_constants.ASSERT, re_constants.ASSERT_NOT):
            item = _lookahead(op, argument, ignore_case, members_of)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op is re_constants.SUBPATTERN:
            group, add_flags, del_flags, inner = argument
            if group is not None:
                raise _Refused("a capturing group changes what findall returns")
            if (add_flags | del_flags) & ~re.IGNORECASE:
                raise _Refused("a group's flags other than (?i)")
            inner_case = (ignore_case or bool(add_flags & re.IGNORECASE)) and not del_flags & re.IGNORECASE
            inner_alternatives = _alternatives(inner.data, ignore_case=inner_case, members_of=members_of)
            alternatives = _followed_by(alternatives, inner_alternatives)
        elif op is re_constants.BRANCH:
            _, branches = argument
            inner_alternatives = [
                alternative
                for branch in branches
                for alternative in _alternatives(branch.data, ignore_case=ignore_case, members_of=members_of)
            ]
            alternatives = _followed_by(alternatives, inner_alternatives)
        else:
            raise _Refused(str(op))
    return alternatives


def _followed_by(prefixes: list[list[Item]], alternatives: list[list[Item]]) -> list[list[Item]]:
    """Each prefix followed by each alternative. ``ab|ac`` tries what ``a(?:b|c)`` tries, in
    the same order, only where ``a`` has one way to match: after a repeat of variable
    length ``re`` would try every branch before giving the repeat back a character."""
    if len(alternatives) > 1 and any(item.least != item.most for prefix in prefixes for item in prefix):
        raise _Refused("a branch after a repeat of variable length")
    return [prefix + alternative for prefix in prefixes for alternative in alternatives]


def _one_character(repeated: Any) -> bool:
    return len(repeated.data) == 1 and repeated.data[0][0] in _ONE_CHARACTER


def _optional_suffix(group: Any, ignore_case: bool, members_of: MembersOf) -> Item:
    """``(?:...)?`` of fixed strings, as o200k ends its letters with ``(?i:'s|'t|...)?``; the
    program runs it only last in an alternative (:func:`_program` checks), where ``re``
    takes the first string that follows, or none, and never comes back to it."""
    strings = _alternatives(group.data, ignore_case=ignore_case, members_of=members_of)
    if any(item.kind != ITEM_REPEAT or item.least != 1 or item.most != 1 for string in strings for item in string):
        raise _Refused("an optional group of more than fixed strings")
    return Item(ITEM_OPTIONAL_SUFFIX, (), strings=tuple(tuple(i.members for i in s) for s in strings))


def _lookahead(op: Any, argument: Any, ignore_case: bool, members_of: MembersOf) -> Item:
    direction, inner = argument
    if direction != 1:
        raise _Refused("a lookbehind")
    if not inner.data:  # (?!) never matches; (?=) always does: a class that holds nothing
        return Item(ITEM_FAIL if op is re_constants.ASSERT_NOT else ITEM_NOT_FOLLOWED_BY, ())
    if len(inner.data) != 1 or inner.data[0][0] not in _ONE_CHARACTER:
        raise _Refused("a lookahead of more than one character")
    kind = ITEM_NOT_FOLLOWED_BY if op is re_constants.ASSERT_NOT else ITEM_FOLLOWED_BY
    return Item(kind, members_of(inner.data[0], ignore_case))


def _members(node: tuple[Any, Any], ignore_case: bool) -> tuple[bool, ...]:
    """Which ASCII characters the one-character node matches, asked of ``re`` itself (as a
    ``str`` pattern: Unicode classes, so ``\\s`` holds ``\\x1c``-``\\x1f`` as ``str.isspace`` does)."""
    state = re_parser.State()
    state.flags = re.UNICODE | (re.IGNORECASE if ignore_case else 0)
    compiled = re_compiler.compile(re_parser.SubPattern(state, [node]), state.flags)
    return tuple(compiled.fullmatch(chr(character)) is not None for character in range(ASCII))


def _can_be_empty(alternative: list[Item]) -> bool:
    if any(item.kind == ITEM_FAIL for item in alternative):
        return False
    return all(item.least == 0 for item in alternative if item.kind == ITEM_REPEAT)


def _runnable(alternative: list[Item]) -> bool:
    """An optional suffix only last: the kernel never backtracks into one."""
    return all(item.kind != ITEM_OPTIONAL_SUFFIX for item in alternative[:-1])


def _program(alternatives: list[list[Item]], wide: tuple[np.ndarray, np.ndarray] | None) -> WordProgram:
    """The arrays of ``alternatives`` (``wide``: the code points' columns beyond ASCII, and
    each class's members among those columns, by :func:`_wide_columns`)."""
    members = _class_members(alternatives)
    classes = np.zeros((len(members), CLASS_COLUMNS), dtype=np.uint8)
    for row, held in enumerate(members):
        if held:  # (a class of a lookahead that cannot match holds nothing)
            classes[row, :ASCII] = held
    cmap = np.full(ASCII, UNKNOWN_COLUMN, dtype=np.uint8)  # no character beyond ASCII is known
    if wide is not None:
        cmap, groups = wide
        classes[:, ASCII : ASCII + groups.shape[1]] = groups
    rows: list[tuple[int, int, int, int]] = []
    ends: list[int] = []
    suffixes: list[list[int]] = []
    starts = np.zeros((CLASS_COLUMNS, len(alternatives) + 1), dtype=np.int64)
    row = 0
    for number, alternative in enumerate(alternatives):
        first = row
        for item in alternative:
            if item.kind == ITEM_OPTIONAL_SUFFIX:
                rows.append((item.kind, len(suffixes), len(item.strings), 0))
                for string in item.strings:
                    suffixes.append([len(string), *range(row, row + len(string))])
                    row += len(string)
            else:
                rows.append((item.kind, row, item.least, item.most))
                row += 1
        ends.append(len(rows))
        for column in np.flatnonzero(_first_columns(alternative, classes[first:row])).tolist():
            starts[column, 0] += 1
            starts[column, starts[column, 0]] = number
    longest = max((len(suffix) for suffix in suffixes), default=1)
    return WordProgram(
        classes=classes,
        items=np.array(rows, dtype=np.int64).reshape(-1, 4),
        ends=np.array(ends, dtype=np.int64),
        starts=starts,
        suffixes=np.array([suffix + [0] * (longest - len(suffix)) for suffix in suffixes], dtype=np.int64).reshape(
            -1, longest
        ),
        cmap=cmap,
    )


def _class_members(alternatives: list[list[Item]]) -> list[Any]:
    """Every class of the program, in the order of its table's rows."""
    found: list[Any] = []
    for alternative in alternatives:
        for item in alternative:
            if item.kind == ITEM_OPTIONAL_SUFFIX:
                found += [members for string in item.strings for members in string]
            else:
                found.append(item.members)
    return found


def _first_columns(alternative: list[Item], classes: np.ndarray) -> np.ndarray:
    """The columns a match of ``alternative`` (its classes' rows ``classes``) can begin
    with (a superset: the others need not be tried there)."""
    possible = np.zeros(CLASS_COLUMNS, dtype=np.bool_)
    for row, item in enumerate(alternative):
        if item.kind in (ITEM_FAIL, ITEM_OPTIONAL_SUFFIX):  # (a suffix is last: unreached)
            break
        if item.kind != ITEM_REPEAT:
            continue  # a lookahead reads without taking: the next item takes the first character
        possible |= classes[row].astype(np.bool_)
        if item.least > 0:
            break
    return possible


# --- characters beyond ASCII -------------------------------------------------------------


def _wide_columns(alternatives: list[list[Item]], marked: MarkedPattern) -> tuple[np.ndarray, np.ndarray] | None:
    """Each known code point's column (``cmap``) and, per class of ``alternatives`` in
    order, its members among the columns beyond ASCII; None where the marked pattern reads
    as other items or its classes split the code points into more groups than columns."""
    pattern = marked.pattern
    found = _wide_groups(pattern.pattern, pattern.flags, marked.properties, marked.known.tobytes())
    if found is None or found[0] != _shape(alternatives):
        return None
    return found[1], found[2]


@cache
def _wide_groups(
    source: str, flags: int, properties: tuple[str, ...], known: bytes
) -> tuple[list[list[tuple[int, int, int, tuple[int, ...]]]], np.ndarray, np.ndarray] | None:
    """For :func:`_wide_columns` (once per pattern: ~0.1-0.3 s): the marked pattern's
    shape, ``cmap`` and each class's members among the groups of code points."""
    wide = _parsed(re.compile(source, flags), partial(_wide_members, properties=properties))
    if wide is None:
        return None
    known_points = np.frombuffer(known, dtype=np.bool_)
    points = np.flatnonzero(known_points)
    points = points[points >= ASCII]
    held = np.array([_held(members, points) for members in _class_members(wide)], dtype=np.bool_)
    held = held.reshape(-1, len(points))
    column_of_point = _group_columns(held)
    groups = int(column_of_point.max()) + 1 if len(points) else 0
    if groups > UNKNOWN_COLUMN - ASCII:
        return None
    members = np.zeros((held.shape[0], groups), dtype=np.uint8)
    members[:, column_of_point] = held
    cmap = np.full(len(known_points), UNKNOWN_COLUMN, dtype=np.uint8)
    cmap[:ASCII] = np.arange(ASCII)
    cmap[points] = ASCII + column_of_point
    return _shape(wide), cmap, members


def _group_columns(held: np.ndarray) -> np.ndarray:
    """A number per column of ``held`` (classes x code points), equal where the columns
    are: the bits of up to 63 classes at a time as one integer, unique'd one after the other."""
    groups = np.zeros(held.shape[1], dtype=np.int64)
    for first in range(0, held.shape[0], 63):
        rows = held[first : first + 63].astype(np.int64)
        bits = (rows << np.arange(len(rows), dtype=np.int64)[:, None]).sum(axis=0)
        _, inverse = np.unique(bits, return_inverse=True)
        _, groups = np.unique(groups * (len(held[0]) + 1) + inverse.reshape(-1), return_inverse=True)
        groups = groups.reshape(-1)
    return groups


def _held(members: Any, points: np.ndarray) -> np.ndarray:
    return members[points] if len(members) else np.zeros(len(points), dtype=np.bool_)


def _shape(alternatives: list[list[Item]]) -> list[list[tuple[int, int, int, tuple[int, ...]]]]:
    """What the program runs of ``alternatives`` besides their classes' members."""
    return [
        [(item.kind, item.least, item.most, tuple(map(len, item.strings))) for item in alternative]
        for alternative in alternatives
    ]


def _wide_members(node: tuple[Any, Any], ignore_case: bool, *, properties: tuple[str, ...]) -> np.ndarray:
    """Per code point below ``_WIDE_LIMIT``, whether the one-character node of a marked
    pattern matches it, asked of the ``regex`` module (where the markers stand for
    ``properties``)."""
    return _code_points_matching(("(?i)" if ignore_case else "") + _regex_source(node, properties))


def _regex_source(node: tuple[Any, Any], properties: tuple[str, ...]) -> str:
    """A one-character node of a marked pattern in the ``regex`` module's syntax."""
    op, argument = node
    if op is re_constants.LITERAL:
        return _regex_member(argument, properties)
    if op is re_constants.NOT_LITERAL:
        return f"[^{_regex_member(argument, properties)}]"
    if op is re_constants.ANY:
        return "."
    negated = bool(argument) and argument[0][0] is re_constants.NEGATE
    parts = []
    for member_op, member in argument[negated:]:
        if member_op is re_constants.LITERAL:
            parts.append(_regex_member(member, properties))
        elif member_op is re_constants.RANGE:
            parts.append(f"\\U{member[0]:08x}-\\U{member[1]:08x}")
        else:
            raise _Refused(f"{member_op} in a class")
    if not parts:
        raise _Refused("an empty class")
    return f"[{'^' if negated else ''}{''.join(parts)}]"


def _regex_member(point: int, properties: tuple[str, ...]) -> str:
    if point >= MARK_BASE:
        if point - MARK_BASE >= len(properties):
            raise _Refused("a marker with no property")
        return properties[point - MARK_BASE]
    return f"\\U{point:08x}"


#: Code points a marked pattern's classes are evaluated on: below it, but the surrogates.
_WIDE_LIMIT = 0x30000
_SURROGATES = range(0xD800, 0xE000)


@cache
def _code_points_matching(source: str) -> np.ndarray:
    """Per code point below ``_WIDE_LIMIT``, whether the one-character ``regex`` pattern
    ``source`` matches it (one substitution over every code point, in C)."""
    marked = regex.compile(source, regex.V0).sub("\\x00", _every_code_point())
    points = np.frombuffer(marked.encode("utf-32-le" if sys.byteorder == "little" else "utf-32-be"), dtype=np.uint32)
    held = np.zeros(_WIDE_LIMIT, dtype=np.bool_)
    held[1 : _SURROGATES.start] = points[: _SURROGATES.start - 1] == 0
    held[_SURROGATES.stop :] = points[_SURROGATES.start - 1 :] == 0
    return held


@cache
def _every_code_point() -> str:
    """Every code point from 1 to ``_WIDE_LIMIT``, but the surrogates, in order."""
    return "".join(map(chr, range(1, _SURROGATES.start))) + "".join(map(chr, range(_SURROGATES.stop, _WIDE_LIMIT)))


_ONE_CHARACTER = (
    frozenset({re_constants.LITERAL, re_constants.NOT_LITERAL, re_constants.IN, re_constants.ANY})
    if re_parser is not None
    else frozenset()
)
