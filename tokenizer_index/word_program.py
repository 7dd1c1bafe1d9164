"""A tokenizer's pre-tokenizer regex, for ASCII text, as a program the compiled word cutter runs.

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
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvroute.tokenizer_index.kernels import (
    ITEM_FAIL,
    ITEM_FOLLOWED_BY,
    ITEM_NOT_FOLLOWED_BY,
    ITEM_OPTIONAL_SUFFIX,
    ITEM_REPEAT,
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


class _Refused(Exception):
    """The pattern uses something the program does not run."""


Members = tuple[bool, ...]


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
    """The arrays :func:`kernels.word_ids` runs: ``classes[c, ch]`` whether ASCII character
    ``ch`` is in class ``c``; ``items[i]`` = (kind, class, least, most), for an optional
    suffix (kind, its first string in ``suffixes``, how many, 0); alternative ``a`` is items
    ``ends[a-1]..ends[a]-1``; ``starts[ch]`` = (how many, then which) alternatives can begin
    with ``ch``, in order; ``suffixes[s]`` = (length, then a class per character)."""

    classes: np.ndarray
    items: np.ndarray
    ends: np.ndarray
    starts: np.ndarray
    suffixes: np.ndarray

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.classes, self.items, self.ends, self.starts, self.suffixes

    @property
    def matches_ascii(self) -> bool:
        """Whether some alternative can start with an ASCII character (DeepSeek's run of
        CJK cannot: on ASCII text its split cuts nothing)."""
        return bool(self.starts[:, 0].any())


def word_program(pattern: re.Pattern[str]) -> WordProgram | None:
    """``pattern``'s program, or None where it uses what the program does not run."""
    if re_parser is None or pattern.flags & ~(re.UNICODE | re.IGNORECASE):
        return None
    try:
        parsed = re_parser.parse(pattern.pattern, pattern.flags)
        alternatives = _alternatives(parsed.data, ignore_case=bool(pattern.flags & re.IGNORECASE))
    except (_Refused, re.error, RecursionError):
        return None
    if not alternatives or any(_can_be_empty(alternative) for alternative in alternatives):
        return None  # findall's empty matches: not worth running here
    if not all(_runnable(alternative) for alternative in alternatives):
        return None
    return _program(alternatives)


def _alternatives(nodes: Sequence[Any], *, ignore_case: bool) -> list[list[Item]]:
    """A parsed sequence as the flat alternatives it is, in ``re``'s order of trying them."""
    alternatives: list[list[Item]] = [[]]
    for op, argument in nodes:
        if op in _ONE_CHARACTER:
            alternatives = [alternative + [_repeat((op, argument), 1, 1, ignore_case)] for alternative in alternatives]
        elif op is re_constants.MAX_REPEAT and (argument[0], argument[1]) == (0, 1) and not _one_character(argument[2]):
            item = _optional_suffix(argument[2], ignore_case)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op is re_constants.MAX_REPEAT:
            least, most, repeated = argument
            if not _one_character(repeated):
                raise _Refused("a repeat of more than one character")
            most = UNBOUNDED if most is re_constants.MAXREPEAT else most
            item = _repeat(repeated.data[0], least, most, ignore_case)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op in (re_constants.ASSERT, re_constants.ASSERT_NOT):
            item = _lookahead(op, argument, ignore_case)
            alternatives = [alternative + [item] for alternative in alternatives]
        elif op is re_constants.SUBPATTERN:
            group, add_flags, del_flags, inner = argument
            if group is not None:
                raise _Refused("a capturing group changes what findall returns")
            if (add_flags | del_flags) & ~re.IGNORECASE:
                raise _Refused("a group's flags other than (?i)")
            inner_case = (ignore_case or bool(add_flags & re.IGNORECASE)) and not del_flags & re.IGNORECASE
            alternatives = _followed_by(alternatives, _alternatives(inner.data, ignore_case=inner_case))
        elif op is re_constants.BRANCH:
            _, branches = argument
            inner_alternatives = [
                alternative
                for branch in branches
                for alternative in _alternatives(branch.data, ignore_case=ignore_case)
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


def _optional_suffix(group: Any, ignore_case: bool) -> Item:
    """``(?:...)?`` of fixed strings, as o200k ends its letters with ``(?i:'s|'t|...)?``; the
    program runs it only last in an alternative (:func:`_program` checks), where ``re``
    takes the first string that follows, or none, and never comes back to it."""
    strings = _alternatives(group.data, ignore_case=ignore_case)
    if any(item.kind != ITEM_REPEAT or item.least != 1 or item.most != 1 for string in strings for item in string):
        raise _Refused("an optional group of more than fixed strings")
    return Item(ITEM_OPTIONAL_SUFFIX, (False,) * ASCII, strings=tuple(tuple(i.members for i in s) for s in strings))


def _repeat(node: tuple[Any, Any], least: int, most: int, ignore_case: bool) -> Item:
    return Item(ITEM_REPEAT, _members(node, ignore_case), least, most)


def _lookahead(op: Any, argument: Any, ignore_case: bool) -> Item:
    direction, inner = argument
    if direction != 1:
        raise _Refused("a lookbehind")
    if not inner.data:  # (?!) never matches; (?=) always does
        if op is re_constants.ASSERT_NOT:
            return Item(ITEM_FAIL, (False,) * ASCII)
        return Item(ITEM_NOT_FOLLOWED_BY, (False,) * ASCII)
    if len(inner.data) != 1 or inner.data[0][0] not in _ONE_CHARACTER:
        raise _Refused("a lookahead of more than one character")
    kind = ITEM_NOT_FOLLOWED_BY if op is re_constants.ASSERT_NOT else ITEM_FOLLOWED_BY
    return Item(kind, _members(inner.data[0], ignore_case))


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


def _program(alternatives: list[list[Item]]) -> WordProgram:
    classes: list[Members] = []
    rows: list[tuple[int, int, int, int]] = []
    ends: list[int] = []
    suffixes: list[list[int]] = []
    starts = np.zeros((ASCII, len(alternatives) + 1), dtype=np.int64)
    for number, alternative in enumerate(alternatives):
        for item in alternative:
            if item.kind == ITEM_OPTIONAL_SUFFIX:
                rows.append((item.kind, len(suffixes), len(item.strings), 0))
                for string in item.strings:
                    suffixes.append([len(string), *range(len(classes), len(classes) + len(string))])
                    classes += string
            else:
                rows.append((item.kind, len(classes), item.least, item.most))
                classes.append(item.members)
        ends.append(len(rows))
        for character in _first_characters(alternative):
            starts[character, 0] += 1
            starts[character, starts[character, 0]] = number
    longest = max((len(suffix) for suffix in suffixes), default=1)
    return WordProgram(
        classes=np.array(classes, dtype=np.uint8).reshape(-1, ASCII),
        items=np.array(rows, dtype=np.int64).reshape(-1, 4),
        ends=np.array(ends, dtype=np.int64),
        starts=starts,
        suffixes=np.array([suffix + [0] * (longest - len(suffix)) for suffix in suffixes], dtype=np.int64).reshape(
            -1, longest
        ),
    )


def _first_characters(alternative: list[Item]) -> list[int]:
    """The characters a match of ``alternative`` can begin with (a superset: the others
    need not be tried there)."""
    possible = [False] * ASCII
    for item in alternative:
        if item.kind == ITEM_FAIL:
            break
        if item.kind == ITEM_OPTIONAL_SUFFIX:  # (last: the alternative cannot be empty, so unreached)
            break
        if item.kind != ITEM_REPEAT:
            continue  # a lookahead reads without taking: the next item takes the first character
        possible = [either or member for either, member in zip(possible, item.members, strict=True)]
        if item.least > 0:
            break
    return [character for character in range(ASCII) if possible[character]]


_ONE_CHARACTER = (
    frozenset({re_constants.LITERAL, re_constants.NOT_LITERAL, re_constants.IN, re_constants.ANY})
    if re_parser is not None
    else frozenset()
)
