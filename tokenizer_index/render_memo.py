"""Rendered conversations, so a conversation's next turn renders only its new messages.

An agent's turn re-sends its ~300 messages; converting them to what the template sees
(:mod:`kvroute.tokenizer_index.chat_messages`) and rendering them costs ~3 ms, where the
new messages cost a few tens of microseconds. For a template that renders every message
on its own (:mod:`kvroute.tokenizer_index.template_prefix`), a conversation ``P + Q``
renders as ``render(P)`` without its generation prompt, then ``render(P[:k] + Q)`` after
the text of ``P[:k]`` alone, where ``k`` is the template's number of *anchors* (1, or more
where its head peels leading messages off, as Llama 3's takes the system message out). So
each long conversation is remembered with its text without the generation prompt (its
*body*), its messages' key (their JSON; :mod:`kvroute.tokenizer_index.messages_key`) and the
JSON of everything else the render read (tools,
documents, variables, and the texts of the ``strftime_now`` formats it calls, so a render
made yesterday is not reused today); a request whose messages start with a remembered
conversation's, as JSON, with the same other JSON, takes that body and renders only the
anchors and the new messages. Templates whose texts depend on neighbours, a last match or
parity render a few remembered messages again (:func:`_render_around`); templates that
carry state between messages (DeepSeek's) render through a copy that reports it, and a
window counts only where it ends in the remembered render's states
(:func:`_render_carried_after`).

Exact: equal JSON is equal input for a template (the request's messages are JSON; objects
that JSON cannot tell apart from others, subclasses, dataclasses and datetimes, make
orjson refuse them and the conversation is rendered whole). A template passes the syntax
check, then, at its first use, probe conversations rendered both ways must agree
(:func:`incremental_render_agrees`); the tokenizer renders whole under every other template
and for ``continue_final_message``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import orjson

from kvroute.tokenizer_index.chat_messages import conversation_from_request
from kvroute.tokenizer_index.chat_template import ChatTemplate, ChatTemplateError, strftime_now
from kvroute.tokenizer_index.messages_key import EXACT_JSON, MessagesKey
from kvroute.tokenizer_index.prompt_memo import (
    ENTRY_OVERHEAD_BYTES,
    PromptMemo,
    PromptMemoStats,
    conversation_keys,
)
from kvroute.tokenizer_index.template_prefix import PLAIN, PrefixShape, Reported

log = logging.getLogger(__name__)

#: Conversations with fewer messages are rendered whole: the memo's own work (two renders
#: of the first message, the JSON) costs what rendering ~5 messages does.
MIN_MESSAGES = 16
#: A conversation's first turn of at least :data:`MIN_MESSAGES` messages (none remembered:
#: a new conversation, or one this router has not seen) with at most this many after the
#: first ``MIN_MESSAGES - 2`` renders those from their skeleton and the rest after them, as
#: a later turn renders after a remembered one (:meth:`RenderMemo._render_split`).
SPLIT_MAX_NEW = 6
#: Under a template that carries state between messages (DeepSeek V3's namespace), a turn
#: continued from a remembered one renders a window of the last messages twice with the
#: states reported (~100-115 us, whatever the length), which costs what rendering ~40
#: messages whole does: shorter conversations are rendered whole and not remembered.
CARRIED_MIN_MESSAGES = 40
#: Every this many renders from a remembered turn, the conversation is also rendered whole
#: and the two compared (~1 % more render work): the last line of defence behind the syntax
#: check and the probes, found in production rather than assumed.
VERIFY_EVERY = 128


@dataclass(frozen=True, slots=True)
class _Rendered:
    """A render's text, what its next turn is cut and joined at, and its match."""

    text: str
    #: The anchors' text alone, without generation prompt.
    head: str
    #: What a generation prompt adds after the last message (None: nothing is remembered).
    generation_prompt: str | None
    #: The message the template's last-match loop picks (``PrefixShape.last_match``).
    match: int | None = None


@dataclass(frozen=True, slots=True)
class RenderSettings:
    """Everything a render reads besides the messages."""

    template: ChatTemplate
    tools: list[dict[str, Any]] | None
    documents: Sequence[Mapping[str, Any]] | None
    variables: Mapping[str, Any]
    add_generation_prompt: bool
    #: What the template's syntax promises (:func:`~kvroute.tokenizer_index.template_prefix.prefix_shape`).
    shape: PrefixShape = PLAIN
    #: Fills a short list of OpenAI messages into its skeleton with these settings and the
    #: generation flag given, or says None (then the template renders it).
    fill: Callable[[Sequence[Any], bool], str | None] | None = None

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        add_generation_prompt: bool | None = None,
        program: jinja2.Template | None = None,
    ) -> str:
        """The template's text for an already converted conversation (``program``: a
        template built from it renders in its place, as :meth:`report`'s instrumented one)."""
        if add_generation_prompt is None:
            add_generation_prompt = self.add_generation_prompt
        return self.template.render(
            conversation,
            tools=self.tools,
            documents=self.documents,
            add_generation_prompt=add_generation_prompt,
            variables=self.variables,
            program=program,
        )

    def convert(self, messages: Sequence[Any]) -> list[dict[str, Any]]:
        """OpenAI messages as the template sees them."""
        return conversation_from_request(messages, self.template.content_format)

    def render_whole(self, messages: Sequence[Any]) -> str:
        return self.render(self.convert(messages))

    def render_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool | None = None) -> str:
        """OpenAI messages' text: from a skeleton where :attr:`fill` has one, else rendered."""
        if add_generation_prompt is None:
            add_generation_prompt = self.add_generation_prompt
        if self.fill is not None:
            text = self.fill(messages, add_generation_prompt)
            if text is not None:
                return text
        return self.render(self.convert(messages), add_generation_prompt=add_generation_prompt)

    def report(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool | None = None
    ) -> Reported | None:
        """A state-carrying template's render with its states (``PrefixShape.carried``);
        None when a message held the report's mark."""
        carried = self.shape.carried
        assert carried is not None
        return carried.cut(
            self.render(conversation, add_generation_prompt=add_generation_prompt, program=carried.compiled)
        )

    def context(self) -> list[Any]:
        """Everything besides the messages a render reads, as JSON can write it."""
        clock = [strftime_now(format) for format in self.shape.clock_formats]
        return [self.tools, self.documents, self.variables, clock]


@dataclass(frozen=True, slots=True)
class RenderedConversation:
    """A conversation's render without its generation prompt, and what it was rendered from."""

    #: The render as it was returned; its first ``length`` characters end with the last
    #: message's text (no generation prompt). Kept whole: cutting the prompt off copied it.
    rendered: str
    length: int
    #: What its messages are compared by.
    messages: MessagesKey
    count: int
    template: ChatTemplate
    #: The JSON of the tools, documents and variables.
    context_json: bytes
    #: The render of the anchors (the first messages) alone, without generation prompt.
    head: str
    #: What a generation prompt adds after the last message.
    generation_prompt: str
    #: The message the template's last-match loop picks, if it has one and one is.
    match: int | None = None
    #: A state-carrying template's states before and after its messages loop (JSON).
    states: tuple[str, str] | None = None

    @property
    def body(self) -> str:
        """The render up to the end of the last message's text."""
        return self.rendered[: self.length]

    @property
    def nbytes(self) -> int:
        """What it is charged against the memo's bound."""
        texts = sys.getsizeof(self.rendered) + sys.getsizeof(self.head) + sys.getsizeof(self.generation_prompt)
        return ENTRY_OVERHEAD_BYTES + texts + self.messages.nbytes + len(self.context_json)

    def replaces(self, other: RenderedConversation) -> bool:
        """Whether ``other`` is the same conversation rendered with the same settings (two
        conversations may render to the same text)."""
        return (
            other.messages == self.messages
            and other.context_json == self.context_json
            and other.template is self.template
        )

    def continues(self, template: ChatTemplate, context_json: bytes, messages: MessagesKey) -> bool:
        """Whether a render with this template and context, of messages with this key
        (made like this conversation's), starts with this conversation's messages."""
        return template is self.template and context_json == self.context_json and self.messages.continued_by(messages)


class RenderMemo:
    """Long conversations' renders, at most ``max_bytes`` of them (0 disables it)."""

    def __init__(
        self,
        max_bytes: int,
        *,
        min_messages: int = MIN_MESSAGES,
        carried_min_messages: int = CARRIED_MIN_MESSAGES,
        verify_every: int = VERIFY_EVERY,
    ) -> None:
        self._memo: PromptMemo[RenderedConversation] = PromptMemo(max_bytes)
        self.min_messages = min_messages
        self.carried_min_messages = carried_min_messages
        self._verify_every = verify_every
        self._since_verified = 0
        # Sources of the templates whose incremental render once differed from the whole.
        self._distrusted: set[str] = set()
        # Sources of the templates that refused their anchors alone (the first render of a
        # conversation shows them with its match straight away: a refusal costs a raise).
        self._anchors_refused: set[str] = set()
        self._mismatches = 0

    def render(self, messages: Sequence[Any], settings: RenderSettings) -> str:
        """The template's text for these OpenAI messages: the new messages rendered after a
        remembered earlier turn's text where there is one, else all of them."""
        if type(messages) is not list or len(messages) < self.min_messages or not self._memo.max_bytes:
            return settings.render_whole(messages)
        if settings.template.source in self._distrusted:
            return settings.render_whole(messages)
        if settings.shape.carried is not None and len(messages) < self.carried_min_messages:
            return settings.render_whole(messages)
        keys = conversation_keys(messages)
        try:
            context_json = orjson.dumps(settings.context(), option=EXACT_JSON)
            previous_key, previous, messages_key = self._previous(keys, settings.template, context_json, messages)
        except TypeError:  # values JSON cannot stand for exactly
            return settings.render_whole(messages)
        if settings.shape.carried is not None:
            encoded = (messages_key, context_json)
            return self._render_carried(previous, previous_key, messages, settings, keys, encoded)
        rendered = None
        if previous is not None:
            rendered = self._render_after(previous, messages, settings)
            if rendered is not None:
                self._memo.reused()
        else:
            rendered = self._render_split(messages, settings, context_json)
        if rendered is None:
            rendered = self._render_first(messages, settings)
        elif not self._verified(rendered.text, messages, settings):
            return settings.render_whole(messages)
        text, head, generation_prompt = rendered.text, rendered.head, rendered.generation_prompt
        if keys and generation_prompt is not None:
            tail = generation_prompt if settings.add_generation_prompt else ""
            # (A windowed template's anchors alone render as the last messages, not as the head.)
            if text.endswith(tail) and (settings.shape.windowed or text.startswith(head)):
                entry = RenderedConversation(
                    text,
                    len(text) - len(tail),
                    messages_key,
                    len(messages),
                    settings.template,
                    context_json,
                    head,
                    generation_prompt,
                    rendered.match,
                )
                self._memo.remember(keys[0], entry, supersedes=previous_key)
                return text
        if previous_key is not None:
            self._memo.touch(previous_key)
        return text

    def clear(self) -> None:
        self._memo.clear()

    def stats(self) -> PromptMemoStats:
        return replace(self._memo.stats(), mismatches=self._mismatches)

    def _verified(self, text: str, messages: Sequence[Any], settings: RenderSettings) -> bool:
        """Whether ``text``, rendered from a remembered turn, may be used: every
        :data:`VERIFY_EVERY`-th such render is compared with the whole render, and a
        template whose render differs (a shape neither the syntax check nor the probes
        caught) renders whole from then on."""
        self._since_verified += 1  # (a race between threads only moves which one is checked)
        if self._since_verified < self._verify_every:
            return True
        self._since_verified = 0
        if settings.render_whole(messages) == text:
            return True
        self._mismatches += 1
        self._distrusted.add(settings.template.source)
        self._memo.clear()
        log.error(
            "chat template: a conversation rendered from a remembered turn differed from its whole render; "
            "rendering every chat whole under this template from now on"
        )
        return False

    def _previous(
        self, keys: list[int], template: ChatTemplate, context_json: bytes, messages: Sequence[Any]
    ) -> tuple[int | None, RenderedConversation | None, MessagesKey]:
        """The remembered conversation these messages continue (or repeat), if any, with the
        memo's key it is filed under, and the key to remember them by (``TypeError`` where a
        value has no exact JSON)."""
        made: dict[bool, MessagesKey] = {}  # by whether made apart
        for filed, candidate in self._memo.candidates(keys):
            apart = candidate.messages.contents is not None
            key = made.get(apart)
            if key is None:
                key = made[apart] = candidate.messages.like(messages)
            if candidate.continues(template, context_json, key):
                return filed, candidate, _kept(key, messages, candidate.messages)
        key = made.get(True) or made.get(False)
        return None, None, MessagesKey.of(messages) if key is None else _kept(key, messages)

    def _render_carried(
        self,
        previous: RenderedConversation | None,
        previous_key: int | None,
        messages: Sequence[Any],
        settings: RenderSettings,
        keys: list[int],
        encoded: tuple[MessagesKey, bytes],
    ) -> str:
        """:meth:`render` under a template that carries state between messages: the new
        messages after ``previous``'s text (filed under ``previous_key``) where a window
        reaches its states, else all."""
        carried = _render_carried_after(previous, messages, settings) if previous is not None else None
        if carried is None:
            reported = settings.report(settings.convert(messages))
            if reported is None:  # a message held the mark: render as the template is
                return settings.render_whole(messages)
            body, tail, states = reported.head + reported.loop, reported.tail, reported.states
        else:
            self._memo.reused()
            body, tail, states = carried
            if not self._verified(body + tail, messages, settings):
                return settings.render_whole(messages)
        text = body + tail
        if keys:
            messages_key, context_json = encoded
            entry = RenderedConversation(
                text, len(body), messages_key, len(messages), settings.template, context_json, "", "", None, states
            )
            self._memo.remember(keys[0], entry, supersedes=previous_key)
        elif previous_key is not None:
            self._memo.touch(previous_key)
        return text

    def _render_split(self, messages: Sequence[Any], settings: RenderSettings, context_json: bytes) -> _Rendered | None:
        """A conversation's first long turn, where its first ``min_messages - 2`` messages
        fill a skeleton and at most :data:`SPLIT_MAX_NEW` follow: those rendered so (with
        their anchors' text, generation prompt and match found, as a remembered turn's),
        and the rest after them as :meth:`_render_after` renders a later turn. None where
        that does not apply (or would cost more: a last-match loop run in Jinja, as Qwen
        3.5's, whose test reads a text through a macro); then everything renders whole."""
        split = self.min_messages - 2
        fill, last_match = settings.fill, settings.shape.last_match
        if fill is None or split <= settings.shape.anchors or not 0 < len(messages) - split <= SPLIT_MAX_NEW:
            return None
        if last_match is not None and last_match.message_test is None:
            return None  # its loop run in Jinja over the messages converted: as dear as rendering them
        first = messages[:split]
        body = fill(first, False)
        if body is None:
            return None
        found = self._render_first(first, settings, body)
        if found.generation_prompt is None or not (settings.shape.windowed or body.startswith(found.head)):
            return None
        remembered = RenderedConversation(
            body,
            len(body),
            MessagesKey.of(first),
            split,
            settings.template,
            context_json,
            found.head,
            found.generation_prompt,
            found.match,
        )
        return self._render_after(remembered, messages, settings)

    def _render_first(self, messages: Sequence[Any], settings: RenderSettings, text: str | None = None) -> _Rendered:
        """All the messages rendered (or their ``text``, rendered already); and the
        anchors' text alone, and the generation prompt, which the conversation's next turns
        are cut and joined at (``None`` if it is no suffix, or the conversation is shorter
        than its anchors: then nothing is remembered)."""
        anchors, last_match = settings.shape.anchors, settings.shape.last_match
        converted = text is None or (last_match is not None and last_match.roles is None)
        conversation = settings.convert(messages) if converted else []
        if text is None:
            text = settings.render(conversation)
        if len(messages) < anchors:
            return _Rendered(text, "", None)
        match = last_match.find(conversation if converted else messages) if last_match else None
        # The generation prompt reads no message but the first (template_prefix), so any list
        # starting with the anchors shows it. Where the anchors alone are refused (Qwen 3.5's
        # "no user query"), they are shown with the match, which a windowed template's later
        # turns render behind them too (its head cuts nothing).
        probes = [messages[:anchors]]
        if match is not None and match >= anchors:
            probes.append([*messages[:anchors], messages[match]])
            if settings.template.source in self._anchors_refused:
                probes.reverse()
        for probe in probes:
            try:  # (short: filled into their skeletons where they have one)
                head = settings.render_messages(probe, add_generation_prompt=False)
                with_prompt = settings.render_messages(probe, add_generation_prompt=True)
            except ChatTemplateError:
                if len(probe) == anchors:
                    self._anchors_refused.add(settings.template.source)
                continue
            generation_prompt = with_prompt[len(head) :] if with_prompt.startswith(head) else None
            return _Rendered(text, head if len(probe) == anchors else "", generation_prompt, match)
        return _Rendered(text, "", None)  # the anchors are refused: the next turn renders whole

    def _render_after(
        self, previous: RenderedConversation, messages: Sequence[Any], settings: RenderSettings
    ) -> _Rendered | None:
        """``previous``'s text, then the messages after it rendered behind the anchors.

        ``None`` if the render of those does not start with the anchors' own text (the
        template broke the promise its syntax made: render whole).
        """
        tail = previous.generation_prompt if settings.add_generation_prompt else ""
        head, generation_prompt = previous.head, previous.generation_prompt
        new = messages[previous.count :]
        if not new:  # the same conversation again (a retry)
            return _Rendered(previous.body + tail, head, generation_prompt, previous.match)
        shape = settings.shape
        if shape.windowed or (shape.parity and (previous.count - shape.anchors) % 2):
            # (A parity template's new messages behind the anchors alone would each sit at
            # the other parity: one remembered message goes between.)
            window = LOOKAROUND_WINDOW if shape.windowed else 1
            around = _render_around(previous, messages, settings, window)
            return _Rendered(around[0], head, generation_prompt, around[1]) if around is not None else None
        try:  # (a short list: filled into its skeleton where it has one)
            rendered = settings.render_messages([*messages[: shape.anchors], *new])
        except ChatTemplateError:  # the new messages behind the anchors alone are refused
            return None
        if not rendered.startswith(head):
            log.warning("chat template rendered a conversation's first messages differently; rendering whole")
            return None
        return _Rendered(previous.body + rendered[len(head) :], head, generation_prompt)


def _kept(key: MessagesKey, messages: Sequence[Any], continued: MessagesKey | None = None) -> MessagesKey:
    """``key`` to remember ``messages`` by; made apart instead where it holds text beyond
    ASCII (the conversation's next turn is compared without copying it). ``continued``:
    the key ``key`` continues, whose JSON, if whole, is ASCII (kept so): only the rest is read."""
    if key.contents is not None:
        return key
    if continued is not None and continued.contents is None:
        ascii_only = key.json[len(continued.json) - 1 :].isascii()
    else:
        ascii_only = key.json.isascii()
    return key if ascii_only else MessagesKey.apart(messages)


#: Remembered messages rendered again behind a lookaround template's anchors: the last one's
#: text changes with what follows it, and the two before it make the cut findable.
LOOKAROUND_WINDOW = 3


def _render_around(
    previous: RenderedConversation, messages: Sequence[Any], settings: RenderSettings, size: int
) -> tuple[str, int | None] | None:
    """``messages`` (which continue ``previous``'s) rendered under a template whose message
    texts depend on their neighbours, on a last match or on their positions' parity, with
    the message the last-match loop now picks; None when there are too few remembered
    messages or the window alone is refused.

    With ``P`` the remembered messages (``X = render(P)`` without generation prompt), ``Q``
    the new ones and ``W`` the anchors, the remembered match (if it is between the anchors
    and the rest), then ``P``'s last ``size`` (one more where that keeps each at its
    parity; all from the remembered match on where ``Q`` holds a new one: the messages
    after the old match render as before a match now): ``Y = render(W + Q)`` and ``Z =
    render(W)`` without generation prompt agree up to where the first of ``P``'s messages
    renders differently followed by ``Q``; ``X`` ends as ``Z`` does (the messages before it
    render alike in both). So ``render(P + Q)`` is ``X`` less what ``Z`` has past that
    point, then ``Y`` from it.
    """
    shape = settings.shape
    new = messages[previous.count :]
    start = previous.count - size
    match = previous.match
    last_match = shape.last_match
    found = None
    if last_match is not None:
        found = last_match.find(new if last_match.roles is not None else settings.convert(new))
    if found is not None and match is None and last_match is not None and last_match.none_before_all:
        return None  # every remembered message was after the (missing) match; now each is before one
    if found is not None and match is not None:
        start = min(start, match)
    remembered = [*messages[: shape.anchors]]
    if match is not None and shape.anchors <= match < start:
        remembered.append(messages[match])
    if shape.parity and (start - len(remembered)) % 2:
        start -= 1
    if start < shape.anchors:
        return None
    window = [*remembered, *messages[start : previous.count]]
    try:  # (short lists: filled into their skeletons where they have one)
        joined = settings.render_messages([*window, *new])
        alone = settings.render_messages(window, add_generation_prompt=False)
    except ChatTemplateError:  # the window alone is refused (the whole render says whether it is)
        return None
    common = _common_prefix(joined, alone)
    cut = len(alone) - common
    if not previous.rendered.endswith(alone[common:], 0, previous.length):  # it broke its syntax's promise
        log.warning("chat template rendered a conversation's last messages differently; rendering whole")
        return None
    text = previous.rendered[: previous.length - cut] + joined[common:]
    return text, match if found is None else previous.count + found


#: Remembered messages rendered again behind a state-carrying template's anchors, widest
#: last: a window must end in the remembered render's states (a flag set by the first tool
#: call is set in a window that holds one), and hold at most half the conversation.
CARRY_WINDOWS = (4, 16)


def _render_carried_after(
    previous: RenderedConversation, messages: Sequence[Any], settings: RenderSettings
) -> tuple[str, str, tuple[str, str] | None] | None:
    """``messages`` (which continue ``previous``'s) as ``previous``'s body, the new
    messages' text and the tail, with the states after them; None when no window reaches
    ``previous``'s states or the new messages change what the head computes (module
    docstring of ``template_prefix``: then every message's text may differ).

    With ``P`` the remembered messages, ``Q`` the new ones and ``W`` the anchors then
    ``P``'s last few: when ``render(W)`` ends its head and its loop in ``P``'s states, and
    ``render(W + Q)``'s head ends in the same state, each message of ``Q`` starts in the
    same state in ``render(W + Q)`` as in ``render(P + Q)``, so renders the same text, and
    the tail follows the same final state.
    """
    states = previous.states
    anchors = settings.shape.anchors
    if states is None:
        return None
    new = messages[previous.count :]  # none for a retry: the tail is its own
    converted = settings.convert(new) if new else []
    for size in CARRY_WINDOWS:
        start = previous.count - size
        if start < size + anchors:  # (two renders of the window: it pays at half the conversation)
            return None
        window = settings.convert([*messages[:anchors], *messages[start : previous.count]])
        try:
            alone = settings.report(window, add_generation_prompt=False)
            if alone is None or alone.states != states:
                continue  # a wider window may reach them
            joined = settings.report([*window, *converted])
        except ChatTemplateError:  # the window alone is refused (the whole render says whether it is)
            return None
        if joined is None or joined.head_state != alone.head_state or joined.head != alone.head:
            return None
        if not joined.loop.startswith(alone.loop):  # it broke its syntax's promise
            log.warning("chat template rendered a conversation's last messages differently; rendering whole")
            return None
        return previous.body + joined.loop[len(alone.loop) :], joined.tail, joined.states
    return None


def _common_prefix(first: str, second: str) -> int:
    """The length of the longest prefix ``first`` and ``second`` share (compared in C)."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


# --- the check at a template's first use ------------------------------------------------------

_PROBE_CALL = {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "a b"}'}}
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a thing up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
#: Conversations of every role after every other, with and without a system prompt; each
#: of at most ``prompt_memo.PROBE_MESSAGES`` messages, so that every earlier turn is found by its keys.
PROBE_CONVERSATIONS: tuple[tuple[dict[str, Any], ...], ...] = (
    (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there 😀"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": "found: a"},
        {"role": "tool", "tool_call_id": "call-1", "content": "found: b"},
        {"role": "assistant", "content": " Hello!\n"},
        {"role": "user", "content": "\n中文 text"},
        {"role": "user", "content": "again", "name": "bob"},
    ),
    (
        {"role": "user", "content": "no system"},
        {"role": "assistant", "content": "ok", "reasoning": "think"},
        {"role": "assistant", "content": None, "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": "found"},
        {"role": "user", "content": "b"},
        {"role": "system", "content": "late system"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "c"},
    ),
    (  # roles that alternate, as Mistral's and Gemma's templates insist, without a system prompt
        {"role": "user", "content": "Hi there 😀"},
        {"role": "assistant", "content": " Hello!\n"},
        {"role": "user", "content": "\n中文 text"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "again"},
    ),
    (  # and with one
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "again"},
    ),
    (  # an agent's turns after its user's query: a last-match template's match stays put
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a", "reasoning": "r1"},
        {"role": "user", "content": "Find it."},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nLooking.", "tool_calls": [_PROBE_CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": "found: a"},
        {"role": "user", "content": "<tool_response>\nlate\n</tool_response>"},
        {"role": "assistant", "content": "Found.", "reasoning": "done"},
    ),
)


def incremental_render_agrees(template: ChatTemplate, variables: Mapping[str, Any], shape: PrefixShape = PLAIN) -> bool:
    """Whether the probe conversations, remembered up to every message and then rendered
    whole through the memo, equal their plain renders (with and without tools and a
    generation prompt). A conversation the template refuses proves nothing; at least
    one must render."""
    rendered_any = False
    for conversation in PROBE_CONVERSATIONS:
        for tools in (None, _PROBE_TOOLS):
            for add_generation_prompt in (True, False):
                settings = RenderSettings(template, tools, None, variables, add_generation_prompt, shape)
                try:
                    expected = settings.render_whole(list(conversation))
                except (ChatTemplateError, ValueError):
                    continue
                rendered_any = True
                if not _every_split_agrees(conversation, settings, expected):
                    return False
    return rendered_any


def _every_split_agrees(messages: Sequence[dict[str, Any]], settings: RenderSettings, expected: str) -> bool:
    conversation = list(messages)  # the memo takes lists only
    for split in range(1, len(conversation) + 1):
        memo = RenderMemo(1 << 20, min_messages=1)
        # The earlier turn with the other generation-prompt setting: a body must not depend on it.
        other = replace(settings, add_generation_prompt=not settings.add_generation_prompt)
        try:
            memo.render(conversation[:split], other)
            remembered = split >= settings.shape.anchors  # a turn shorter than its anchors is not
        except (ChatTemplateError, ValueError):
            remembered = False  # the template refuses the earlier turn alone
        if memo.render(conversation, settings) != expected:
            return False
        reused = memo.stats().reused
        # (A windowed template renders whole where its window is too short or a match is new.)
        if reused > remembered or (reused < remembered and not settings.shape.may_render_whole):
            return False
    return True
