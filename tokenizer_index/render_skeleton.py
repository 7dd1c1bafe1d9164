"""Short chats rendered without the template engine: one skeleton per conversation shape.

A chat of a few plain messages (a role and a text each) costs ~10-30 us per request to
convert and render through the model's Jinja template in its sandbox; an agent's, whose
turns are tool calls and tool results, ~20-70 us. Under a template whose output depends
on a text only by printing it (as it is, trimmed or stripped, or as ``tojson`` writes it)
and otherwise only on its type, its truth and tests the texts answer no to, and on a tool
call's arguments only by printing them (through ``tojson`` or as Python writes them) or
by iterating them and printing each value so
(:func:`~kvroute.tokenizer_index.template_verbatim.verbatim_check`), that render is fixed
by the roles, the fields present, the tool calls' keys and arguments' types (and, under a
template that iterates them, the arguments' keys and their values' types: Qwen 3 Coder's
``<parameter=key>``), which slots are empty, the generation flag and (where the template
writes it) today's date: the values only fill slots. So each such *shape* is rendered
once with marked values and cut at the marks into literal segments and slots
(:class:`Skeleton`); a request of that shape is the segments joined with its values: its
texts (a message's, a tool result's call id, a call's id, type and function name), each
as the template wrote its mark (as it is, trimmed, through ``tojson``), and its calls'
arguments (or each of their values) as ``tojson`` or ``str()`` writes them once parsed as
vLLM parses them (an agent re-sends every earlier call: parsed and written once,
:data:`_REMEMBERED_ARGUMENTS_CHARS`).

Exact by three checks: the syntax check; at build, a second render with other marks (of
other lengths) must equal the skeleton filled with them; and every
:data:`VERIFY_EVERY`-th filled render is compared with the whole render, a template that
differed then renders whole from then on (and the log says so). Texts the template's
verdict does not admit render whole (only whitespace, whose trimmed text would be empty,
which the shape does not record; one that answers yes to a test; under a template that
strips the characters it names, such as Qwen 3's ``lstrip('\\n')``, one with such a
character at an end a strip reaches in its shape, found at build by a render per character
with it around every mark; a strip of every whitespace character, ``strip()``, takes the
marks' pads off at build, so such a slot is filled trimmed); so do messages with any other field not null (a tool call with fields
besides ``id``, ``type`` and ``function``, arguments that are no text, object or list),
content sent as parts, conversations of
:data:`~kvroute.tokenizer_index.render_memo.MIN_MESSAGES` or more (the render memo's),
chats with tool calls or results under a template whose content format is a list of
parts that reads a content without telling a tool result's (a text) from another
message's (Gemma 3's, Llama 4's: their plain chats fill skeletons, each text one part;
GLM's tells them apart by role, and its agents' chats fill too), and requests with documents, template keywords or ``continue_final_message`` (the
tokenizer's caller decides). A request's tools join the shape's key as their JSON (an
agent sends the same ones with every turn).
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any, ClassVar

import orjson

from kvroute.tokenizer_index.chat_messages import parse_arguments
from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError, DumpedAs, strftime_now, tojson
from kvroute.tokenizer_index.messages_key import EXACT_JSON
from kvroute.tokenizer_index.template_verbatim import PLAIN_ROLES, Verbatim, verbatim_check

log = logging.getLogger(__name__)

#: Every this many filled renders, one is compared with the whole render.
VERIFY_EVERY = 128
#: Shapes remembered per renderer (a shape's skeleton is the template's own text, ~1 KB).
MAX_SHAPES = 1024
# Marks: private-use characters no template writes, and around them a space str.strip()
# (and Jinja's trim) removes, so a trimmed slot shows as the bare mark. Inside, a control
# character JSON escapes, so a slot printed through ``tojson`` shows as such; and others
# for a value that is no text (a tool call's arguments, an argument's value), which the
# ``tojson`` filter prints whole, and ``str()`` too (:class:`_MarkedObject`).
_PAD = "\u2003"
_TEXT = "\x01"
_DUMPED_TEXT = "\\u0001"
_DUMPED_OBJECT = "\x02"
_PYTHON_OBJECT = "\x03"
_MARK = re.compile("(\u2003?)\ue000([0-9]+)(\x01|\\\\u0001|\x02|\x03)\ue001(\u2003?)")
_BARE_MARK = re.compile("\ue000([0-9]+)(\x01|\\\\u0001|\x02|\x03)\ue001")
_MARK_CHARACTERS = re.compile("[\ue000-\ue003]")


#: How a slot's value is written: a text as it is, trimmed (``trim``, ``strip()``), either
#: as ``tojson`` writes it (without its quotes); a value that is no text (a tool call's
#: arguments, an argument's value) through ``tojson``, or as Python's ``str()`` writes it.
AS_IS, TRIMMED, DUMPED, OBJECT, PYTHON = 0, 1, 2, 4, 8

#: A shape not built yet (None: built, and no skeleton).
_UNBUILT: Any = object()


@dataclass(frozen=True, slots=True)
class Skeleton:
    """A shape's render cut at its slots: ``head``, then per slot its value (a text trimmed
    or as it is, either as ``tojson`` prints it or not; arguments as ``tojson`` prints
    them) and the literal text after it."""

    head: str
    #: (slot, how its value is written: :data:`AS_IS`..., the text after it)
    slots: tuple[tuple[int, int, str], ...]
    #: (slot, the characters a strip takes off its text's start, and off its end) for the
    #: slots a template's named strips reach (``content.lstrip('\n')``): a text with one
    #: of those there does not fill the skeleton (:meth:`keeps`).
    stripped: tuple[tuple[int, str, str], ...] = ()

    @classmethod
    def cut(cls, rendered: str, filled: Sequence[bool], objects: Sequence[bool] = ()) -> Skeleton | None:
        """The skeleton of ``rendered``, a render of :func:`marked` texts (and
        :class:`_MarkedObject` arguments where ``objects`` says so); None where a mark is
        not whole (the template cut into it), names an empty slot, or shows a text as an
        object or an object as a text."""
        slots: list[tuple[int, int, str]] = []
        head = ""
        start = 0
        pending: tuple[int, int] | None = None
        for match in _MARK.finditer(rendered):
            before, number, kind, after = match.groups()
            index = int(number)
            if bool(before) != bool(after) or index >= len(filled) or not filled[index]:
                return None
            is_object = index < len(objects) and objects[index]
            if (kind == _DUMPED_OBJECT or kind == _PYTHON_OBJECT) != is_object:
                return None
            literal = rendered[start : match.start()]
            if pending is None:
                head = literal
            else:
                slots.append((*pending, literal))
            if is_object:
                mode = OBJECT if kind == _DUMPED_OBJECT else PYTHON
            else:
                mode = (TRIMMED if not before else AS_IS) | (DUMPED if kind == _DUMPED_TEXT else 0)
            pending = (index, mode)
            start = match.end()
        tail = rendered[start:]
        if pending is None:
            head = tail
        else:
            slots.append((*pending, tail))
        if _MARK_CHARACTERS.search(head) or any(_MARK_CHARACTERS.search(text) for _, _, text in slots):
            return None
        return cls(head, tuple(slots))

    def keeps(self, values: Sequence[Any]) -> bool:
        """Whether no strip the template applies would take an end off one of ``values``."""
        for index, start, end in self.stripped:
            text = values[index]
            if text and (text[0] in start or text[-1] in end):
                return False
        return True

    def lost_pads(self, rendered: str, pad: str) -> list[tuple[bool, bool]] | None:
        """Per slot, whether ``rendered``, a render of marks with ``pad`` at both ends
        (:func:`marked`), lost that pad at the mark's start and at its end; None where it is
        not this skeleton's render. Where the text between two marks could have kept either
        mark's pad, both count as lost."""
        count = len(self.slots)
        marks = list(_BARE_MARK.finditer(rendered))
        if [(int(mark[1]), mark[2]) for mark in marks] != [(index, _kind(mode)) for index, mode, _ in self.slots]:
            return None
        dumped = tojson(pad)[1:-1]
        pads = ["" if mode >= OBJECT else dumped if mode & DUMPED else pad for _, mode, _ in self.slots]
        bounds = [0, *(end for mark in marks for end in mark.span()), len(rendered)]
        gaps = [rendered[bounds[at] : bounds[at + 1]] for at in range(0, len(bounds), 2)]
        literals = [self.head, *(literal for _, _, literal in self.slots)]
        kept_start, kept_end = [True] * count, [True] * count
        for at, gap in enumerate(gaps):  # (the end pad of the slot before, its literal, the start pad of the next)
            before = (pads[at - 1], "") if at else ("",)
            after = (pads[at], "") if at < count else ("",)
            found = [(one, other) for one in before for other in after if one + literals[at] + other == gap]
            if not found:
                return None
            if at:
                kept_end[at - 1] = all(one for one, _ in found)
            if at < count:
                kept_start[at] = all(other for _, other in found)
        return [(not start, not end) for start, end in zip(kept_start, kept_end, strict=True)]

    def fill(self, values: Sequence[Any]) -> str:
        parts = [self.head]
        for index, mode, literal in self.slots:
            value = values[index]
            if mode:  # (AS_IS the common case, kept fast)
                value = value.strip() if mode == TRIMMED else _written(value, mode)
            parts.append(value)
            parts.append(literal)
        return "".join(parts)


def _kind(mode: int) -> str:
    """The character inside a mark written in ``mode`` (as the render shows it)."""
    if mode >= OBJECT:
        return _DUMPED_OBJECT if mode == OBJECT else _PYTHON_OBJECT
    return _DUMPED_TEXT if mode & DUMPED else _TEXT


def _written(value: Any, mode: int) -> str:
    if mode == OBJECT:
        return value.json  # type: ignore[no-any-return]
    if mode == PYTHON:
        return str(value.value)
    return tojson(value.strip() if mode & TRIMMED else value)[1:-1]  # (the quotes are the template's)


def _object_mark(slot: int, kind: str) -> str:
    return f"\ue000{slot}{kind}\ue001"


class _Marked(DumpedAs):
    """A stand-in for a value that is no text in a build render: ``tojson`` prints one mark
    of its slot, ``str()`` another (first among its bases, so before the value's own)."""

    slot: int

    def _mark(self, slot: int) -> None:
        self.slot = slot
        self.json_text = _object_mark(slot, _DUMPED_OBJECT)

    def __str__(self) -> str:
        return _object_mark(self.slot, _PYTHON_OBJECT)

    __repr__ = __str__


class _MarkedObject(_Marked, dict[str, Any]):
    """Stands for a tool call's arguments (an object), or an argument's value, in a build render."""

    def __init__(self, slot: int, items: dict[str, Any] | None = None) -> None:
        super().__init__(items or {"slot": slot})  # (not empty: a template may test its truth)
        self._mark(slot)


class _MarkedList(_Marked, list[Any]):
    """:class:`_MarkedObject` for a list."""

    def __init__(self, slot: int) -> None:
        super().__init__([slot])
        self._mark(slot)


class _MarkedNumber(_Marked):
    """:class:`_MarkedObject` for an argument's number (not zero, whose value is in the
    shape): a number of the same type, :attr:`stand_in`."""

    stand_in: ClassVar[float]

    def __new__(cls, slot: int) -> Any:
        number = super().__new__(cls, cls.stand_in)  # type: ignore[call-arg]
        number._mark(slot)
        return number


class _MarkedInt(_MarkedNumber, int):
    stand_in = 1


class _MarkedFloat(_MarkedNumber, float):
    stand_in = 0.5


#: An argument's key, its value's type, and whether it is empty (or the value itself, where
#: it is true, false, null or a zero).
_EntryKind = tuple[str, type, object]


class _Arguments:
    """A value that is no text: a tool call's arguments (an object or a list) or one of
    their values, as the template sees it, and as ``tojson`` writes it."""

    __slots__ = ("_entries", "_items", "empty", "json", "kind", "value")

    def __init__(self, json: str, kind: type, empty: bool, value: Any) -> None:
        self.json = json
        self.kind = kind
        self.empty = empty
        self.value = value
        self._entries: tuple[tuple[_EntryKind, ...], tuple[Any, ...]] | None = None
        self._items: _ArgumentItems | None = None

    def __bool__(self) -> bool:
        return not self.empty

    def as_items(self) -> _ArgumentItems:
        """These arguments (an object) as a template that iterates them sees them; made
        once (an agent re-sends its calls)."""
        if self._items is None:
            items = _ArgumentItems(self.json, self.kind, self.empty, self.value)
            items._entries = self.entries()
            self._items = items
        return self._items

    def entries(self) -> tuple[tuple[_EntryKind, ...], tuple[Any, ...]]:
        """An object's keys and its values' kinds (the shape), and its values as slots
        (texts, or :class:`_Arguments`); worked out once (an agent re-sends its calls)."""
        if self._entries is None:
            shape: list[_EntryKind] = []
            values: list[Any] = []
            for key, value in self.value.items():
                kind = type(value)
                if kind is str:
                    shape.append((key, str, not value))
                    values.append(value)
                    continue
                if kind is dict or kind is list or ((kind is int or kind is float) and value):
                    shape.append((key, kind, not value))
                else:  # True, False, None, a zero: its value joins the shape
                    shape.append((key, kind, repr(value)))
                values.append(_Arguments(tojson(value), kind, not value, value))
            self._entries = (tuple(shape), tuple(values))
        return self._entries


class _ArgumentItems(_Arguments):
    """A call's arguments (an object) under a template that iterates them: its keys join
    the shape, its values are slots of their own (:meth:`_Arguments.as_items`)."""

    __slots__ = ()


def _arguments(raw: str) -> str | _Arguments | None:
    """What the template sees of arguments sent as ``raw`` JSON: a text, an object or a
    list (as vLLM parses them: invalid JSON is an empty object); None for other values."""
    try:
        value = parse_arguments(raw)
    except json.JSONDecodeError:
        value = {}
    except ValueError:  # nested too deeply: the whole render says why
        return None
    if type(value) is str:
        return value
    if type(value) is not dict and type(value) is not list:
        return None
    try:
        dumped = tojson(value)
    except RecursionError:  # nested past what the encoder writes: the whole render says why
        return None
    return _Arguments(dumped, type(value), not value, value)


#: An agent's chat re-sends every earlier turn's calls: their arguments are parsed and
#: dumped once (~1.8 us each), those up to this long.
_REMEMBERED_ARGUMENTS_CHARS = 1024
_remembered_arguments = lru_cache(maxsize=8192)(_arguments)


#: A tool call's fields and its function's that a skeleton fills (others: the message renders whole).
_CALL_KEYS = frozenset({"id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})
_USUAL_CALL = ("id", "type", "function")
_USUAL_FUNCTION = ("name", "arguments")
#: Where a slot's value is: the message's number and the keys (and indexes) down to it.
Place = tuple[int, tuple[str | int, ...]]


def _scan(
    messages: Sequence[Any], places: list[Place] | None = None, *, items: bool = False
) -> tuple[list[object], list[Any], bool] | None:
    """``messages``' shape, their slots' values (as the template sees them; where each
    is, into ``places``) and whether one is a tool result or has tool calls; None where a
    message is not one a skeleton fills. ``items``: the template iterates tool calls'
    arguments (:attr:`Verbatim.argument_items`), whose keys then join the shape."""
    shape: list[object] = []
    values: list[Any] = []
    tools = False
    for message in messages:
        if type(message) is not dict:
            return None
        role = message.get("role")
        text = message.get("content")
        if len(message) == 2 and type(text) is str and type(role) is str and role in PLAIN_ROLES:
            if places is not None:
                places.append((len(shape), ("content",)))
            shape.append(role if text else role + ":empty")  # (the common case, kept fast)
            values.append(text)
            continue
        kind = _scan_message(message, len(shape), values, places, items)
        if kind is None:
            return None
        shape.append(tuple(kind))
        tools = tools or role == "tool" or kind[1] is True
    return shape, values, tools


def _scan_message(
    message: dict[str, Any], number: int, values: list[Any], places: list[Place] | None, items: bool = False
) -> list[object] | None:
    """The shape of a message other than a role and a text: its role, null fields, which
    slots are empty (templates test their truth), its tool calls' keys and arguments'
    types; its values into the slots. None where it is not one a skeleton fills."""
    role = message.get("role")
    text = message.get("content")
    if type(role) is not str or (role not in PLAIN_ROLES and role != "tool"):
        return None
    calls = message.get("tool_calls") if role == "assistant" else None
    call_id = message.get("tool_call_id") if role == "tool" else None
    if type(text) is not str:
        if text is not None or calls is None:
            return None
        text = ""  # an assistant's tool calls without a text: the template sees ""
    kind: list[object] = [role, calls is not None, not text]
    values.append(text)
    if places is not None:
        places.append((number, ("content",)))
    if call_id is not None:
        if type(call_id) is not str:
            return None
        kind.append(not call_id)
        values.append(call_id)
        if places is not None:
            places.append((number, ("tool_call_id",)))
    known = 1 + ("content" in message) + (calls is not None) + (call_id is not None)
    if len(message) > known:  # fields set to null, as clients dump SDK messages: in the shape
        filled = ("tool_calls" if calls is not None else "role", "tool_call_id" if call_id is not None else "role")
        nulls = [key for key in message if key != "role" and key != "content" and key not in filled]
        if any(type(key) is not str or message[key] is not None for key in nulls):
            return None
        kind.append(frozenset(nulls))  # (a set: never equal to a call's keys in a shape)
    if calls is None:
        return kind
    if type(calls) is not list or not calls:
        return None
    for index, call in enumerate(calls):
        if type(call) is not dict:
            return None
        call_keys = tuple(call)
        function = call.get("function")
        if type(function) is not dict or (call_keys != _USUAL_CALL and not _CALL_KEYS.issuperset(call_keys)):
            return None
        function_keys = tuple(function)
        if function_keys != _USUAL_FUNCTION and not _FUNCTION_KEYS.issuperset(function_keys):
            return None
        name, raw = function.get("name"), function.get("arguments")
        if type(name) is not str or type(raw) is not str:
            return None
        arguments = _remembered_arguments(raw) if len(raw) <= _REMEMBERED_ARGUMENTS_CHARS else _arguments(raw)
        if arguments is None:
            return None
        kind += (call_keys, function_keys, type(arguments), not arguments, not name)
        for key in call_keys:  # its id and type, in the order sent
            if key != "function":
                field = call[key]
                if type(field) is not str:
                    return None
                kind.append(not field)
                values.append(field)
                if places is not None:
                    places.append((number, ("tool_calls", index, key)))
        values.append(name)
        if places is not None:
            places.append((number, ("tool_calls", index, "function", "name")))
            places.append((number, ("tool_calls", index, "function", "arguments")))
        if items and type(arguments) is _Arguments and arguments.kind is dict and not arguments.empty:
            arguments = arguments.as_items()
            entries, entry_values = arguments.entries()
            kind.append(entries)
            values.append(arguments)
            values.extend(entry_values)
            if places is not None:  # (each into the arguments' stand-in, placed just before)
                places.extend((number, ("tool_calls", index, "function", "arguments", key)) for key, _, _ in entries)
        else:
            values.append(arguments)
    return kind


def _standing_in(
    messages: Sequence[dict[str, Any]],
    places: Sequence[Place],
    values: Sequence[Any],
    stand_in: Callable[[int, Any], Any],
) -> list[dict[str, Any]]:
    """Copies of ``messages`` with each slot's value replaced by ``stand_in(slot, value)``
    (a value as the template sees it: arguments are written back as JSON text, or kept
    as an object, which the conversion keeps)."""
    copies = []
    for message in messages:
        copy = dict(message)
        if copy.get("tool_calls") is not None and copy.get("role") == "assistant":
            copy["tool_calls"] = [{**call, "function": dict(call["function"])} for call in copy["tool_calls"]]
        copies.append(copy)
    for slot, (number, place) in enumerate(places):
        value = stand_in(slot, values[slot])
        if len(place) == 4 and place[-1] == "arguments" and type(value) is str:
            value = tojson(value)  # (parsed back by the conversion)
        container: Any = copies[number]
        for step in place[:-1]:
            container = container[step]
        container[place[-1]] = value
    return copies


def _stripped_slots(
    skeleton: Skeleton,
    messages: Sequence[dict[str, Any]],
    places: Sequence[Place],
    values: Sequence[Any],
    render_whole: Callable[[Sequence[Any]], str],
    characters: str,
) -> tuple[tuple[int, str, str], ...]:
    """Per slot that a strip of one of ``characters`` reaches, the characters taken off
    its start and its end (:attr:`Skeleton.stripped`): found by rendering the shape once per
    character with that character at both ends of every mark. Where such a render is not
    the skeleton's (a test says yes to the character), every slot counts as stripped of
    it. Trimmed slots are left out: their fill strips every whitespace character."""
    start: dict[int, str] = {}
    end: dict[int, str] = {}
    for character in characters:
        try:
            padded = _standing_in(messages, places, values, partial(_marked_value, pad=character))
            lost = skeleton.lost_pads(render_whole(padded), character)
        except ChatTemplateError:
            lost = None
        for (index, mode, _), (lost_start, lost_end) in zip(
            skeleton.slots, lost or [(True, True)] * len(skeleton.slots), strict=True
        ):
            if mode & TRIMMED or mode >= OBJECT:
                continue
            if lost_start:
                start[index] = start.get(index, "") + character
            if lost_end:
                end[index] = end.get(index, "") + character
    return tuple((index, start.get(index, ""), end.get(index, "")) for index in sorted(start.keys() | end.keys()))


def _clock_texts(formats: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(strftime_now(format) for format in formats) if formats else ()


def marked(index: int, pad: str = _PAD) -> str:
    """The text that stands for slot ``index``'s in a skeleton's build render (``pad``
    at its ends: another one finds where a template strips it)."""
    return f"{pad}\ue000{index}{_TEXT}\ue001{pad}"


def _checking(index: int) -> str:
    """Another stand-in, of another length, for the build's second render (no whitespace
    at its ends, which a strip would take off and the skeleton's fill would not; a quote,
    which ``tojson`` escapes)."""
    return f'\ue002{"x" * (index % 3 + 1)}" {index}\ue003'


def _marked_value(slot: int, value: str | _Arguments, pad: str = _PAD) -> Any:
    """What stands for a slot's value in the build render (as the template sees it)."""
    if type(value) is str:
        return marked(slot, pad) if value else value
    assert isinstance(value, _Arguments)
    kind = value.kind
    if type(value) is _ArgumentItems:
        return _MarkedObject(slot, dict(value.value))  # (its values' own stand-ins go in next)
    if _held_by_shape(value):
        return kind() if value.empty and (kind is dict or kind is list) else value.value
    if kind is dict:
        return _MarkedObject(slot)
    if kind is list:
        return _MarkedList(slot)
    return _MarkedInt(slot) if kind is int else _MarkedFloat(slot)


def _checking_value(slot: int, value: str | _Arguments) -> Any:
    """Another value for the build's second render, as the template sees it."""
    if type(value) is str:
        return _checking(slot) if value else value
    assert isinstance(value, _Arguments)
    kind = value.kind
    if type(value) is _ArgumentItems:
        return dict(value.value)
    if _held_by_shape(value):
        return kind() if value.empty and (kind is dict or kind is list) else value.value
    if kind is dict:
        return {"value": _checking(slot)}
    if kind is list:
        return [_checking(slot)]
    return 7 + slot if kind is int else 0.25 + slot


def _held_by_shape(value: _Arguments) -> bool:
    """Whether the shape holds ``value`` as it is: an empty object or list, true, false,
    null, a zero (a fresh empty object or list stands for it, the others for themselves)."""
    return value.empty or value.kind is bool or value.value is None


def _as_filled(value: Any) -> str | _Arguments:
    """A value the template sees as a slot holds it (arguments dumped)."""
    return value if type(value) is str else _Arguments(tojson(value), type(value), not value, value)


def tools_key(tools: Any) -> bytes | None:
    """A request's tools as a shape's key holds them: their exact JSON (b"" for none);
    None where JSON cannot stand for them exactly (then nothing fills a skeleton)."""
    if tools is None:
        return b""
    try:
        return orjson.dumps(tools, option=EXACT_JSON)
    except TypeError:
        return None


@dataclass(frozen=True, slots=True)
class SkeletonStats:
    #: Chats rendered by filling a skeleton.
    filled: int
    #: Filled renders that differed from the whole render when checked.
    mismatches: int


class SkeletonRenders:
    """Skeletons of short plain chats per template, flag and shape, at most ``max_shapes``."""

    def __init__(self, *, max_shapes: int = MAX_SHAPES, verify_every: int = VERIFY_EVERY) -> None:
        self._max_shapes = max_shapes
        self._verify_every = verify_every
        self._since_verified = 0
        # Per template source and whether chats with tool calls are asked of: what its syntax allows.
        self._verdicts: dict[tuple[str, bool], Verbatim] = {}
        self._skeletons: OrderedDict[tuple[object, ...], Skeleton | None] = OrderedDict()
        # Per template source: whether it iterates tool calls' arguments (their keys then join shapes).
        self._argument_items: dict[str, bool] = {}
        self._filled = 0
        self._mismatches = 0

    def refusal(self, template: ChatTemplate, *, tools: bool = False) -> str | None:
        """Why ``template`` renders short chats whole (with ``tools``: chats with tool calls
        or results), checked at its first use; None if it need not."""
        return self._verdict(template, tools).refusal

    def _verdict(self, template: ChatTemplate, tools: bool) -> Verbatim:
        source = template.source
        verdict = self._verdicts.get((source, tools))
        if verdict is None:
            verdict = verbatim_check(template.syntax_tree, tools=tools, parts=template.content_format == "openai")
            if verdict.refusal is None and _MARK_CHARACTERS.search(source):
                verdict = Verbatim("the template writes the skeletons' mark characters")
            if verdict.refusal is not None:
                log.debug("chat template renders short chats whole: %s", verdict.refusal)
            self._verdicts[(source, tools)] = verdict
        return verdict

    def render(
        self,
        messages: Sequence[Any],
        template: ChatTemplate,
        add_generation_prompt: bool,
        render_whole: Callable[[Sequence[Any]], str],
        tools_json: bytes = b"",
    ) -> str | None:
        """``messages`` rendered from their shape's skeleton; None where they are not plain
        (or the template, or this shape, cannot be): then the caller renders whole.
        ``render_whole`` renders OpenAI messages with the same settings, and the request's
        tools, whose exact JSON (:func:`tools_key`) joins the shape's key."""
        if type(messages) is not list:
            return None
        items = self._argument_items.get(template.source)
        if items is None:
            items = self._argument_items[template.source] = self._verdict(template, True).argument_items
        scanned = _scan(messages, items=items)
        if scanned is None:
            return None
        shape, values, tooled = scanned
        verdict = self._verdicts.get((template.source, tooled)) or self._verdict(template, tooled)
        if verdict.refusal is not None:
            return None
        if not verdict.admits_all(values if not tooled else [value for value in values if type(value) is str]):
            return None
        clock = _clock_texts(verdict.clock_formats)
        key = (template.source, add_generation_prompt, tuple(shape), clock, tools_json)
        skeletons = self._skeletons
        skeleton = skeletons.get(key, _UNBUILT)
        if skeleton is _UNBUILT:
            skeleton = self._build(messages, values, render_whole, verdict, items)
            if _clock_texts(verdict.clock_formats) != clock:
                return None  # the day changed during the build: the next request builds again
            skeletons[key] = skeleton
            if len(skeletons) > self._max_shapes:
                with suppress(KeyError):  # (another thread, a prepare in a worker, emptied it)
                    skeletons.popitem(last=False)
        else:
            with suppress(KeyError):  # (another thread dropped it meanwhile)
                skeletons.move_to_end(key)
        if skeleton is None or (skeleton.stripped and not skeleton.keeps(values)):
            return None
        text = skeleton.fill(values)
        self._filled += 1
        self._since_verified += 1  # (a race between threads only moves which one is checked)
        if self._since_verified >= self._verify_every:
            self._since_verified = 0
            if render_whole(messages) != text:
                self._distrust(template)
                return None
        return text

    def stats(self) -> SkeletonStats:
        return SkeletonStats(self._filled, self._mismatches)

    def clear(self) -> None:
        self._skeletons.clear()

    def _build(
        self,
        messages: Sequence[dict[str, Any]],
        values: list[Any],
        render_whole: Callable[[Sequence[Any]], str],
        verdict: Verbatim,
        items: bool,
    ) -> Skeleton | None:
        places: list[Place] = []
        _scan(messages, places, items=items)
        texts = [slot for slot, value in enumerate(values) if type(value) is str]
        if any(verdict.answers_yes(stand_in(slot)) for slot in texts for stand_in in (marked, _checking)):
            return None  # a test the texts must answer no to says yes to a stand-in
        filled = [bool(value) for value in values]
        objects = [isinstance(value, _Arguments) for value in values]
        try:
            marks = _standing_in(messages, places, values, _marked_value)
            skeleton = Skeleton.cut(render_whole(marks), filled, objects)
            checking = [_checking_value(slot, value) for slot, value in enumerate(values)]
            checked = render_whole(_standing_in(messages, places, checking, lambda _, value: value))
            # (after the render: an object's values went into it there)
            filled_checking = [_as_filled(value) for value in checking]
            if skeleton is not None and skeleton.fill(filled_checking) != checked:
                return None
        except ChatTemplateError:  # the template refuses this shape: so it will the request
            return None
        if skeleton is not None and verdict.strip_characters:
            stripped = _stripped_slots(skeleton, messages, places, values, render_whole, verdict.strip_characters)
            skeleton = replace(skeleton, stripped=stripped)
        return skeleton

    def _distrust(self, template: ChatTemplate) -> None:
        self._mismatches += 1
        for tools in (False, True):
            self._verdicts[(template.source, tools)] = Verbatim(
                "a chat filled into a skeleton differed from its whole render"
            )
        self._skeletons.clear()
        log.error(
            "chat template: a short chat filled into its skeleton differed from its whole render; "
            "rendering every short chat whole under this template from now on"
        )
