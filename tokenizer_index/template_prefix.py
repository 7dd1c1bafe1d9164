"""Which chat templates render a conversation as a head, one text per message, and a tail.

A conversation's next turn repeats its messages and adds a few; re-rendering all of them
costs ~10 us a message (~3 ms for an agent's 300). A template may render the same
message differently depending on the others (``loop.last``, ``messages | length``, a
last-query index kept in a namespace, the message after it), so the render of a prefix
of the messages is in general no prefix of the whole render. This module decides, from
the template's syntax tree, whether a template is of a shape where it is:

* one loop over ``messages`` (or over a name the head set to it) at the top level that
  renders them, with a plain loop variable (and, with state carried, folds before it:
  below);
* the head (everything before the loop) may peel leading messages off, as Llama 3's
  templates take the system message out: ``{% set messages = messages[1:] %}`` or
  ``{% set loop_messages = messages[1:] %}`` (or ``= messages``), outside any loop or
  macro; each such statement runs at most once, so ``m`` of them peel at most ``m``;
* the head and the loop's body read the messages only as ``messages[0]`` (or
  ``loop_messages[0]``) and ``messages | length > 0`` (or ``!= 0``), which are the same
  for every list that starts with the same ``m + 1`` messages, and the body reads of its
  loop only ``loop.first`` (or ``loop.index0 == 0``, ``loop.index == 1``), ``loop.last``,
  and the parity of its position: ``loop.index0 % 2`` (or ``loop.index % 2``,
  ``loop.index0 is even``/``odd``), as Mistral's and Gemma's templates check that roles
  alternate;
* the body may read a message's neighbours, as Qwen 2.5's template groups consecutive tool
  results: ``loop.previtem`` and ``loop.nextitem`` (Qwen 3 Coder's), and, only guarded,
  ``messages[loop.index0 - 1]`` after ``loop.first or`` (or ``loop.index0 == 0 or``,
  ``not loop.first and``), ``messages[loop.index0 + 1]`` after ``loop.last or`` (or ``not
  loop.last and``), on the list the loop runs over;
* the head may find the last message that passes a test, as Qwen 3's finds the last user
  query (a *last-match loop*, below); otherwise nothing carries state from one message to
  the next but namespaces reported as below: no ``{% set ns.x %}`` in a macro, no
  ``{% break %}``, no stateful or random globals and filters (``cycler``, ``joiner``,
  ``lipsum``, ``random``), no identity test; ``strftime_now`` only with a constant format
  (its texts are part of what a remembered render was made with);
* after the loop only ``{% if add_generation_prompt ... %}`` blocks without ``else`` (any
  text reading no message but the first, with state carried), and
  ``add_generation_prompt`` read nowhere else (but ``{% if not add_generation_prompt is
  defined %}``, which never runs);
* no ``extends``, ``include``, ``import`` or blocks (no other template's code).

For such a template, its ``k = m + 1`` *anchors*, and any message list ``L`` of at least
``k`` messages, with the other variables fixed, ``render(L) = head(L[:k]) + text(L[p]) +
... + text(L[-1]) + tail(L[:k], add_generation_prompt)`` where ``p < k`` is how many the
head peeled, and the tail is empty without a generation prompt. So, for a conversation
``P + Q`` with ``len(P) >= k``: ``render(P + Q) = render(P, no generation prompt) +
render(P[:k] + Q)[len(render(P[:k], no generation prompt)):]``, which
:mod:`kvroute.tokenizer_index.render_memo` uses to render only the new messages. Where
the body reads ``loop.last`` or a neighbour (*lookaround*), a message's text also depends
on the messages beside it, so the memo renders the last few remembered messages again
with the new ones (``render_memo``). Where it reads its position's parity, the same holds
for a window that keeps every message at its parity: the memo puts one remembered message
between the anchors and the new ones when ``len(P) - k`` is odd. Every other template is
rendered whole every time.

A template may also *carry state* from one message to the next in namespaces, as
DeepSeek's do (``ns.is_tool``, ``ns.is_first``, system prompts gathered before the loop):
the messages loop may write namespace attributes, the head may run *folds* (loops over the
messages that write namespaces and output nothing, reading of their loop nothing), and the
tail may output anything that reads no message but the first. Such a template is
instrumented (:class:`CarriedState`) to report its namespaces after its last fold (before
the messages loop without one) and after the messages loop; the memo renders a window ``W`` (the anchors and the last few remembered
messages) with the new messages ``Q`` and uses the new text only where ``W`` ends in the
states the remembered render of ``P`` ended in and ``Q`` leaves the folds' state as it
was: a message's text is then a function of itself and the same state in both. No peels,
last-match loop, ``loop.last``, neighbours or parity with it.

A *last-match loop* is Qwen 3's pre-loop, exactly of this form (names may differ)::

    {% set ns = namespace(flag=true, index=messages|length - 1) %}
    {% for message in messages[::-1] %}
        {% set i = (messages|length - 1) - loop.index0 %}
        {% if ns.flag and <a test of message alone> %}
            {% set ns.flag = false %}{% set ns.index = i %}
        {% endif %}
    {% endfor %}

``ns.index`` is then the last message passing the test (the list's last when none does),
and the messages loop may read it only as ``loop.index0 > ns.index`` (or another
comparison of the two). A message's text then depends on which message that is, so the
memo renders its window with the remembered match among the anchors while the new
messages hold no match (an agent's tool turns after its user's query), and from the
remembered match on when they hold one (a chat's next question: only the messages after
the old match change): every comparison then comes out as in the whole render.

Qwen 3.5's form of it is read as the same loop: the test may set a name from the message
and test that name in an inner ``if`` (``{% set text = render_content(message.content) |
trim %}{% if not text.startswith(...) %}...``), and ``{% if ns.flag %}{{
raise_exception(...) }}{% endif %}`` may follow the loop (a conversation that rendered had
a match, and every continuation of it has one). Where the content format hands every
content to the template as a string (:func:`template_shape`), a macro printing a string
argument as it is (:mod:`~kvroute.tokenizer_index.template_macros`) and called only with
a message's content is that content, and its body is not read; the head may test the
messages list for being empty (``if not messages``).

GLM's form runs forward, each match's position written over the last::

    {% set ns = namespace(index=-1) %}
    {% for m in messages %}
        {% if <a test of m alone> %}{% set ns.index = loop.index0 %}{% endif %}
    {% endfor %}

``ns.index`` is then the last match, or -1 where there is none: a conversation without a
match reads as one whose match comes before every message, not at its last
(:attr:`LastMatch.none_before_all`), so the turn that brings its first match renders whole.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, ClassVar

import jinja2
import jinja2.nodes as nodes
import orjson
from jinja2.utils import Namespace

from kvroute.tokenizer_index.chat_template import ChatTemplate, compile_syntax_tree
from kvroute.tokenizer_index.template_macros import identity_macros, is_identity_call
from kvroute.tokenizer_index.template_syntax import key_of, role_comparison

MESSAGES = "messages"
GENERATION_FLAG = "add_generation_prompt"
CLOCK = "strftime_now"
# Globals with state across calls or with a different answer each call.
_UNSTABLE_GLOBALS = frozenset({"cycler", "joiner", "lipsum"})
_UNSTABLE_FILTERS = frozenset({"random"})
# Tests that see an object's identity, which a remembered render cannot reproduce.
_IDENTITY_TESTS = frozenset({"sameas"})
# Code from elsewhere, or scopes whose variables outlive a loop iteration.
_REFUSED_NODES: tuple[type[nodes.Node], ...] = (
    nodes.Extends,
    nodes.Include,
    nodes.Import,
    nodes.FromImport,
    nodes.Block,
    nodes.ContextReference,
    nodes.DerivedContextReference,
)


@dataclass(frozen=True, slots=True)
class PrefixShape:
    """What the syntax check found: whether a template renders every message on its own
    (see the module docstring) and, if so, what an incremental render must repeat."""

    #: Why not, or None when it does.
    refusal: str | None = None
    #: The leading messages every incremental render repeats (1 + the messages the head may peel).
    anchors: int = 1
    #: The constant formats the template hands ``strftime_now``: their texts now are part
    #: of what a render was made with.
    clock_formats: tuple[str, ...] = ()
    #: Whether a message's text depends on its neighbours (``loop.last``, the messages
    #: before and after it): then the last remembered messages are rendered again.
    lookaround: bool = False
    #: The head's last-match loop, if it has one.
    last_match: LastMatch | None = None
    #: Whether a message's text depends on whether its position in the loop is even
    #: (``loop.index0 % 2``): then a window renders every message at its parity.
    parity: bool = False
    #: The template instrumented to report the state it carries between messages, if it does.
    carried: CarriedState | None = None

    @property
    def stable(self) -> bool:
        return self.refusal is None

    @property
    def windowed(self) -> bool:
        """Whether an incremental render renders the last remembered messages again (with
        the match among the anchors)."""
        return self.lookaround or self.last_match is not None

    @property
    def may_render_whole(self) -> bool:
        """Whether a conversation continuing a remembered one may still render whole (its
        window too short, a new match, a state the window does not reach)."""
        return self.windowed or self.carried is not None


@dataclass(frozen=True, eq=False)
class LastMatch:
    """A head's last-match loop (module docstring), run alone: which message it picks."""

    #: The head's namespace, the loop, and an output of the index it found ("" for none).
    program: nodes.Template = field(repr=False)
    #: Whether a conversation without a match reads as one whose match comes before every
    #: message (GLM's forward form: index -1), rather than at its last (Qwen 3's).
    none_before_all: bool = False
    #: Where its test only compares a message's role with constants (GLM's ``m.role ==
    #: 'user'``), the roles that match: its Python test (below) then runs on the messages
    #: as the client sent them as well as converted.
    roles: frozenset[str] | None = None
    #: Where its test only compares the role, tests the content for being a string, or asks
    #: a string content whether it starts with, ends with or holds a constant (Qwen 3's),
    #: that test in Python, on converted messages (None: the template's loop runs; so it
    #: does for a message the Python test cannot decide).
    message_test: Callable[[Mapping[str, Any]], bool] | None = field(default=None, repr=False)

    #: Messages searched at the end of a conversation before the rest of it: a chat's last
    #: query is among its last few, an agent's may be hundreds of messages back.
    RECENT: ClassVar[int] = 8

    @classmethod
    def of(
        cls,
        namespace: nodes.Assign,
        loop: nodes.For,
        name: str,
        flag: str | None,
        index: str,
        macros: tuple[nodes.Macro, ...] = (),
        test: nodes.Node | None = None,
    ) -> LastMatch:
        """The loop run alone (after the macros its test calls); ``flag`` None: the forward
        form, whose index stays negative until a message matches. ``test``: the loop's test
        of a message (its roles read off it where it reads nothing else)."""
        picked = nodes.Getattr(nodes.Name(name, "load"), index, "load")
        if flag is None:
            found: nodes.Expr = nodes.Compare(copy.deepcopy(picked), [nodes.Operand("gteq", nodes.Const(0))])
        else:
            found = nodes.Not(nodes.Getattr(nodes.Name(name, "load"), flag, "load"))
        report = nodes.Output([nodes.CondExpr(found, picked, nodes.Const(""))])
        # Copies: compiling optimises a tree in place, and the template's own must stay as parsed.
        statements = [*map(copy.deepcopy, macros), copy.deepcopy(namespace), copy.deepcopy(loop), report]
        program = nodes.Template(statements)
        program.set_lineno(1)
        target = loop.target.name if isinstance(loop.target, nodes.Name) else ""
        roles = _matching_roles(test, target) if test is not None else None
        message_test = _message_test(test, target) if test is not None else None
        return cls(program, none_before_all=flag is None, roles=roles, message_test=message_test)

    def find(self, conversation: Sequence[Any], start: int = 0) -> int | None:
        """The last message of ``conversation[start:]`` the loop picks, or None if none is
        (with :attr:`roles`, of the messages as sent too)."""
        if self.message_test is not None:
            test = self.message_test
            try:
                for position in range(len(conversation) - 1, start - 1, -1):
                    if test(conversation[position]):
                        return position
                return None
            except _Undecided:
                pass  # (the template's own loop says)
        recent = max(start, len(conversation) - self.RECENT)
        found = self._find_in(conversation, recent)
        if found is None and recent > start:
            found = self._find_in(conversation[:recent], start)
        return found

    def _find_in(self, conversation: Sequence[Any], start: int) -> int | None:
        picked = self._compiled.render(messages=conversation[start:])
        return start + int(picked) if picked else None

    @cached_property
    def _compiled(self) -> jinja2.Template:
        return compile_syntax_tree(self.program)


#: The global the instrumented template calls to report its namespaces.
_REPORT = "__kvroute_report_state"
# JSON that stands for one Python value only (as the render memo's).
_EXACT_JSON = orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME


@dataclass(frozen=True, slots=True)
class Reported:
    """An instrumented render cut at its reports: the text before the messages loop, the
    loop's, the text after it, and the namespaces' states (JSON) before and after the loop."""

    head: str
    loop: str
    tail: str
    head_state: str
    loop_state: str

    @property
    def states(self) -> tuple[str, str] | None:
        """Both states, or None when a namespace held a value JSON cannot write (then
        nothing says two renders reached the same state)."""
        if CarriedState.UNKNOWN in (self.head_state, self.loop_state):
            return None
        return self.head_state, self.loop_state


@dataclass(frozen=True, eq=False)
class CarriedState:
    """A template that carries state in namespaces (module docstring), with a report of
    them before and after its messages loop."""

    program: nodes.Template = field(repr=False)

    #: What each report is wrapped in: no request's text holds it (a render that holds it
    #: more often is refused and rendered whole).
    MARK: ClassVar[str] = f"\x00kvroute-state-{uuid.uuid4().hex}\x00"
    #: What a namespace holding a value JSON cannot write reports (no JSON reads so).
    UNKNOWN: ClassVar[str] = "?"

    @classmethod
    def of(
        cls, tree: nodes.Template, loop: nodes.For, namespaces: tuple[str, ...], last_fold: nodes.For | None
    ) -> CarriedState:
        """``tree`` reporting its ``namespaces`` after its last fold (before its messages loop
        without one): what the head does after it is a function of that state and the first
        message; and after its messages ``loop``."""
        report = nodes.Output(
            [nodes.Call(nodes.Name(_REPORT, "load"), [nodes.Name(name, "load") for name in namespaces], [], None, None)]
        )
        head = tree.body.index(last_fold) + 1 if last_fold is not None else tree.body.index(loop)
        position = tree.body.index(loop)
        body = [
            *tree.body[:head],
            report,
            *tree.body[head:position],
            loop,
            copy.deepcopy(report),
            *tree.body[position + 1 :],
        ]
        # A copy: compiling optimises a tree in place, and the template's own must stay as parsed.
        program = nodes.Template(copy.deepcopy(body))
        program.set_lineno(1)
        return cls(program)

    @cached_property
    def compiled(self) -> jinja2.Template:
        compiled = compile_syntax_tree(self.program)
        compiled.globals[_REPORT] = _report_state
        return compiled

    def cut(self, text: str) -> Reported | None:
        """The instrumented render ``text`` at its two reports; None if a message held the mark."""
        parts = text.split(self.MARK)
        if len(parts) != 5:
            return None
        head, head_state, loop, loop_state, tail = parts
        return Reported(head, loop, tail, head_state, loop_state)


def _report_state(*namespaces: Any) -> str:
    """The namespaces' attributes as JSON between marks (:data:`CarriedState.UNKNOWN` for
    a value JSON cannot stand for exactly)."""
    try:
        # Attributes by name (the order they were set in changes nothing); values as they
        # are (a dict's order does: a template may loop over it).
        state = orjson.dumps([_attributes(namespace) for namespace in namespaces], option=_EXACT_JSON).decode()
    except TypeError:
        state = CarriedState.UNKNOWN
    return CarriedState.MARK + state + CarriedState.MARK


def _attributes(namespace: Any) -> list[tuple[str, Any]]:
    """A Jinja namespace's attributes, sorted by name; TypeError for anything else, or where
    this Jinja keeps them elsewhere (then no state is known)."""
    attributes = getattr(namespace, "_Namespace__attrs", None) if type(namespace) is Namespace else None
    if not isinstance(attributes, dict):
        raise TypeError(f"no namespace attributes to read in {type(namespace).__name__}")
    return sorted(attributes.items())


@dataclass(frozen=True)
class _Scope:
    """Where a node sits: in the messages loop's own body (not a nested loop's), inside a
    macro or the messages loop (no namespace writes), after the loop (the tail)."""

    in_message_loop: bool = False
    in_any_loop: bool = False
    no_namespace_writes: bool = False
    in_tail: bool = False
    #: Run once a message, at any depth: in the messages loop or a fold (a namespace written
    #: here carries state from one message to the next).
    per_message: bool = False
    #: Under ``loop.first or ...`` (the message before exists) or ``loop.last or ...`` (the next).
    previous_guarded: bool = False
    next_guarded: bool = False


_HEAD = _Scope()
#: A template that renders every message on its own, peels none off and reads no clock.
PLAIN = PrefixShape()


class _Refusal(Exception):
    """The template is not of the shape above; the message says why."""


def template_shape(template: ChatTemplate) -> PrefixShape:
    """:func:`prefix_shape` of ``template``, reading macros through where its content
    format hands it every content as a string."""
    return prefix_shape(template.syntax_tree, string_contents=template.content_format == "string")


def prefix_shape(tree: nodes.Template, *, string_contents: bool = False) -> PrefixShape:
    """Whether the template renders every message on its own (see the module docstring),
    with its anchors and clock formats, or why not. ``string_contents``: the template's
    content format hands it every message's content as a string, so a macro that prints a
    string argument as it is (:mod:`~kvroute.tokenizer_index.template_macros`), called with
    a message's content, is that content, and its body is not read."""
    check = _ShapeCheck(_message_lists(tree), identity_macros(tree) if string_contents else frozenset())
    check.macro_definitions = tuple(
        macro for macro in tree.find_all(nodes.Macro) if macro.name in check.identity_macros
    )
    try:
        check.template(tree)
    except _Refusal as refusal:
        return PrefixShape(refusal=str(refusal))
    if check.last_match is not None and check.peels:
        return PrefixShape(refusal="a last-match loop in a template that peels messages")
    if check.last_match is not None and check.parity:
        return PrefixShape(refusal="a last-match loop in a template that reads its positions' parity")
    carried = None
    if check.carries_state:
        if check.peels or check.last_match is not None or check.lookaround or check.parity:
            return PrefixShape(refusal="state carried between messages with peels, a last match, lookaround or parity")
        assert check.message_loop is not None  # checked by template()
        carried = CarriedState.of(tree, check.message_loop, tuple(check.namespaces), check.last_fold)
    return PrefixShape(
        anchors=1 + check.peels,
        clock_formats=tuple(dict.fromkeys(check.clock_formats)),
        lookaround=check.lookaround,
        last_match=check.last_match,
        parity=check.parity,
        carried=carried,
    )


def _message_lists(tree: nodes.Template) -> frozenset[str]:
    """``messages`` and the names the head sets to it or to a peeled copy of it
    (``{% set loop_messages = messages[1:] %}``), in the order the head runs."""
    names = {MESSAGES}
    for node in _head_statements(tree.body):
        if isinstance(node, nodes.Assign) and isinstance(node.target, nodes.Name):
            if _peeled_list(node.node, frozenset(names)) is not None:
                names.add(node.target.name)
    return frozenset(names)


def _head_statements(body: list[nodes.Node]) -> Iterator[nodes.Node]:
    """The top-level statements and those in top-level ``if`` blocks, in order, up to the
    first top-level loop (a loop's or a macro's statements may run more than once)."""
    for node in body:
        if isinstance(node, nodes.For):
            return
        yield node
        if isinstance(node, nodes.If):
            yield from _head_statements([*node.body, *(part for branch in node.elif_ for part in branch.body)])
            yield from _head_statements(node.else_)


def _peeled_list(node: nodes.Node, lists: frozenset[str]) -> int | None:
    """How many messages ``node`` peels off one of ``lists``: 0 for the name itself, 1 for
    ``name[1:]``; None when it is neither."""
    if isinstance(node, nodes.Name) and node.ctx == "load" and node.name in lists:
        return 0
    if (
        isinstance(node, nodes.Getitem)
        and isinstance(node.node, nodes.Name)
        and node.node.name in lists
        and isinstance(node.arg, nodes.Slice)
        and _is_int(node.arg.start, 1)
        and node.arg.stop is None
        and node.arg.step is None
    ):
        return 1
    return None


class _ShapeCheck:
    """One walk over a template's syntax tree; counts the head's peels and clock formats."""

    def __init__(self, lists: frozenset[str], identity: frozenset[str] = frozenset()) -> None:
        self.lists = lists
        #: Macros read through (``prefix_shape``'s ``string_contents``), and their definitions.
        self.identity_macros = identity
        self.macro_definitions: tuple[nodes.Macro, ...] = ()
        self.peels = 0
        self.clock_formats: list[str] = []
        self.lookaround = False
        self.parity = False
        #: The messages loop; whether it or a fold before it writes a namespace; the
        #: namespaces the head declares (``{% set ns = namespace(...) %}``), in order.
        self.message_loop: nodes.For | None = None
        self.last_fold: nodes.For | None = None
        self.carries_state = False
        self.namespaces: list[str] = []
        #: The name the messages loop runs over (its neighbours are read from it).
        self.loop_list = MESSAGES
        self.last_match: LastMatch | None = None
        #: The last-match loop's namespace, the attribute its index is kept in, and the
        #: two head statements checked as a whole (:meth:`_find_last_match`).
        self.match_namespace: str | None = None
        self.match_index = ""
        self.match_flag = ""
        self.match_statements: tuple[nodes.Node, ...] = ()
        #: The last-match loop's variable (a message, whose content an identity macro may print).
        self.match_target: str | None = None

    def template(self, tree: nodes.Template) -> None:
        loops = [node for node in tree.body if isinstance(node, nodes.For) and self._is_list(node.iter)]
        if not loops:
            raise _Refusal("no single top-level loop over messages")
        *folds, loop = loops
        if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
            raise _Refusal("the messages loop has an else, a filter, recursion or an unpacking target")
        assert isinstance(loop.iter, nodes.Name)  # _is_list
        self.loop_list = loop.iter.name
        self.message_loop = loop
        position = tree.body.index(loop)
        self.namespaces = list(_namespace_declarations(tree.body[:position]))
        forward = self._find_forward_match(tree.body[:position], folds)
        folds = [fold for fold in folds if fold is not forward]
        for fold in folds:
            self._check_fold(fold)
        if folds:
            self.last_fold = folds[-1]
            between = tree.body[tree.body.index(folds[0]) : tree.body.index(folds[-1])]
            if not all(any(node is fold for fold in folds) or _is_constant_output(node) for node in between):
                # (What the head does there would depend on a state no report shows.)
                raise _Refusal("something other than text between the loops over the messages before the messages loop")
        if forward is None:
            self._find_last_match(tree.body[:position])
        elif any(isinstance(node, nodes.For) and _is_reversed(node.iter) for node in tree.body[:position]):
            raise _Refusal("a loop over the messages in reverse besides a last-match loop")
        for node in tree.body[:position]:
            if not any(node is fold for fold in folds):
                self.check(node, _HEAD)
        for node in loop.body:
            self.check(node, _Scope(in_message_loop=True, in_any_loop=True, per_message=True))
        for node in tree.body[position + 1 :]:
            self.tail_node(node)

    def _check_fold(self, fold: nodes.For) -> None:
        """A loop over the messages before the messages loop: it may only write namespaces,
        reading each message alone, never its position (a *fold*: module docstring)."""
        if fold.else_ or fold.test is not None or fold.recursive or not isinstance(fold.target, nodes.Name):
            raise _Refusal("a loop over the messages before the messages loop has an else, a filter or recursion")
        if any(True for _ in fold.find_all(nodes.Output)) or any(_is_loop(name) for name in fold.find_all(nodes.Name)):
            raise _Refusal("more than one loop over the messages outputs text or reads its position")
        self.carries_state = True
        for node in fold.body:
            self.check(node, _Scope(in_any_loop=True, per_message=True))

    def tail_node(self, node: nodes.Node) -> None:
        """After the loop: only text-free output or blocks shown with the generation prompt
        (anything reading no message but the first, where the template carries state)."""
        if isinstance(node, nodes.Output) and all(
            isinstance(part, nodes.TemplateData) and not part.data for part in node.nodes
        ):
            return
        guarded = isinstance(node, nodes.If) and not node.elif_ and not node.else_ and _needs_generation_flag(node.test)
        if not guarded and not self.carries_state:
            raise _Refusal("something after the messages loop is not under {% if add_generation_prompt %}")
        self.check(node, _Scope(in_tail=True))

    def check(self, node: nodes.Node, scope: _Scope) -> None:
        """Refuse ``node`` or anything under it that could make one message's text depend on
        another message, on the list's length, or on state kept between messages."""
        if isinstance(node, _REFUSED_NODES):
            raise _Refusal(f"the template uses {type(node).__name__}")
        if any(node is statement for statement in self.match_statements):
            return  # checked whole by _find_last_match
        if isinstance(node, nodes.Macro) and node.name in self.identity_macros:
            return  # called only with a message's content, a string: it prints that
        if isinstance(node, nodes.Call) and is_identity_call(node, self.identity_macros):
            if not self._is_content_read(node.args[0]):
                raise _Refusal("a macro that prints a string is called with something other than a message's content")
        if (isinstance(node, nodes.Not) and self._is_list(node.node)) or self._is_unmatched_raise(node):
            return  # (a list of the anchors or more is never empty; a continued match stays one)
        if self._is_first_message(node) or self._is_non_empty_test(node):
            return  # the same for every list that starts with the same messages
        if self._is_peel(node, scope) or self._is_clock(node) or self._is_neighbour(node, scope):
            return
        if scope == _HEAD and _is_generation_default(node):
            return
        if scope.in_message_loop and _is_parity(node):
            self.parity = True
            return
        if scope.in_message_loop and isinstance(node, nodes.Or | nodes.And) and self._guarded(node, scope):
            return
        if isinstance(node, nodes.Name):
            self._check_name(node, scope)
        elif isinstance(node, nodes.Filter) and node.name in _UNSTABLE_FILTERS:
            raise _Refusal(f"the template uses the {node.name!r} filter")
        elif isinstance(node, nodes.Test) and node.name in _IDENTITY_TESTS:
            raise _Refusal(f"the template uses the {node.name!r} test")
        elif isinstance(node, nodes.NSRef) and (scope.no_namespace_writes or node.name == self.match_namespace):
            raise _Refusal("a namespace is written inside a macro, or after a last-match loop")
        elif isinstance(node, nodes.NSRef) and scope.per_message:
            if node.name not in self.namespaces:
                raise _Refusal(f"{node.name} is written once a message but not declared at the top before")
            self.carries_state = True
        elif isinstance(node, nodes.Break) and scope.in_message_loop:
            raise _Refusal("the messages loop may break")
        elif isinstance(node, nodes.Getattr) and _is_loop(node.node) and scope.in_message_loop:
            if node.attr not in ("first", "last", "previtem", "nextitem"):
                raise _Refusal(f"the messages loop reads loop.{node.attr}")
            # (The messages before and after: undefined at the ends, so no guard is needed,
            # unlike messages[loop.index0 - 1], which wraps round.)
            self.lookaround |= node.attr != "first"
            return
        elif isinstance(node, nodes.Compare) and scope.in_message_loop and _is_first_position(node):
            return
        elif isinstance(node, nodes.Compare) and scope.in_message_loop and self._is_match_comparison(node):
            return
        for child, child_scope in _children(node, scope):
            self.check(child, child_scope)

    def _check_name(self, name: nodes.Name, scope: _Scope) -> None:
        if name.name == self.match_namespace:
            raise _Refusal(f"{name.name} is used other than as loop.index0 > {name.name}.{self.match_index}")
        if name.name in self.lists:
            raise _Refusal(f"{name.name} is read other than as {name.name}[0] or {name.name} | length > 0")
        if name.name in _UNSTABLE_GLOBALS:
            raise _Refusal(f"the template calls {name.name}")
        if name.name == CLOCK:
            raise _Refusal(f"{CLOCK} is used other than called with a constant format")
        if name.name == GENERATION_FLAG and not scope.in_tail:
            raise _Refusal("add_generation_prompt is read before the end of the messages loop")
        if name.name == "loop" and (scope.in_message_loop or not scope.in_any_loop):
            # In the messages loop only loop.first (checked above) is position-free; outside
            # any loop, a macro could be handed a loop in ways not worth following.
            raise _Refusal("the messages loop's loop object is read whole")

    def _find_last_match(self, head: list[nodes.Node]) -> None:
        """Recognise the head's last-match loop (module docstring), if it has one, and
        check it whole; any other loop over the messages in reverse is refused later."""
        loops = [node for node in head if isinstance(node, nodes.For) and _is_reversed(node.iter)]
        if not loops:
            return
        if len(loops) > 1:
            raise _Refusal("more than one loop over the messages in reverse")
        [loop] = loops
        if self.lists != {MESSAGES} or self.loop_list != MESSAGES:
            raise _Refusal("a last-match loop in a template that peels messages")
        if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
            raise _Refusal("the last-match loop has an else, a filter, recursion or an unpacking target")
        *positions, choice = loop.body
        if not isinstance(choice, nodes.If) or choice.elif_ or choice.else_ or len(positions) > 1:
            raise _Refusal("the reverse loop over the messages is not one test of each message")
        position_names = {
            statement.target.name
            for statement in positions
            if isinstance(statement, nodes.Assign)
            and isinstance(statement.target, nodes.Name)
            and _is_reverse_position(statement.node)
        }
        if len(position_names) != len(positions):
            raise _Refusal("the last-match loop sets something other than the message's position")
        flag, *test = _conjuncts(choice.test)
        if not (test and isinstance(flag, nodes.Getattr) and isinstance(flag.node, nodes.Name)):
            raise _Refusal("the last-match loop's test does not start with a namespace flag")
        namespace = flag.node.name
        body: list[nodes.Node] = choice.body
        locals_: list[nodes.Assign] = []
        if _is_local_then_test(body):  # Qwen 3.5's: {% set text = <the message's> %}{% if <of text> %}...
            local, inner = body
            assert isinstance(local, nodes.Assign) and isinstance(inner, nodes.If)  # (_is_local_then_test)
            locals_, test, body = [local], [*test, inner.test], inner.body
        writes = {
            statement.target.attr: statement.node
            for statement in body
            if isinstance(statement, nodes.Assign)
            and isinstance(statement.target, nodes.NSRef)
            and statement.target.name == namespace
        }
        picked = writes.pop(flag.attr, None)
        [(index, position)] = writes.items() if len(writes) == 1 else [("", None)]
        if (
            len(body) != 2
            or not _is_const(picked, False)
            or not (_is_reverse_position(position) or any(_is_name(position, name) for name in position_names))
        ):
            raise _Refusal("the last-match loop does not keep exactly a flag and the matched position")
        target = self.match_target = loop.target.name
        readable = {target, *(local.target.name for local in locals_), *self.identity_macros}  # type: ignore[attr-defined]
        for condition in (*test, *(local.node for local in locals_)):
            if any(name.name not in readable for name in condition.find_all(nodes.Name)):
                raise _Refusal("the last-match loop's test reads more than the message")
            self.check(condition, _Scope(in_any_loop=True, no_namespace_writes=True))
        declaration = _namespace_declaration(head[: head.index(loop)], namespace, flag.attr, index)
        conjunction = _conjunction(test) if not locals_ else None
        self.last_match = LastMatch.of(
            declaration, loop, namespace, flag.attr, index, self.macro_definitions, conjunction
        )
        self.match_namespace, self.match_index, self.match_flag = namespace, index, flag.attr
        self.match_statements = (declaration, loop)

    def _find_forward_match(self, head: list[nodes.Node], folds: list[nodes.For]) -> nodes.For | None:
        """The forward form of a last-match loop among the loops over the messages before
        the messages loop (GLM's), if one is: ``{% set ns = namespace(index=-1) %}`` and
        ``{% for m in messages %}{% if <a test of m alone> %}{% set ns.index = loop.index0
        %}{% endif %}{% endfor %}``; ``ns.index`` is then the last match, -1 where there
        is none. Checked whole; it is the last-match loop."""
        for fold in folds:
            choice = fold.body[0] if len(fold.body) == 1 else None
            if not (isinstance(choice, nodes.If) and not choice.elif_ and not choice.else_ and len(choice.body) == 1):
                continue
            (write,) = choice.body
            if not (
                isinstance(write, nodes.Assign)
                and isinstance(write.target, nodes.NSRef)
                and _is_loop_attr(write.node, "index0")
            ):
                continue
            if fold.else_ or fold.test is not None or fold.recursive or not isinstance(fold.target, nodes.Name):
                raise _Refusal("the last-match loop has an else, a filter, recursion or an unpacking target")
            if self.lists != {MESSAGES} or self.loop_list != MESSAGES:
                raise _Refusal("a last-match loop in a template that peels messages")
            namespace, index = write.target.name, write.target.attr
            readable = {fold.target.name, *self.identity_macros}
            if any(name.name not in readable for name in choice.test.find_all(nodes.Name)):
                raise _Refusal("the last-match loop's test reads more than the message")
            self.check(choice.test, _Scope(in_any_loop=True, no_namespace_writes=True))
            declaration = _forward_declaration(head[: head.index(fold)], namespace, index)
            self.last_match = LastMatch.of(
                declaration, fold, namespace, None, index, self.macro_definitions, choice.test
            )
            self.match_namespace, self.match_index, self.match_target = namespace, index, fold.target.name
            self.match_statements = (declaration, fold)
            return fold
        return None

    def _is_content_read(self, node: nodes.Node) -> bool:
        """``message.content`` of the messages loop's or the last-match loop's message, or of
        ``messages[0]``."""
        if not isinstance(node, nodes.Getattr | nodes.Getitem) or key_of(node) != "content":
            return False
        message = node.node
        if self._is_first_message(message):
            return True
        names = {self.match_target, self.message_loop.target.name if self.message_loop is not None else None}  # type: ignore[attr-defined]
        return isinstance(message, nodes.Name) and message.ctx == "load" and message.name in names

    def _is_unmatched_raise(self, node: nodes.Node) -> bool:
        """``{% if ns.flag %}{{ raise_exception('...') }}{% endif %}`` after the last-match
        loop (Qwen 3.5's "no user query"): a conversation that rendered has a match, and so
        has every conversation continuing it, so this never raises for those."""
        return (
            self.match_namespace is not None
            and isinstance(node, nodes.If)
            and not node.elif_
            and not node.else_
            and isinstance(node.test, nodes.Getattr)
            and _is_name(node.test.node, self.match_namespace)
            and node.test.attr == self.match_flag
            and all(
                isinstance(statement, nodes.Output) and all(_is_raise(part) for part in statement.nodes)
                for statement in node.body
            )
        )

    def _is_match_comparison(self, node: nodes.Compare) -> bool:
        """``loop.index0 > ns.index`` (any comparison, either way round): the same answer
        for a message in the whole list and in a window holding the match (module docstring)."""
        if self.match_namespace is None or len(node.ops) != 1:
            return False
        sides = (node.expr, node.ops[0].expr)
        matched = [
            side
            for side in sides
            if isinstance(side, nodes.Getattr)
            and _is_name(side.node, self.match_namespace)
            and side.attr == self.match_index
        ]
        return len(matched) == 1 and any(_is_loop_attr(side, "index0") for side in sides)

    def _is_list(self, node: nodes.Node) -> bool:
        return isinstance(node, nodes.Name) and node.name in self.lists and node.ctx == "load"

    def _is_first_message(self, node: nodes.Node) -> bool:
        """``messages[0]`` (or of a name set to the messages)."""
        return isinstance(node, nodes.Getitem) and self._is_list(node.node) and _is_int(node.arg, 0)

    def _is_non_empty_test(self, node: nodes.Node) -> bool:
        """``messages | length > 0`` or ``!= 0``."""
        if not (isinstance(node, nodes.Compare) and len(node.ops) == 1):
            return False
        length, [operand] = node.expr, node.ops
        return (
            isinstance(length, nodes.Filter)
            and length.name == "length"
            and length.node is not None
            and self._is_list(length.node)
            and not (length.args or length.kwargs or length.dyn_args or length.dyn_kwargs)
            and operand.op in ("gt", "ne")
            and _is_int(operand.expr, 0)
        )

    def _is_peel(self, node: nodes.Node, scope: _Scope) -> bool:
        """A head statement that sets ``messages`` or another name to the messages or to
        the messages after the first; counts the peels."""
        if not (isinstance(node, nodes.Assign) and isinstance(node.target, nodes.Name) and scope == _HEAD):
            return False
        if node.target.name not in self.lists:
            return False
        peeled = _peeled_list(node.node, self.lists)
        if peeled is None:
            return False
        self.peels += peeled
        return True

    def _guarded(self, node: nodes.Or | nodes.And, scope: _Scope) -> bool:
        """``loop.first or X`` (``loop.index0 == 0 or X``, ``not loop.first and X``): X may
        read the message before; ``loop.last or X`` (``not loop.last and X``) the one after.
        Checks both sides and says True, or says False for any other ``or``/``and``."""
        test = node.left
        if isinstance(node, nodes.And):
            if not isinstance(test, nodes.Not):
                return False
            test = test.node
        if _is_loop_attr(test, "first") or (isinstance(test, nodes.Compare) and _is_first_position(test)):
            inner = replace(scope, previous_guarded=True)
        elif _is_loop_attr(test, "last"):
            inner = replace(scope, next_guarded=True)
        else:
            return False
        self.check(node.left, scope)
        self.check(node.right, inner)
        return True

    def _is_neighbour(self, node: nodes.Node, scope: _Scope) -> bool:
        """``messages[loop.index0 - 1]`` or ``[loop.index0 + 1]`` under its guard (:meth:`_guarded`)."""
        if not (
            scope.in_message_loop
            and isinstance(node, nodes.Getitem)
            and _is_name(node.node, self.loop_list)
            and isinstance(node.arg, nodes.Sub | nodes.Add)
            and _is_loop_attr(node.arg.left, "index0")
            and _is_int(node.arg.right, 1)
        ):
            return False
        if not (scope.previous_guarded if isinstance(node.arg, nodes.Sub) else scope.next_guarded):
            raise _Refusal("the messages loop reads a neighbour without loop.first or loop.last before it")
        self.lookaround = True
        return True

    def _is_clock(self, node: nodes.Node) -> bool:
        """``strftime_now('...')`` with a constant format (recorded), or ``strftime_now is defined``."""
        if isinstance(node, nodes.Test) and node.name == "defined" and _is_name(node.node, CLOCK):
            return True
        if not (isinstance(node, nodes.Call) and _is_name(node.node, CLOCK)):
            return False
        if node.kwargs or node.dyn_args or node.dyn_kwargs or len(node.args) != 1:
            return False
        [format] = node.args
        if not (isinstance(format, nodes.Const) and isinstance(format.value, str)):
            return False
        self.clock_formats.append(format.value)
        return True


def _is_constant_output(node: nodes.Node) -> bool:
    """Output of template text only."""
    return isinstance(node, nodes.Output) and all(isinstance(part, nodes.TemplateData) for part in node.nodes)


def _namespace_declarations(head: list[nodes.Node]) -> Iterator[str]:
    """The names the head's top-level statements set to a ``namespace(...)``."""
    for statement in head:
        if (
            isinstance(statement, nodes.Assign)
            and isinstance(statement.target, nodes.Name)
            and isinstance(statement.node, nodes.Call)
            and _is_name(statement.node.node, "namespace")
        ):
            yield statement.target.name


def _is_generation_default(node: nodes.Node) -> bool:
    """``{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}
    {% endif %}``: never runs, since every render passes ``add_generation_prompt``."""
    return (
        isinstance(node, nodes.If)
        and not node.elif_
        and not node.else_
        and isinstance(node.test, nodes.Not)
        and isinstance(node.test.node, nodes.Test)
        and node.test.node.name == "defined"
        and _is_name(node.test.node.node, GENERATION_FLAG)
        and len(node.body) == 1
        and isinstance(node.body[0], nodes.Assign)
        and _is_store(node.body[0].target, GENERATION_FLAG)
        and isinstance(node.body[0].node, nodes.Const)
    )


def _namespace_calls(head: list[nodes.Node], namespace: str) -> Iterator[tuple[nodes.Assign, dict[str, nodes.Node]]]:
    """Each top-level ``{% set <namespace> = namespace(key=value, ...) %}`` in ``head``,
    with its keywords' values."""
    for statement in head:
        if not (isinstance(statement, nodes.Assign) and _is_store(statement.target, namespace)):
            continue
        call = statement.node
        if (
            isinstance(call, nodes.Call)
            and _is_name(call.node, "namespace")
            and not (call.args or call.dyn_args or call.dyn_kwargs)
        ):
            yield statement, {keyword.key: keyword.value for keyword in call.kwargs}


def _namespace_declaration(head: list[nodes.Node], namespace: str, flag: str, index: str) -> nodes.Assign:
    """The top-level ``{% set ns = namespace(flag=true, index=messages|length - 1) %}`` before
    the last-match loop."""
    for statement, values in _namespace_calls(head, namespace):
        if values.keys() == {flag, index} and _is_const(values[flag], True) and _is_last_position(values[index]):
            return statement
    raise _Refusal(f"the last-match loop's namespace is not set to namespace({flag}=true, {index}=messages|length - 1)")


def _forward_declaration(head: list[nodes.Node], namespace: str, index: str) -> nodes.Assign:
    """The top-level ``{% set ns = namespace(index=-1) %}`` (any negative constant) before
    the forward last-match loop."""
    for statement, values in _namespace_calls(head, namespace):
        if values.keys() == {index} and _is_negative_int(values[index]):
            return statement
    raise _Refusal(f"the last-match loop's namespace is not set to namespace({index}=-1)")


def _is_negative_int(node: nodes.Node) -> bool:
    """``-1`` (as Jinja parses it: the negation of a positive constant), or a negative constant."""
    if isinstance(node, nodes.Neg):
        node = node.node
        return isinstance(node, nodes.Const) and type(node.value) is int and node.value > 0
    return isinstance(node, nodes.Const) and type(node.value) is int and node.value < 0


def _is_local_then_test(body: list[nodes.Node]) -> bool:
    """``{% set name = ... %}{% if ... %}...{% endif %}`` (no ``elif``, no ``else``)."""
    return (
        len(body) == 2
        and isinstance(body[0], nodes.Assign)
        and isinstance(body[0].target, nodes.Name)
        and isinstance(body[1], nodes.If)
        and not body[1].elif_
        and not body[1].else_
    )


def _is_raise(node: nodes.Node) -> bool:
    """``raise_exception('...')``."""
    return (
        isinstance(node, nodes.Call)
        and _is_name(node.node, "raise_exception")
        and all(isinstance(argument, nodes.Const) for argument in node.args)
        and not (node.kwargs or node.dyn_args or node.dyn_kwargs)
    )


def _conjunction(tests: list[nodes.Node]) -> nodes.Node:
    """``tests`` joined by ``and`` (the inverse of :func:`_conjuncts`)."""
    joined = tests[0]
    for test in tests[1:]:
        joined = nodes.And(joined, test)
    return joined


def _matching_roles(test: nodes.Node, target: str) -> frozenset[str] | None:
    """The roles for which ``test`` holds of message ``target`` where it only compares the
    message's role with constants, by ``==`` or ``in`` (joined by ``and``, ``or``); None
    where it reads anything else."""
    if isinstance(test, nodes.And | nodes.Or):
        left, right = _matching_roles(test.left, target), _matching_roles(test.right, target)
        if left is None or right is None:
            return None
        return left & right if isinstance(test, nodes.And) else left | right
    found = role_comparison(test)
    if found is None:
        return None
    message, constants, holds = found
    roles = [constant for constant in constants if isinstance(constant, str)]
    if not holds or not _is_name(message, target) or len(roles) != len(constants):
        return None
    return frozenset(roles)


class _Undecided(Exception):
    """A Python last-match test met a message it cannot judge as the template would (a
    content that is no string asked a string's question): the template's loop runs."""


def _message_test(test: nodes.Node, target: str) -> Callable[[Mapping[str, Any]], bool] | None:
    """``test`` of message ``target`` in Python, where it is made (with ``and``, ``or``,
    ``not``) of role comparisons (:func:`_matching_roles`), ``content is string``, and
    ``content.startswith('x')``, ``content.endswith('x')``, ``'x' in content`` on a string
    content; None where it reads anything else. Run on converted messages."""
    if isinstance(test, nodes.Not):
        inner = _message_test(test.node, target)
        return None if inner is None else lambda message: not inner(message)
    if isinstance(test, nodes.And | nodes.Or):
        left, right = _message_test(test.left, target), _message_test(test.right, target)
        if left is None or right is None:
            return None
        if isinstance(test, nodes.And):
            return lambda message: left(message) and right(message)
        return lambda message: left(message) or right(message)
    roles = _matching_roles(test, target)
    if roles is not None:
        return lambda message: _role_of(message) in roles
    if isinstance(test, nodes.Test) and test.name == "string" and _is_content_of(test.node, target):
        if test.args or test.kwargs or test.dyn_args or test.dyn_kwargs:
            return None
        return lambda message: type(message.get("content")) is str
    asked = _content_question(test, target)
    if asked is None:
        return None
    question, constant, negated = asked

    def answer(message: Mapping[str, Any]) -> bool:
        content = message.get("content")
        if type(content) is not str:
            raise _Undecided
        return question(content, constant) != negated

    return answer


def _role_of(message: Any) -> str | None:
    """A message's role where it is a text (a malformed message, as sent, fails its
    conversion later; here it matches nothing)."""
    role = message.get("role") if isinstance(message, Mapping) else None
    return role if type(role) is str else None


def _content_question(test: nodes.Node, target: str) -> tuple[Callable[[str, str], bool], str, bool] | None:
    """``content.startswith('x')``, ``content.endswith('x')``, ``'x' in content`` (or ``not
    in``) of message ``target``: the question, its constant, whether it is negated."""
    if isinstance(test, nodes.Call) and isinstance(test.node, nodes.Getattr):
        method = test.node
        if method.attr not in ("startswith", "endswith") or not _is_content_of(method.node, target):
            return None
        if test.kwargs or test.dyn_args or test.dyn_kwargs or len(test.args) != 1:
            return None
        (constant,) = test.args
        if not (isinstance(constant, nodes.Const) and type(constant.value) is str):
            return None
        return (str.startswith if method.attr == "startswith" else str.endswith), constant.value, False
    if isinstance(test, nodes.Compare) and len(test.ops) == 1 and test.ops[0].op in ("in", "notin"):
        constant, content = test.expr, test.ops[0].expr
        if isinstance(constant, nodes.Const) and type(constant.value) is str and _is_content_of(content, target):
            return (lambda text, part: part in text), constant.value, test.ops[0].op == "notin"
    return None


def _is_content_of(node: nodes.Node, target: str) -> bool:
    """``target.content`` (or ``target['content']``)."""
    return isinstance(node, nodes.Getattr | nodes.Getitem) and key_of(node) == "content" and _is_name(node.node, target)


def _conjuncts(test: nodes.Node) -> list[nodes.Node]:
    """``a and b and c`` as ``[a, b, c]``."""
    if isinstance(test, nodes.And):
        return [*_conjuncts(test.left), *_conjuncts(test.right)]
    return [test]


def _is_reversed(node: nodes.Node) -> bool:
    """``messages[::-1]``."""
    return (
        isinstance(node, nodes.Getitem)
        and _is_name(node.node, MESSAGES)
        and isinstance(node.arg, nodes.Slice)
        and node.arg.start is None
        and node.arg.stop is None
        and isinstance(node.arg.step, nodes.Neg)
        and _is_int(node.arg.step.node, 1)
    )


def _is_last_position(node: nodes.Node | None) -> bool:
    """``messages|length - 1``."""
    return (
        isinstance(node, nodes.Sub)
        and isinstance(node.left, nodes.Filter)
        and node.left.name == "length"
        and _is_name(node.left.node, MESSAGES)
        and not (node.left.args or node.left.kwargs or node.left.dyn_args or node.left.dyn_kwargs)
        and _is_int(node.right, 1)
    )


def _is_reverse_position(node: nodes.Node | None) -> bool:
    """``(messages|length - 1) - loop.index0``: the position in the list of the message a
    reverse loop is at."""
    return isinstance(node, nodes.Sub) and _is_last_position(node.left) and _is_loop_attr(node.right, "index0")


def _is_store(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name and node.ctx == "store"


def _is_const(node: nodes.Node | None, value: bool) -> bool:
    return isinstance(node, nodes.Const) and node.value is value


def _needs_generation_flag(test: nodes.Node) -> bool:
    """Whether ``test`` is false whenever ``add_generation_prompt`` is."""
    if isinstance(test, nodes.Name):
        return test.name == GENERATION_FLAG
    if isinstance(test, nodes.And):
        return _needs_generation_flag(test.left) or _needs_generation_flag(test.right)
    return False


def _children(node: nodes.Node, scope: _Scope) -> Iterator[tuple[nodes.Node, _Scope]]:
    """``node``'s children, each with the scope it is evaluated in."""
    if isinstance(node, nodes.For):
        # The iterable (and a filter) are evaluated outside the nested loop; in its body
        # ``loop`` is the nested loop's own.
        yield node.iter, scope
        if node.test is not None:
            yield node.test, scope
        inner = _Scope(
            in_message_loop=False,
            in_any_loop=True,
            no_namespace_writes=scope.no_namespace_writes,
            in_tail=scope.in_tail,
            per_message=scope.per_message,
        )
        for child in (node.target, *node.body, *node.else_):
            yield child, inner
        return
    if isinstance(node, nodes.Macro | nodes.CallBlock):
        inner = _Scope(
            in_message_loop=scope.in_message_loop,
            in_any_loop=scope.in_any_loop,
            no_namespace_writes=True,
            in_tail=scope.in_tail,
            per_message=scope.per_message,
        )
        for child in node.iter_child_nodes():
            yield child, inner
        return
    for child in node.iter_child_nodes():
        yield child, scope


def _is_name(node: nodes.Node | None, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name and node.ctx == "load"


def _is_loop(node: nodes.Node) -> bool:
    return _is_name(node, "loop")


def _is_loop_attr(node: nodes.Node, attr: str) -> bool:
    return isinstance(node, nodes.Getattr) and _is_loop(node.node) and node.attr == attr


def _is_int(node: nodes.Node | None, value: int) -> bool:
    return isinstance(node, nodes.Const) and type(node.value) is int and node.value == value


def _is_parity(node: nodes.Node) -> bool:
    """``loop.index0 % 2`` or ``loop.index % 2``, or ``loop.index0 is even`` (``odd``, of
    ``loop.index`` too): the same for a message wherever it sits at the same parity."""
    if isinstance(node, nodes.Mod):
        position, divisor = node.left, node.right
        if not _is_int(divisor, 2):
            return False
    elif isinstance(node, nodes.Test) and node.name in ("even", "odd") and not (node.args or node.kwargs):
        position = node.node
    else:
        return False
    return _is_loop_attr(position, "index0") or _is_loop_attr(position, "index")


def _is_first_position(node: nodes.Compare) -> bool:
    """``loop.index0 == 0`` or ``loop.index == 1``: ``loop.first`` spelt out."""
    if len(node.ops) != 1 or node.ops[0].op != "eq":
        return False
    position, value = node.expr, node.ops[0].expr
    return (
        isinstance(position, nodes.Getattr)
        and _is_loop(position.node)
        and ((position.attr == "index0" and _is_int(value, 0)) or (position.attr == "index" and _is_int(value, 1)))
    )
