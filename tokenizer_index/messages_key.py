"""What the render memo compares a conversation's messages by: exactly, and cheaply for text beyond ASCII.

A render is reused only for messages equal, as JSON, to the ones it was made from
(:mod:`kvroute.tokenizer_index.render_memo`). orjson writes an agent's 100K-token history in
~35 us while its strings are ASCII, but it first copies each string that is not (a curly
quote, an accent, an emoji) to UTF-8, ~1 ns a character, and a request's strings are new
every time: ~0.4 ms a turn for such a history. Where a conversation's JSON is not ASCII its
key is therefore the JSON of the messages with each string ``content`` written as ``null``
and, beside it, those contents themselves, compared as ``str`` in their own encoding (a
memory comparison in C); every other value stays in the JSON.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

# JSON that stands for one Python value only: orjson refuses subclasses of str, int, dict
# and list, dataclasses and datetimes instead of writing them as their JSON look-alikes.
EXACT_JSON = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
_LIST_SEPARATORS = (ord(","), ord("]"))


@dataclass(frozen=True, slots=True)
class MessagesKey:
    """Messages as the memo compares them: their JSON, and, for a key made :meth:`apart`,
    per message its ``content`` where that is a ``str`` (``None`` elsewhere), which the JSON
    then writes as ``null``. Two keys are equal exactly when their messages are equal as JSON
    (keys made the same way); ``TypeError`` where a value has no exact JSON."""

    json: bytes
    contents: tuple[str | None, ...] | None = None
    #: What it holds: its JSON and its contents (shared with the messages it was made of),
    #: summed once (the memo reads it again at every eviction).
    nbytes: int = field(default=0, compare=False)

    @classmethod
    def of(cls, messages: Sequence[Any]) -> MessagesKey:
        """The key a conversation is remembered by: :meth:`whole` while its JSON is ASCII,
        else :meth:`apart` (so its next turns are compared without copying its texts)."""
        whole = cls.whole(messages)
        return whole if whole.json.isascii() else cls.apart(messages)

    @classmethod
    def whole(cls, messages: Sequence[Any]) -> MessagesKey:
        json = orjson.dumps(messages, option=EXACT_JSON)
        return cls(json, None, len(json))

    @classmethod
    def apart(cls, messages: Sequence[Any]) -> MessagesKey:
        skeleton: list[Any] = []
        contents: list[str | None] = []
        for message in messages:
            content = message.get("content") if type(message) is dict else None
            if type(content) is str:
                message = dict(message)  # (a shallow copy keeps the keys' order)
                message["content"] = None
            else:
                content = None
            skeleton.append(message)
            contents.append(content)
        json = orjson.dumps(skeleton, option=EXACT_JSON)
        held = len(json) + sum(map(sys.getsizeof, contents)) + 8 * len(contents)
        return cls(json, tuple(contents), held)

    def like(self, messages: Sequence[Any]) -> MessagesKey:
        """``messages``' key, made as this one was (to compare with it)."""
        return self.whole(messages) if self.contents is None else self.apart(messages)

    def continued_by(self, other: MessagesKey) -> bool:
        """Whether ``other``'s messages start with these (all of them, or more)."""
        if (self.contents is None) != (other.contents is None):
            return False
        opened = memoryview(self.json)[:-1]  # without its closing bracket
        if not (
            other.json.startswith(opened)
            and len(other.json) > len(opened)
            and other.json[len(opened)] in _LIST_SEPARATORS
        ):
            return False
        if self.contents is None or other.contents is None:
            return True
        count = len(self.contents)
        return other.contents[:count] == self.contents
