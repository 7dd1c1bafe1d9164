"""Short chats rendered without the template engine: one skeleton per conversation shape.

A chat of a few plain messages (a role and a text each) costs ~10-30 us per request to
convert and render through the model's Jinja template in its sandbox. Under a template
whose output depends on a text only by printing it (as it is, trimmed or stripped) and
otherwise only on its type, its truth and tests the texts answer no to
(:func:`~kvroute.tokenizer_index.template_verbatim.verbatim_check`), that render is fixed
by the roles, which texts are empty, the generation flag and (where the template writes
it) today's date: the texts only fill slots. So each such *shape* is rendered once with
marked texts and cut at the marks into literal segments and slots (:class:`Skeleton`); a
request of that shape is the segments joined with its texts.

Exact by three checks: the syntax check; at build, a second render with other marks (of
other lengths) must equal the skeleton filled with them; and every
:data:`VERIFY_EVERY`-th filled render is compared with the whole render, a template that
differed then renders whole from then on (and the log says so). Texts the template's
verdict does not admit render whole (only whitespace, whose trimmed text would be empty,
which the shape does not record; one that answers yes to a test; one with whitespace at
an end under a template that strips); so do messages with any other field not null,
conversations of :data:`~kvroute.tokenizer_index.render_memo.MIN_MESSAGES` or more (the
render memo's), templates whose content format is a list of parts, and requests with
tools, documents, template keywords or ``continue_final_message`` (the tokenizer's caller
decides).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError, strftime_now
from kvroute.tokenizer_index.template_verbatim import PLAIN_ROLES, Verbatim, verbatim_check

log = logging.getLogger(__name__)

#: Every this many filled renders, one is compared with the whole render.
VERIFY_EVERY = 128
#: Shapes remembered per renderer (a shape's skeleton is the template's own text, ~1 KB).
MAX_SHAPES = 1024
# Marks: private-use characters no template writes, and around them a space str.strip()
# (and Jinja's trim) removes, so a trimmed slot shows as the bare mark.
_PAD = "\u2003"
_MARK = re.compile("(\u2003?)\ue000([0-9]+)\ue001(\u2003?)")
_MARK_CHARACTERS = re.compile("[\ue000-\ue003]")


#: A shape not built yet (None: built, and no skeleton).
_UNBUILT: Any = object()


@dataclass(frozen=True, slots=True)
class Skeleton:
    """A shape's render cut at its texts: ``head``, then per slot a message's text (trimmed
    or as it is) and the literal text after it."""

    head: str
    #: (message index, trimmed, the text after it)
    slots: tuple[tuple[int, bool, str], ...]

    @classmethod
    def cut(cls, rendered: str, filled: Sequence[bool]) -> Skeleton | None:
        """The skeleton of ``rendered``, a render of :func:`marked` texts; None where a mark
        is not whole (the template cut into it) or names an empty message."""
        slots: list[tuple[int, bool, str]] = []
        head = ""
        start = 0
        pending: tuple[int, bool] | None = None
        for match in _MARK.finditer(rendered):
            before, number, after = match.groups()
            index = int(number)
            if bool(before) != bool(after) or index >= len(filled) or not filled[index]:
                return None
            literal = rendered[start : match.start()]
            if pending is None:
                head = literal
            else:
                slots.append((*pending, literal))
            pending = (index, not before)
            start = match.end()
        tail = rendered[start:]
        if pending is None:
            head = tail
        else:
            slots.append((*pending, tail))
        if _MARK_CHARACTERS.search(head) or any(_MARK_CHARACTERS.search(text) for _, _, text in slots):
            return None
        return cls(head, tuple(slots))

    def fill(self, texts: Sequence[str]) -> str:
        parts = [self.head]
        for index, trimmed, literal in self.slots:
            text = texts[index]
            parts.append(text.strip() if trimmed else text)
            parts.append(literal)
        return "".join(parts)


def _null_fields(message: dict[str, Any]) -> tuple[str, ...] | None:
    """The fields of ``message`` besides its role and text, where every one is null (None
    otherwise): such a message fills the skeleton of the same fields, set to null."""
    fields = [key for key in message if key != "role" and key != "content"]
    if any(type(key) is not str or message[key] is not None for key in fields):
        return None
    return tuple(sorted(fields))


def _clock_texts(formats: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(strftime_now(format) for format in formats) if formats else ()


def marked(index: int) -> str:
    """The text that stands for message ``index``'s in a skeleton's build render."""
    return f"{_PAD}\ue000{index}\ue001{_PAD}"


def _checking(index: int) -> str:
    """Another stand-in, of another length, for the build's second render (no whitespace
    at its ends: a template that strips texts fills skeletons only with such)."""
    return f"\ue002{'x' * (index % 3 + 1)} {index}\ue003"


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
        # Per template source: what its syntax allows.
        self._verdicts: dict[str, Verbatim] = {}
        self._skeletons: OrderedDict[tuple[object, ...], Skeleton | None] = OrderedDict()
        self._filled = 0
        self._mismatches = 0

    def refusal(self, template: ChatTemplate) -> str | None:
        """Why ``template`` renders whole (checked at its first use); None if it need not."""
        return self._verdict(template).refusal

    def _verdict(self, template: ChatTemplate) -> Verbatim:
        source = template.source
        verdict = self._verdicts.get(source)
        if verdict is None:
            verdict = verbatim_check(template.syntax_tree)
            if verdict.refusal is None and template.content_format != "string":
                verdict = Verbatim("the template reads a message's content as a list of parts")
            if verdict.refusal is None and _MARK_CHARACTERS.search(source):
                verdict = Verbatim("the template writes the skeletons' mark characters")
            if verdict.refusal is not None:
                log.debug("chat template renders short chats whole: %s", verdict.refusal)
            self._verdicts[source] = verdict
        return verdict

    def render(
        self,
        messages: Sequence[Any],
        template: ChatTemplate,
        add_generation_prompt: bool,
        render_whole: Callable[[Sequence[Any]], str],
    ) -> str | None:
        """``messages`` rendered from their shape's skeleton; None where they are not plain
        (or the template, or this shape, cannot be): then the caller renders whole.
        ``render_whole`` renders OpenAI messages with the same settings."""
        if type(messages) is not list:
            return None
        verdict = self._verdict(template)
        if verdict.refusal is not None:
            return None
        shape: list[object] = []
        texts: list[str] = []
        for message in messages:
            if type(message) is not dict:
                return None
            role = message.get("role")
            text = message.get("content")
            if type(role) is not str or role not in PLAIN_ROLES or type(text) is not str or not verdict.admits(text):
                return None
            kind: object = role if text else role + ":empty"
            if len(message) != 2:  # fields set to null, as clients dump SDK messages: in the shape
                nulls = _null_fields(message)
                if nulls is None:
                    return None
                kind = (kind, nulls)
            shape.append(kind)
            texts.append(text)
        clock = _clock_texts(verdict.clock_formats)
        key = (template.source, add_generation_prompt, tuple(shape), clock)
        skeletons = self._skeletons
        skeleton = skeletons.get(key, _UNBUILT)
        if skeleton is _UNBUILT:
            skeleton = self._build(messages, render_whole, verdict)
            if _clock_texts(verdict.clock_formats) != clock:
                return None  # the day changed during the build: the next request builds again
            skeletons[key] = skeleton
            if len(skeletons) > self._max_shapes:
                with suppress(KeyError):  # (another thread, a prepare in a worker, emptied it)
                    skeletons.popitem(last=False)
        else:
            with suppress(KeyError):  # (another thread dropped it meanwhile)
                skeletons.move_to_end(key)
        if skeleton is None:
            return None
        text = skeleton.fill(texts)
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
        self, messages: Sequence[Any], render_whole: Callable[[Sequence[Any]], str], verdict: Verbatim
    ) -> Skeleton | None:
        filled = [bool(message["content"]) for message in messages]
        if any(
            verdict.answers_yes(stand_in(index)) for index in range(len(messages)) for stand_in in (marked, _checking)
        ):
            return None  # a test the texts must answer no to says yes to a stand-in

        def standing_in(text: Callable[[int], str]) -> list[dict[str, Any]]:
            return [
                {**message, "content": text(index) if filled[index] else ""} for index, message in enumerate(messages)
            ]

        try:
            skeleton = Skeleton.cut(render_whole(standing_in(marked)), filled)
            checking = standing_in(_checking)
            if skeleton is not None and skeleton.fill([item["content"] for item in checking]) != render_whole(checking):
                return None
        except ChatTemplateError:  # the template refuses this shape: so it will the request
            return None
        return skeleton

    def _distrust(self, template: ChatTemplate) -> None:
        self._mismatches += 1
        self._verdicts[template.source] = Verbatim("a chat filled into a skeleton differed from its whole render")
        self._skeletons.clear()
        log.error(
            "chat template: a short chat filled into its skeleton differed from its whole render; "
            "rendering every short chat whole under this template from now on"
        )
