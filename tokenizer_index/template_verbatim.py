"""Which chat templates print a message's text verbatim: the syntax check behind skeletons.

:mod:`kvroute.tokenizer_index.render_skeleton` renders a short chat of plain messages (a
role and a text each), tool results and tool calls by filling a skeleton per shape with
the texts, which is exact only where the template's output depends on a text by printing
it (as it is, trimmed or stripped of whitespace, or as ``tojson`` writes it) and on
nothing else of it but its type, its truth and tests the filled texts answer no to; and
on a tool call's arguments only by printing them (through ``tojson``, or each value of
them). :func:`verbatim_check` reads that off the template's syntax tree, as :mod:`~kvroute.tokenizer_index.template_prefix` reads whether a conversation's
render is its messages' renders in a row; both refuse what they cannot prove.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from jinja2 import nodes

from kvroute.tokenizer_index.template_macros import identity_macros, is_identity_call
from kvroute.tokenizer_index.template_syntax import decided, key_of, live, role_comparison

#: Roles a plain message may have: a client's invented roles would only churn the shapes.
PLAIN_ROLES = frozenset({"system", "developer", "user", "assistant"})
#: Roles with tool calls or results a skeleton may fill (:func:`verbatim_check` with ``tools``).
TOOL_ROLES = PLAIN_ROLES | {"tool"}
#: A tool call's fields (or its function's) that hold a text: printed, never otherwise read.
CALL_TEXT_KEYS = frozenset({"id", "type", "name"})

# Tests that read only a value's type: a text's are the same for every text.
_TYPE_TESTS = frozenset({"string", "defined", "undefined", "none", "mapping", "sequence", "iterable"})
# What a tool call argument's value is tested for: its type, or its value where that is
# part of the shape (true, false, none).
_VALUE_TESTS = _TYPE_TESTS | {"number", "integer", "float", "boolean", "true", "false"}
# ``text | length`` compared so that only whether the text is empty matters: (op, constant)
# with the length on the left; a comparison with it on the right is flipped first.
_EMPTINESS_COMPARISONS = frozenset({("gt", 0), ("ne", 0), ("eq", 0), ("lteq", 0), ("gteq", 1), ("lt", 1)})
_FLIPPED = {"gt": "lt", "lt": "gt", "gteq": "lteq", "lteq": "gteq", "eq": "eq", "ne": "ne"}
# What an argument's value has become on its way to the output: the value itself, a text
# made of it (``| string``, ``| tojson``), or markup (``| safe``), which escapes what it is
# joined with.
_RAW, _TEXT, _MARKUP = "raw", "text", "markup"
# A dict's own attributes: ``message.get("content")`` reads the text past the check.
_DICT_ATTRIBUTES = frozenset(dir(dict))
# Globals and filters whose output changes between renders of the same input (the clock,
# ``strftime_now``, is allowed with a constant format: its text joins the shape).
_UNSTABLE_NAMES = frozenset({"lipsum"})
_UNSTABLE_FILTERS = frozenset({"random"})
#: Rounds of finding the names set from texts and the branches left live, at most.
_SETTLE_ROUNDS = 8


class _Refusal(Exception):
    """The template reads a message's text some way other than printing it."""


@dataclass(frozen=True, slots=True)
class Verbatim:
    """What a template's syntax says of skeletons (:func:`verbatim_check`)."""

    #: Why the template may not render from skeletons; None when it may.
    refusal: str | None
    #: The formats of the ``strftime_now`` calls (constant): their texts join a shape's key.
    clock_formats: tuple[str, ...] = ()
    #: What the template asks of a text (``startswith``, ``endswith``, ``in``; with the
    #: constant asked): a skeleton is for texts where every answer is no.
    tests: tuple[tuple[str, str], ...] = ()
    #: The whitespace it strips texts of by name (``content.lstrip('\n')``): which slots of
    #: a shape such a strip reaches, and at which end, its skeleton finds out
    #: (:mod:`~kvroute.tokenizer_index.render_skeleton`); a text with one of them at such
    #: an end renders whole. (A strip of every whitespace character, ``content.strip()``,
    #: takes the skeleton's pads off its marks: such a slot is filled trimmed, and one
    #: stripped at one end only has no skeleton.)
    strip_characters: str = ""
    #: Whether it iterates a tool call's arguments (``for k, v in arguments | items``): then
    #: their keys join a shape and each value fills a slot of its own.
    argument_items: bool = False

    def admits(self, text: str) -> bool:
        """Whether a message's ``text`` may fill a skeleton under this template."""
        if text and text.isspace():
            return False
        return not self.answers_yes(text)

    def admits_all(self, texts: Iterable[str]) -> bool:
        """Whether every one of ``texts`` may fill a skeleton (:meth:`admits`)."""
        if not self.tests:  # (then only whitespace is refused: in C)
            return not any(map(str.isspace, texts))
        return all(map(self.admits, texts))

    def answers_yes(self, text: str) -> bool:
        """Whether one of the template's tests of a text says yes for ``text``, or for it
        trimmed (a template may test a text it trimmed first)."""
        stripped = text.strip()
        for kind, constant in self.tests:
            if kind == "startswith":
                if text.startswith(constant) or stripped.startswith(constant):
                    return True
            elif kind == "endswith":
                if text.endswith(constant) or stripped.endswith(constant):
                    return True
            elif constant in text:  # (what the trimmed text holds, the text holds)
                return True
        return False


def verbatim_check(tree: nodes.Template, *, tools: bool = False, parts: bool = False) -> Verbatim:
    """Whether ``tree`` may render short plain chats from skeletons (``tools``: chats with
    tool calls and tool results too; ``parts``: under a content format of parts, where vLLM
    hands the template each text as one part, ``[{"type": "text", "text": ...}]``).

    It may where every read of a message's text (``message.content``, ``message['content']``,
    ``messages[i].content``, and names set from them) is printed as it is or trimmed,
    joined with ``+`` or ``~``, chosen by ``if``/``or``/``and``, stripped of whitespace,
    or only tested for its type, its truth, or whether it starts with, ends with or holds a
    constant; messages themselves are only indexed by a constant key, tested for a key
    (``'x' in message``) or their type, counted (``messages | length``), copied or sliced
    into a name (``{% set messages = messages[1:] %}``) or looped over; nothing printed
    from a text is captured (``{% set %}`` blocks, macros, filter and call blocks); nothing
    reads chance (``lipsum``, ``random``), and the clock only through ``strftime_now`` with
    a constant format. Branches a plain message never takes (``message.role == 'tool'``,
    ``'tool_calls' in message``, ``'</think>' in content``: a skeleton is only for texts
    where such tests say no) are not read.

    With ``tools``, tool results and assistants' tool calls are messages too: a tool
    result's ``tool_call_id`` and a call's ``id``, ``type`` and function ``name`` are texts
    as above (also printed through ``tojson``); a message's ``tool_calls`` are only looped
    over, indexed, counted or tested; a call only read by constant keys (``function``
    giving a call again, as names set from it or from ``call.function if ... else call``
    are), tested for a key or its type; its ``arguments`` (or a name set from them, as
    GLM's ``{% set _args = tc.arguments %}``) only printed (as they are or through
    ``tojson``), tested for their type or truth, or iterated (``for k, v in
    arguments | items``, ``for k in arguments`` with ``arguments[k]``: the keys join the
    shape, :attr:`Verbatim.argument_items`), each value then only printed (as Python
    writes it, through ``string``, ``tojson``, ``safe``), joined, set to a name, or tested
    for its type or truth. Branches of role ``tool`` and of ``'tool_calls' in message``
    are then read. ``tojson(ensure_ascii=False)`` is ``tojson`` (its default).

    A text may also be measured for whether it is empty (``content | trim | length > 0``),
    and in a loop over messages ``loop.previtem`` and ``loop.nextitem`` are messages too
    (Qwen 3 Coder groups tool results by their neighbours' roles). A macro that, given a
    string as its first argument, prints just that (Qwen 3.5's ``render_content``: its
    other branches walk content parts) is called with one text as the text itself; its
    body is then not read, for it runs no other way.

    With ``parts`` (Gemma 3's, Llama 4's, GLM's templates), a message's ``content`` is a
    list of parts: only looped over, indexed by a number, counted or tested (``is string``
    is false, so that branch is not read), or handed to a macro that prints its parts'
    texts (GLM's ``visible_text``: the call is the text); a part only read by constant keys,
    its ``text`` a text as above, its ``type`` (``"text"`` for every part a skeleton fills)
    any way. With ``tools`` too, vLLM hands a tool result's content over as a text: a read
    of a loop message's content is of parts where the ``if`` branches around it (tests of
    its role) leave it no tool result, of a text where they leave it only one, and
    otherwise only tested for its type.
    """
    try:
        check = _VerbatimCheck(tree, tools=tools, parts=parts)
        check.run()
    except _Refusal as refusal:
        return Verbatim(str(refusal))
    return Verbatim(
        None,
        tuple(sorted(check.clock_formats)),
        tuple(sorted(check.tests)),
        "".join(sorted(check.strip_characters)),
        bool(check.key_names),
    )


class _VerbatimCheck:
    def __init__(self, tree: nodes.Template, *, tools: bool = False, parts: bool = False) -> None:
        self._tree = tree
        self._tools = tools
        self._parts = parts
        self._roles = TOOL_ROLES if tools else PLAIN_ROLES
        # A message's fields that hold a text, and those a message may have or not. (Under a
        # content format of parts, a content is a text only where the message is a tool
        # result: vLLM hands those over as texts. :meth:`_content_kind`.)
        texts = ("content", "tool_call_id") if tools else ("content",)
        self._text_keys: tuple[str, ...] = tuple(key for key in texts if not (parts and key == "content"))
        self._optional_keys = ("tool_calls", "tool_call_id") if tools else ()
        self._parents: dict[int, nodes.Node] = {}
        for node in _walk(tree):
            for child in node.iter_child_nodes():
                self._parents[id(child)] = node
        # Macros that print their first argument when it is a string, and nothing else; and
        # (``parts``) those that print the texts of a list of text parts, and nothing else.
        self._identity_macros = identity_macros(tree)
        self._parts_macros = identity_macros(tree, parts=True) if parts else frozenset()
        read_through = self._identity_macros | self._parts_macros
        self._skipped = frozenset(id(macro) for macro in tree.find_all(nodes.Macro) if macro.name in read_through)
        # Names of message lists (``messages`` and copies or slices of it) and of messages
        # (loop variables over those); the stores that make them, the only ones allowed.
        self._list_names = {"messages"}
        self._allowed_stores: set[int] = set()
        self._list_copies: set[int] = set()
        self._find_list_names()
        self._message_names: set[str] = set()
        for loop in tree.find_all(nodes.For):
            if self._is_list(loop.iter):
                if not isinstance(loop.target, nodes.Name):
                    raise _Refusal("a loop over the messages unpacks them")
                self._message_names.add(loop.target.name)
                self._allowed_stores.add(id(loop.target))
        # Under parts with tool results: what each read of a loop message's content is.
        self._content_kinds = self._find_content_kinds() if parts and tools else {}
        # Names of a message's content parts (``parts``): loop variables over its content.
        self._part_names: set[str] = set()
        for loop in tree.find_all(nodes.For):
            if self._is_parts(loop.iter):
                if not isinstance(loop.target, nodes.Name):
                    raise _Refusal("a loop over a message's parts unpacks them")
                self._part_names.add(loop.target.name)
                self._allowed_stores.add(id(loop.target))
        # Names of tool calls (or their functions): loop variables over a message's calls,
        # and names set only from calls.
        self._call_names: set[str] = set()
        # Names of an argument's key (loop variables over a call's arguments: the keys join
        # the shape, so they may be read any way) and of its value.
        self.key_names: set[str] = set()
        self._value_names: set[str] = set()
        # Names set from a call's arguments (GLM's ``{% set _args = tc.arguments %}``).
        self._arguments_names: set[str] = set()
        if tools:
            self._find_call_names()
            self._find_arguments_names()
            self._find_argument_names()
        # Names set from a text (their every read is checked as the text's), and those of
        # them that may hold something besides one text or '' (never tested): found by
        # :meth:`_settle_names`, over the branches a plain message takes.
        self._content_names: set[str] = set()
        self._mixed_names: set[str] = set()
        self.clock_formats: set[str] = set()
        self.tests: set[tuple[str, str]] = set()
        self.strip_characters: set[str] = set()

    def _is_list(self, node: nodes.Node) -> bool:
        """A message list: a list name, or a slice of one (``messages[::-1]``)."""
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        return isinstance(node, nodes.Name) and node.name in self._list_names

    def _find_list_names(self) -> None:
        assigns = list(self._tree.find_all(nodes.Assign))
        while True:
            known = len(self._list_names)
            for assign in assigns:
                value = assign.node
                copied = (
                    value.node if isinstance(value, nodes.Getitem) and isinstance(value.arg, nodes.Slice) else value
                )
                if isinstance(copied, nodes.Name) and copied.name in self._list_names:
                    if not isinstance(assign.target, nodes.Name):
                        raise _Refusal("the messages are unpacked")
                    self._list_names.add(assign.target.name)
                    self._allowed_stores.add(id(assign.target))
                    self._list_copies.add(id(copied))
            if len(self._list_names) == known:
                return

    def _find_call_names(self) -> None:
        for node in _walk(self._tree):
            if isinstance(node, nodes.For) and self._is_call_list(node.iter):
                if not isinstance(node.target, nodes.Name):
                    raise _Refusal("a loop over tool calls unpacks them")
                self._call_names.add(node.target.name)
                self._allowed_stores.add(id(node.target))
        self._add_names_set_from(self._call_names, self._is_call)
        if self._call_names & (self._list_names | self._message_names):
            raise _Refusal("a name holds tool calls and messages")

    def _add_names_set_from(self, names: set[str], sets_from: Callable[[nodes.Node], bool]) -> None:
        """Add to ``names`` every name a ``set`` gives a value ``sets_from`` accepts (which
        may read a name already in ``names``), to a fixed point; their stores are allowed."""
        assigns = [node for node in _walk(self._tree) if isinstance(node, nodes.Assign)]
        while True:
            known = len(names)
            for assign in assigns:
                if isinstance(assign.target, nodes.Name) and sets_from(assign.node):
                    names.add(assign.target.name)
                    self._allowed_stores.add(id(assign.target))
            if len(names) == known:
                return

    def _find_arguments_names(self) -> None:
        """The names set only from a call's arguments (or from such a name)."""
        self._add_names_set_from(self._arguments_names, self._is_arguments)
        if self._arguments_names & (self._list_names | self._message_names | self._call_names):
            raise _Refusal("a name holds a tool call's arguments and something else")

    def _find_argument_names(self) -> None:
        """The key and value names of loops over a call's arguments (``for k, v in
        arguments | items``, ``arguments.items()``, ``for k in arguments``), and the names
        set from a value (``arguments[k]``, or a name already found)."""
        for node in _walk(self._tree):
            if isinstance(node, nodes.For) and self._argument_loop(node.iter) is not None:
                targets = node.target.items if isinstance(node.target, nodes.Tuple) else [node.target]
                expected = 2 if self._argument_loop(node.iter) == "items" else 1
                if len(targets) != expected or not all(isinstance(target, nodes.Name) for target in targets):
                    raise _Refusal("a loop over a tool call's arguments unpacks them otherwise")
                self.key_names.add(targets[0].name)  # type: ignore[attr-defined]
                self._allowed_stores.update(id(target) for target in targets)
                if expected == 2:
                    self._value_names.add(targets[1].name)  # type: ignore[attr-defined]
        self._add_names_set_from(self._value_names, lambda value: any(map(self._reads_value, _walk(value))))
        if self.key_names & self._value_names:
            raise _Refusal("a name holds an argument's key and its value")

    def _argument_loop(self, node: nodes.Node) -> str | None:
        """``"items"`` where ``node`` is a call's arguments as pairs (``arguments | items``,
        ``arguments.items()``), ``"keys"`` where it is the arguments themselves; else None."""
        if self._is_arguments(node):
            return "keys"
        if isinstance(node, nodes.Filter) and node.name == "items" and node.node is not None:
            return "items" if self._is_arguments(node.node) and not _has_arguments(node) else None
        if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr) and node.node.attr == "items":
            return "items" if self._is_arguments(node.node.node) and not _has_arguments(node) else None
        return None

    def _is_arguments(self, node: nodes.Node) -> bool:
        """A call's (or its function's) arguments, or a name set from them."""
        if isinstance(node, nodes.Name):
            return node.ctx == "load" and node.name in self._arguments_names
        return _is_field(node, "arguments", self._is_call)

    def _reads_value(self, node: nodes.Node) -> bool:
        """A read of an argument's value: a value name, ``arguments[key]``."""
        if isinstance(node, nodes.Name):
            return node.ctx == "load" and node.name in self._value_names
        return (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Name)
            and node.arg.name in self.key_names
            and self._is_arguments(node.node)
        )

    def _find_content_kinds(self) -> dict[int, str]:
        """Per read of a loop message's ``content`` (by id): ``"parts"`` where the message
        can be no tool result there, ``"text"`` where it can only be one (the ``if``
        branches around it test its role), ``"either"`` elsewhere."""
        kinds: dict[int, str] = {}

        def visit(node: nodes.Node, roles: dict[str, frozenset[str]]) -> None:
            if isinstance(node, nodes.Macro):  # (run where it is called: nothing known there)
                roles = {}
            elif isinstance(node, nodes.For):
                inner = {name: held for name, held in roles.items() if not _stores(node.target, name)}
                if self._is_list(node.iter) and isinstance(node.target, nodes.Name):
                    inner[node.target.name] = self._roles
                visit(node.iter, roles)
                for child in (*node.body, *((node.test,) if node.test is not None else ())):
                    visit(child, inner)
                for child in node.else_:
                    visit(child, roles)
                return
            elif isinstance(node, nodes.If):
                for branch in (node, *node.elif_):
                    visit(branch.test, roles)
                    for child in branch.body:
                        visit(child, self._narrowed(branch.test, roles, True))
                    roles = self._narrowed(branch.test, roles, False)
                for child in node.else_:
                    visit(child, roles)
                return
            elif isinstance(node, nodes.CondExpr):
                visit(node.test, roles)
                visit(node.expr1, self._narrowed(node.test, roles, True))
                if node.expr2 is not None:
                    visit(node.expr2, self._narrowed(node.test, roles, False))
                return
            elif isinstance(node, nodes.And | nodes.Or):
                visit(node.left, roles)
                visit(node.right, self._narrowed(node.left, roles, isinstance(node, nodes.And)))
                return
            elif isinstance(node, nodes.Getattr | nodes.Getitem) and key_of(node) == "content":
                message = node.node
                possible = roles.get(message.name) if isinstance(message, nodes.Name) else None
                if possible is not None:
                    kinds[id(node)] = "text" if possible <= {"tool"} else "either" if "tool" in possible else "parts"
            for child in node.iter_child_nodes():
                visit(child, roles)

        visit(self._tree, {})
        return kinds

    def _narrowed(self, test: nodes.Node, roles: dict[str, frozenset[str]], outcome: bool) -> dict[str, frozenset[str]]:
        """``roles`` (the roles each loop message may have) where ``test`` came out as
        ``outcome``: narrowed by the tests of a message's role it is made of."""
        if isinstance(test, nodes.Not):
            return self._narrowed(test.node, roles, not outcome)
        if isinstance(test, nodes.And | nodes.Or):
            deciding = isinstance(test, nodes.Or)  # (the outcome either side alone decides)
            left = self._narrowed(test.left, roles, not deciding)
            both = self._narrowed(test.right, left, not deciding)
            if outcome != deciding:
                return both
            alone = self._narrowed(test.left, roles, deciding)
            after = self._narrowed(test.right, left, deciding)
            return {name: alone[name] | after[name] for name in roles}
        found = self._role_test(test)
        if found is None or found[0] not in roles:
            return roles
        name, passing = found
        return {**roles, name: roles[name] & passing if outcome else roles[name] - passing}

    def _role_test(self, test: nodes.Node) -> tuple[str, frozenset[str]] | None:
        """``(message name, the roles that pass)`` where ``test`` compares a loop message's
        role with constants (``m.role == 'tool'``, ``!=``, ``in [...]``, ``not in``)."""
        found = role_comparison(test)
        if found is None:
            return None
        message, constants, holds = found
        if not (isinstance(message, nodes.Name) and message.name in self._message_names):
            return None
        passing = frozenset(role for role in self._roles if role in constants)
        return message.name, passing if holds else self._roles - passing

    def _content_kind(self, node: nodes.Node) -> str | None:
        """A message's content read at ``node``: ``"text"``, ``"parts"`` (its content
        format's list of parts), or ``"either"`` (a tool result's text or another's
        parts); None where ``node`` is no message's content."""
        if not self._is_message_field(node, "content"):
            return None
        if not self._parts:
            return "text"
        if not self._tools:
            return "parts"
        return self._content_kinds.get(id(node), "either")

    def _is_call_list(self, node: nodes.Node) -> bool:
        """A message's tool calls: ``message.tool_calls``, ``messages[i]['tool_calls']``."""
        return self._tools and self._is_message_field(node, "tool_calls")

    def _is_message_field(self, node: nodes.Node, key: str) -> bool:
        """``message.key`` or ``message['key']`` of a message (:meth:`_is_message`)."""
        return _is_field(node, key, self._is_message)

    def _is_call(self, node: nodes.Node) -> bool:
        """A tool call or its function: a call name, ``calls[i]``, ``call.function``,
        ``call.function if ... else call`` (``or``)."""
        if isinstance(node, nodes.Name):
            return node.name in self._call_names
        if isinstance(node, nodes.Getitem) and not isinstance(node.arg, nodes.Slice) and self._is_call_list(node.node):
            return True
        if isinstance(node, nodes.Getattr | nodes.Getitem):
            return key_of(node) == "function" and self._is_call(node.node)
        if isinstance(node, nodes.CondExpr):
            return node.expr2 is not None and self._is_call(node.expr1) and self._is_call(node.expr2)
        if isinstance(node, nodes.Or):
            return self._is_call(node.left) and self._is_call(node.right)
        return False

    def _settle_names(self) -> None:
        """The content and mixed names, to a fixed point with the branches they leave live.

        Optimistic: no name is mixed at first, so a test of a text may prune a branch whose
        sets would make it mixed; then the names are found again over what is left, until
        nothing changes. Sound by induction over a render: while only live branches have
        run, every name holds what a live ``set`` gave it, so every test pruning a branch
        tests one text (or ''), which a skeleton's texts answer no to.
        """
        every_branch = _walk(self._tree)
        self._content_names = self._names_set_from_texts(every_branch)  # (none mixed yet)
        for _ in range(_SETTLE_ROUNDS):
            known = (self._content_names, self._mixed_names)
            assigns = [
                node
                for node in live(self._tree, self._plain_truth, self._skipped)
                if isinstance(node, nodes.Assign) and _target_key(node.target) is not None
            ]
            content = self._content_names = self._names_set_from_texts(assigns)
            # (a namespace's attribute is always mixed: it keeps its value from message to message)
            self._mixed_names = {
                key
                for assign in assigns
                if (key := _target_key(assign.target)) in content
                and (isinstance(assign.target, nodes.NSRef) or not self._one_text_or_empty(assign.node))
            }
            if (self._content_names, self._mixed_names) == known:
                return
        raise _Refusal("the names set from texts do not settle")

    def _names_set_from_texts(self, nodes_seen: Iterable[nodes.Node]) -> set[str]:
        """The names (and namespace attributes, as ``ns.attr``: :func:`_target_key`) that
        the ``set`` statements among ``nodes_seen`` give a value read from a text (or from
        such a name)."""
        assigns = [node for node in nodes_seen if isinstance(node, nodes.Assign)]
        found: set[str] = set()
        while True:
            before = len(found)
            for assign in assigns:
                key = _target_key(assign.target)
                if key is not None and any(self._reads_text(node, found) for node in _walk(assign.node)):
                    found.add(key)
            if len(found) == before:
                return found

    def _reads_text(self, node: nodes.Node, content_names: set[str]) -> bool:
        if isinstance(node, nodes.Name):
            return node.ctx == "load" and node.name in content_names
        if self._is_parts_text(node):
            return True
        if self._is_content_attribute(node, content_names):
            return True
        return isinstance(node, nodes.Getattr | nodes.Getitem) and self._is_text_access(node)

    @staticmethod
    def _is_content_attribute(node: nodes.Node, content_names: set[str]) -> bool:
        """``ns.attr`` where a ``set ns.attr = ...`` gave that attribute a text."""
        return (
            isinstance(node, nodes.Getattr)
            and isinstance(node.node, nodes.Name)
            and node.node.ctx == "load"
            and f"{node.node.name}.{node.attr}" in content_names
        )

    def _is_text_access(self, node: nodes.Getattr | nodes.Getitem) -> bool:
        key = key_of(node)
        if key in self._text_keys and self._is_message(node.node):
            return True
        if key == "content" and self._content_kind(node) == "text":
            return True
        if key == "text" and self._is_part(node.node):
            return True
        return self._tools and key in CALL_TEXT_KEYS and self._is_call(node.node)

    def _one_text_or_empty(self, node: nodes.Node) -> bool:
        """Whether ``node`` is always one message's text or '' (what a test on a text may
        take as a text, whose answer is then no for '' and for the texts a skeleton fills)."""
        return self._one_text(node, constants="")

    def _one_text(self, node: nodes.Node, *, constants: str | None = None) -> bool:
        """Whether ``node`` is always one message's text or a constant (``constants``: only
        that one; None: any string), so trimming or testing it acts on that text alone:
        the text, a name set only so, ``text or 'x'``, ``text if test else 'x'``."""
        if isinstance(node, nodes.Const):
            return isinstance(node.value, str) and (constants is None or node.value == constants)
        if isinstance(node, nodes.Name):
            return node.name in self._content_names and node.name not in self._mixed_names
        if isinstance(node, nodes.Getattr | nodes.Getitem):
            return self._is_text_access(node)
        if (
            isinstance(node, nodes.Filter)
            and node.name == "trim"
            and node.node is not None
            and not _has_arguments(node)
        ):
            return self._one_text(node.node, constants=constants)  # (tests ask it trimmed too: Verbatim.answers_yes)
        if self._is_parts_text(node):
            return True
        if isinstance(node, nodes.Call) and self._is_identity_call(node):
            return self._one_text(node.args[0], constants=constants)
        if isinstance(node, nodes.Or):
            return self._one_text(node.left, constants=constants) and self._one_text(node.right, constants=constants)
        if isinstance(node, nodes.CondExpr):
            return (
                node.expr2 is not None
                and self._one_text(node.expr1, constants=constants)
                and self._one_text(node.expr2, constants=constants)
            )
        return False

    def run(self) -> None:
        self._settle_names()
        others = self._list_names | self._message_names | self._call_names | self._content_names | self._arguments_names
        if (self.key_names | self._value_names) & others:
            raise _Refusal("a name holds a tool call argument's key or value and something else")
        if self._part_names & (others | self.key_names | self._value_names):
            raise _Refusal("a name holds a message's part and something else")
        self.tests.clear()  # (those the settling rounds asked are asked again below)
        refusal: _Refusal | None = None
        for node in live(self._tree, self._plain_truth, self._skipped):
            try:
                self._check(node)
            except _Refusal as found:
                refusal = refusal or found
        if refusal is not None:
            raise refusal

    def _check(self, node: nodes.Node) -> None:
        if isinstance(node, nodes.Filter) and node.name in _UNSTABLE_FILTERS:
            raise _Refusal(f"the template uses the {node.name} filter")
        if not isinstance(node, nodes.Name):
            return
        if node.ctx == "store":
            names = (
                self._list_names | self._message_names | self._call_names | self._value_names | self._part_names
            ) | self._arguments_names
            if node.name in names and id(node) not in self._allowed_stores:
                raise _Refusal(f"the template sets {node.name}")
            return
        if node.ctx != "load":
            return
        if node.name == "strftime_now":
            self._clock_use(node)
        elif node.name in _UNSTABLE_NAMES:
            raise _Refusal(f"the template calls {node.name}")
        elif node.name in self._list_names:
            self._message_list_use(node)
        elif node.name in self._message_names:
            self._message_use(node)
        elif node.name in self._call_names:
            self._call_use(node)
        elif node.name in self._arguments_names:
            self._arguments_use(node)
        elif node.name in self._value_names:
            self._value_use(node)
        elif node.name in self._part_names:
            self._part_use(node)
        elif node.name in self._content_names:
            self._text_use(node)
        elif self._is_content_attribute(self._parent(node), self._content_names):
            self._text_use(self._parent(node))
        elif any(key.startswith(node.name + ".") for key in self._content_names):
            parent = self._parent(node)
            if not (isinstance(parent, nodes.Getattr) and parent.node is node):
                raise _Refusal(f"a namespace holding a text is read as {type(parent).__name__}")
        elif node.name == "loop":
            parent = self._parent(node)
            if isinstance(parent, nodes.Getattr) and parent.attr in ("previtem", "nextitem"):
                if not self._is_neighbour(parent):
                    raise _Refusal(f"the template reads loop.{parent.attr} of a loop not over messages")
                self._message_use(parent)

    def _clock_use(self, node: nodes.Name) -> None:
        parent = self._parent(node)
        if isinstance(parent, nodes.Test) and parent.node is node and parent.name in ("defined", "undefined"):
            return
        constant = _constant_argument(parent, node)
        if constant is None:
            raise _Refusal("the template calls strftime_now with a format that varies")
        self.clock_formats.add(constant)

    def _message_list_use(self, node: nodes.Node) -> None:
        parent = self._parent(node)
        if id(node) in self._list_copies:
            return  # {% set messages = messages[1:] %}: a list name, checked where it is read
        if isinstance(parent, nodes.For) and parent.iter is node:
            return
        if isinstance(parent, nodes.Getitem) and parent.node is node:
            if not isinstance(parent.arg, nodes.Slice):
                self._message_use(parent)
                return
            grandparent = self._parent(parent)
            if isinstance(grandparent, nodes.For) and grandparent.iter is parent:
                return  # for message in messages[::-1]
        if isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "length":
            return
        if isinstance(parent, nodes.Test) and parent.node is node and parent.name in _TYPE_TESTS:
            return
        if self._is_truth(node):
            return  # whether there are any
        raise _Refusal(f"the messages are read as {type(parent).__name__}")

    def _message_use(self, node: nodes.Node) -> None:
        parent = self._parent(node)
        key: object = None
        if isinstance(parent, nodes.Getattr) and parent.node is node:
            key = parent.attr
        elif isinstance(parent, nodes.Getitem) and parent.node is node:
            if not isinstance(parent.arg, nodes.Const) or not isinstance(parent.arg.value, str):
                raise _Refusal("a message is read by a computed key")
            key = parent.arg.value
        elif isinstance(parent, nodes.Operand) and parent.op in ("in", "notin") and parent.expr is node:
            return  # 'key' in message
        elif isinstance(parent, nodes.Test) and parent.node is node and parent.name in _TYPE_TESTS:
            return
        elif self._is_truth(node):
            return  # a message is never empty; a neighbour's truth is whether there is one
        else:
            raise _Refusal(f"a message is read as {type(parent).__name__}")
        kind = self._content_kind(parent) if key == "content" else None
        if key in self._text_keys or kind == "text":
            self._text_use(parent)
        elif kind == "parts":
            self._parts_use(parent)
        elif kind == "either":
            grandparent = self._parent(parent)
            if not (isinstance(grandparent, nodes.Test) and grandparent.name in _TYPE_TESTS):
                raise _Refusal("a content that may be a tool result's text or a list of parts is read")
        elif key == "tool_calls" and self._tools:
            self._call_list_use(parent)
        elif key in _DICT_ATTRIBUTES:
            raise _Refusal(f"a message's {key} is called")

    def _parts_use(self, node: nodes.Node) -> None:
        """A message's content as a list of parts: looped over (a part name), indexed by a
        number, counted (one part per text), tested; or printed by a macro that prints its
        parts' texts (then the call is the text)."""
        parent = self._parent(node)
        if self._is_parts_text(parent) and parent.args[0] is node:  # type: ignore[attr-defined]
            self._text_use(parent)
            return
        self._sequence_use(node, self._is_part, self._part_use, "a message's parts")

    def _sequence_use(
        self,
        node: nodes.Node,
        indexed: Callable[[nodes.Getitem], bool],
        item_use: Callable[[nodes.Node], None],
        what: str,
    ) -> None:
        """A list (``what``) read only by looping over it (its variable's reads are checked
        by name), indexing it as ``indexed`` allows (the item's use checked), counting it,
        or testing its type or truth."""
        parent = self._parent(node)
        if isinstance(parent, nodes.For) and parent.iter is node:
            return
        if isinstance(parent, nodes.Getitem) and parent.node is node and indexed(parent):
            item_use(parent)
        elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "length":
            return
        elif isinstance(parent, nodes.Test) and parent.node is node and parent.name in _TYPE_TESTS:
            return
        elif not self._is_truth(node):
            raise _Refusal(f"{what} are read as {type(parent).__name__}")

    def _part_use(self, node: nodes.Node) -> None:
        """A part of a message's content: read by constant keys (its ``text`` a text, its
        ``type`` the same for every part a skeleton fills), tested for a key or its type."""
        parent = self._parent(node)
        if isinstance(parent, nodes.Getattr | nodes.Getitem) and parent.node is node:
            key = key_of(parent)
            if key is None:
                raise _Refusal("a message's part is read by a computed key")
            if key == "text":
                self._text_use(parent)
            elif key in _DICT_ATTRIBUTES:
                raise _Refusal(f"a message's part's {key} is called")
            return  # its type, or a key no part a skeleton fills has
        if isinstance(parent, nodes.Operand) and parent.op in ("in", "notin") and parent.expr is node:
            return
        if isinstance(parent, nodes.Test) and parent.node is node and parent.name in _TYPE_TESTS:
            return
        if not self._is_truth(node):
            raise _Refusal(f"a message's part is read as {type(parent).__name__}")

    def _is_parts(self, node: nodes.Node) -> bool:
        """A message's content under a content format of parts (no tool result's)."""
        return self._content_kind(node) == "parts"

    def _is_parts_text(self, node: nodes.Node) -> bool:
        """A message's text as a macro prints it from the message's parts (GLM's
        ``visible_text(m.content)``): one text, as a part holds it."""
        return is_identity_call(node, self._parts_macros) and self._is_parts(node.args[0])  # type: ignore[attr-defined]

    def _is_part(self, node: nodes.Node) -> bool:
        """A part of a message's content: a part name, ``content[0]``."""
        if isinstance(node, nodes.Name):
            return node.name in self._part_names
        return (
            isinstance(node, nodes.Getitem)
            and isinstance(node.arg, nodes.Const)
            and type(node.arg.value) is int
            and self._is_parts(node.node)
        )

    def _call_list_use(self, node: nodes.Node) -> None:
        """A message's tool calls: looped over (a call name), indexed, counted, tested."""
        self._sequence_use(node, _not_sliced, self._call_use, "a message's tool calls")

    def _call_use(self, node: nodes.Node) -> None:
        """A tool call or its function (:meth:`_is_call`): read by constant keys, tested."""
        parent = self._parent(node)
        if isinstance(parent, nodes.Getattr | nodes.Getitem) and parent.node is node:
            key = key_of(parent)
            if key is None:
                raise _Refusal("a tool call is read by a computed key")
            if key == "function":
                self._call_use(parent)
            elif key in CALL_TEXT_KEYS:
                self._text_use(parent)
            elif key == "arguments":
                self._arguments_use(parent)
            elif key in _DICT_ATTRIBUTES:
                raise _Refusal(f"a tool call's {key} is called")
            return  # any other key: absent from every call a skeleton fills
        if isinstance(parent, nodes.CondExpr | nodes.Or) and self._is_call(parent):
            self._call_use(parent)
        elif isinstance(parent, nodes.Assign) and parent.node is node and isinstance(parent.target, nodes.Name):
            return  # a call name: its reads are checked
        elif isinstance(parent, nodes.Operand) and parent.op in ("in", "notin") and parent.expr is node:
            return  # 'function' in call
        elif isinstance(parent, nodes.Test) and parent.node is node and parent.name in _TYPE_TESTS:
            return
        elif not self._is_truth(node):
            raise _Refusal(f"a tool call is read as {type(parent).__name__}")

    def _arguments_use(self, node: nodes.Node) -> None:
        """A call's arguments (a text, an object or a list): printed, through ``tojson`` or
        as they are, tested for their type or truth, or iterated (a value read by its key)."""
        parent = self._parent(node)
        if isinstance(parent, nodes.For) and parent.iter is node:
            return  # for key in arguments: a key name
        if isinstance(parent, nodes.Assign) and parent.node is node and id(parent.target) in self._allowed_stores:
            return  # {% set args = call.arguments %}: a name whose reads are checked
        pairs = self._parent(parent) if isinstance(parent, nodes.Getattr) else parent  # (arguments.items())
        if self._argument_loop(pairs) == "items":
            looping = self._parent(pairs)
            if isinstance(looping, nodes.For) and looping.iter is pairs:
                return  # for key, value in arguments | items: key and value names
            raise _Refusal("a tool call's arguments are read as pairs outside a loop")
        if isinstance(parent, nodes.Getitem) and parent.node is node and self._reads_value(parent):
            self._value_use(parent)
        elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "tojson":
            if not _dumps_as_default(parent):
                raise _Refusal("a tool call's arguments are dumped with options")
            self._printed_use(parent)
        elif isinstance(parent, nodes.Test) and parent.node is node and parent.name in _TYPE_TESTS:
            return
        elif not self._is_truth(node):
            self._printed_use(node)

    def _printed_use(self, node: nodes.Node) -> None:
        """``node``'s text is printed, maybe joined with others, and read no other way."""
        parent = self._parent(node)
        if isinstance(parent, nodes.Output):
            self._check_not_captured(parent)
        elif isinstance(parent, nodes.Add | nodes.Concat):
            self._printed_use(parent)
        elif isinstance(parent, nodes.CondExpr) and parent.test is not node:
            self._printed_use(parent)
        else:
            raise _Refusal(f"a tool call's text is read as {type(parent).__name__}")

    def _value_use(self, node: nodes.Node, made: str = _RAW) -> None:
        """A tool call argument's value (``made`` into a text or markup on the way, see
        :data:`_RAW`): printed (as Python writes it, through ``string`` or ``tojson``),
        joined, chosen by ``if``, set to a name, tested for its type or its truth; which
        texts and types the shape holds. Markup is printed or set alone: joined, it would
        escape the text beside it."""
        parent = self._parent(node)
        if isinstance(parent, nodes.Output):
            self._check_not_captured(parent)
        elif isinstance(parent, nodes.Concat) and made != _MARKUP:
            self._value_use(parent, _TEXT)
        elif isinstance(parent, nodes.Add) and made == _TEXT:
            self._value_use(parent, _TEXT)
        elif isinstance(parent, nodes.CondExpr) and parent.test is not node:
            self._value_use(parent, made)
        elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name in ("string", "tojson", "safe"):
            if _has_arguments(parent) and not _dumps_as_default(parent):
                raise _Refusal(f"a tool call argument's value is filtered by {parent.name} with options")
            after = _MARKUP if parent.name == "safe" or made == _MARKUP else _TEXT
            self._value_use(parent, _TEXT if parent.name == "tojson" else after)
        elif isinstance(parent, nodes.Test) and parent.node is node:
            if parent.name not in _VALUE_TESTS:
                raise _Refusal(f"a tool call argument's value is tested with {parent.name}")
        elif isinstance(parent, nodes.Assign) and parent.node is node and isinstance(parent.target, nodes.Name):
            return  # a value name: its reads are checked
        elif not self._is_truth(node):
            raise _Refusal(f"a tool call argument's value is read as {type(parent).__name__}")

    def _is_truth(self, node: nodes.Node) -> bool:
        """Whether only ``node``'s truth is read (an ``if``'s test, ``not node``...)."""
        parent = self._parent(node)
        if isinstance(parent, nodes.Not):
            return True
        if isinstance(parent, nodes.If | nodes.CondExpr | nodes.For) and getattr(parent, "test", None) is node:
            return True
        return isinstance(parent, nodes.And | nodes.Or) and self._is_truth(parent)

    def _text_use(self, node: nodes.Node) -> None:
        """``node``'s value is made of texts: how its parent uses it."""
        parent = self._parent(node)
        if isinstance(parent, nodes.Call) and self._is_identity_call(parent) and parent.args[0] is node:
            self._text_use(parent)  # render_content(text): the text itself
        elif isinstance(parent, nodes.Output):
            self._check_not_captured(parent)
        elif isinstance(parent, nodes.Add | nodes.Concat | nodes.Or | nodes.And):
            self._text_use(parent)
        elif isinstance(parent, nodes.CondExpr):
            if parent.test is not node:
                self._text_use(parent)
        elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "tojson":
            if not _dumps_as_default(parent):
                raise _Refusal("a text is dumped as JSON with options")
            self._printed_use(parent)
        elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "trim":
            if not self._one_text(node) or parent.args or parent.kwargs or parent.dyn_args or parent.dyn_kwargs:
                raise _Refusal("a text is trimmed with other text or characters")
            self._text_use(parent)
        elif isinstance(parent, nodes.Filter) and parent.node is node and parent.name == "length":
            if not self._measures_emptiness(node, parent):
                raise _Refusal("a text is measured")
        elif isinstance(parent, nodes.Getattr) and parent.node is node:
            self._text_method_use(node, parent)
        elif isinstance(parent, nodes.Operand) and parent.expr is node:
            comparison = self._parent(parent)
            if self._text_test(comparison) is None:
                raise _Refusal("a text is compared")
        elif isinstance(parent, nodes.Test) and parent.node is node:
            if parent.name not in _TYPE_TESTS:
                raise _Refusal(f"a text is tested with {parent.name}")
        elif isinstance(parent, nodes.Not) or (isinstance(parent, nodes.If | nodes.For) and parent.test is node):
            return
        elif isinstance(parent, nodes.Assign) and parent.node is node and _target_key(parent.target) is not None:
            return  # the name is a content name (_settle_names): its reads are checked
        else:
            raise _Refusal(f"a text is read as {type(parent).__name__}")

    def _is_identity_call(self, call: nodes.Node) -> bool:
        """A call of a macro that prints its first argument as it is when that is a string."""
        return is_identity_call(call, self._identity_macros)

    def _measures_emptiness(self, text: nodes.Node, length: nodes.Filter) -> bool:
        """Whether ``text | length`` (``text`` one text, maybe trimmed) is only read for
        whether it is zero (``> 0``, ``== 0``...; or as truth): whether the text is empty,
        which its shape holds (a text of whitespace alone renders whole, so trimmed or not
        is the same)."""
        measured = text.node if isinstance(text, nodes.Filter) and text.name == "trim" else text  # (trim: checked)
        if measured is None or not self._one_text(measured) or _has_arguments(length):
            return False
        if self._is_truth(length):
            return True
        compare = self._parent(length)
        if isinstance(compare, nodes.Operand):  # (``0 < text | length``)
            compare = self._parent(compare)
        if not isinstance(compare, nodes.Compare) or len(compare.ops) != 1:
            return False
        (operand,) = compare.ops
        if compare.expr is length:
            op, other = operand.op, operand.expr
        else:
            op, other = _FLIPPED.get(operand.op, ""), compare.expr
        return (
            isinstance(other, nodes.Const) and type(other.value) is int and (op, other.value) in _EMPTINESS_COMPARISONS
        )

    def _text_method_use(self, node: nodes.Node, method: nodes.Getattr) -> None:
        """``text.startswith('x')``, ``text.endswith('x')`` (tests), ``text.strip()``,
        ``text.lstrip('\n')``... (stripping whitespace); nothing else of a text is called."""
        call = self._parent(method)
        if not isinstance(call, nodes.Call) or call.node is not method:
            raise _Refusal(f"a text's {method.attr} is read")
        if method.attr in ("startswith", "endswith"):
            if self._text_test(call) is None:
                raise _Refusal(f"a text's {method.attr} is asked of something not a constant")
            return
        if method.attr in ("strip", "lstrip", "rstrip"):
            characters = _constant_argument(call, method) if call.args else ""
            if characters is None or (characters and not characters.isspace()):
                raise _Refusal(f"a text is stripped of {characters!r}")
            self.strip_characters.update(characters)  # (none: every whitespace character)
            self._text_use(call)
            return
        raise _Refusal(f"a text's {method.attr} is called")

    def _text_test(self, node: nodes.Node) -> tuple[str, str] | None:
        """``(kind, constant)`` where ``node`` asks whether one text (or '') starts with,
        ends with or holds a non-empty constant (recorded: a skeleton is for texts where
        the answer is no); None where it is no such test."""
        found: tuple[str, str] | None = None
        if isinstance(node, nodes.Call) and isinstance(node.node, nodes.Getattr):
            method = node.node
            constant = _constant_argument(node, method)
            if method.attr in ("startswith", "endswith") and constant and self._one_text_or_empty(method.node):
                found = (method.attr, constant)
        elif isinstance(node, nodes.Compare) and len(node.ops) == 1 and node.ops[0].op in ("in", "notin"):
            left, right = node.expr, node.ops[0].expr
            if isinstance(left, nodes.Const) and isinstance(left.value, str) and left.value:
                if self._one_text_or_empty(right):
                    found = ("in", left.value)
        if found is not None:
            self.tests.add(found)
        return found

    def _is_message(self, node: nodes.Node) -> bool:
        if isinstance(node, nodes.Name):
            return node.name in self._message_names
        if self._is_neighbour(node):
            return True
        return (
            isinstance(node, nodes.Getitem)
            and isinstance(node.node, nodes.Name)
            and node.node.name in self._list_names
            and not isinstance(node.arg, nodes.Slice)
        )

    def _is_neighbour(self, node: nodes.Node) -> bool:
        """``loop.previtem`` or ``loop.nextitem`` in a loop over messages: the message
        before or after, whose place in the conversation the shape holds (at an end,
        reading one of its keys fails the render)."""
        if not isinstance(node, nodes.Getattr) or node.attr not in ("previtem", "nextitem"):
            return False
        name = node.node
        if not isinstance(name, nodes.Name) or name.name != "loop" or name.ctx != "load":
            return False
        loop = self._enclosing_loop(name)
        return loop is not None and self._is_list(loop.iter)

    def _enclosing_loop(self, node: nodes.Node) -> nodes.For | None:
        """The ``for`` whose ``loop`` a read of ``loop`` at ``node`` is: the innermost one
        whose body holds it (not its iterable, nor a macro's body between)."""
        parent = self._parents.get(id(node))
        while parent is not None:
            if isinstance(parent, nodes.For) and any(node is child for child in parent.body):
                return parent
            if isinstance(parent, nodes.Macro | nodes.CallBlock) and not (
                isinstance(parent, nodes.CallBlock) and _is_generation_block(parent)
            ):
                return None
            node, parent = parent, self._parents.get(id(parent))
        return None

    def _plain_truth(self, test: nodes.Node) -> bool | None:
        """``test``'s value for every plain message, where it is the same for all (a role
        no plain message has, a field none has, a text test a skeleton's texts answer no
        to, a text's type); None where it may differ."""
        return decided(test, self._plain_leaf)

    def _plain_leaf(self, test: nodes.Node) -> bool | None:
        """:meth:`_plain_truth` of a test made of no ``not``, ``and`` or ``or``."""
        # A text is a string; a name set from one may not be set yet (undefined) where it is
        # tested, so only a text read straight off its message counts.
        if (
            isinstance(test, nodes.Test)
            and test.name == "string"
            and isinstance(test.node, nodes.Getattr | nodes.Getitem)
        ):
            if self._is_text_access(test.node):
                return True
            if self._is_parts(test.node):
                return False
        if isinstance(test, nodes.Call) and self._text_test(test) is not None:
            return False
        if isinstance(test, nodes.Test) and test.name in ("defined", "undefined"):
            defined = self._field_defined(test.node)
            return None if defined is None else defined == (test.name == "defined")
        if not isinstance(test, nodes.Compare) or len(test.ops) != 1:
            return None
        if self._text_test(test) is not None:
            return test.ops[0].op == "notin"
        (operand,) = test.ops
        first, second = test.expr, operand.expr
        if operand.op in ("in", "notin") and isinstance(first, nodes.Const) and self._is_loop_message(second):
            present = self._holds(first.value)
            return None if present is None else present == (operand.op == "in")
        if operand.op in ("eq", "ne"):
            for read, other in ((first, second), (second, first)):
                is_role = isinstance(read, nodes.Getattr | nodes.Getitem) and key_of(read) == "role"
                if is_role and self._is_read_message(read.node) and isinstance(other, nodes.Const):  # type: ignore[attr-defined]
                    if other.value in self._roles:
                        return None
                    return operand.op == "ne"
        return None

    def _holds(self, key: object) -> bool | None:
        """Whether every message a skeleton fills holds ``key`` (the converted message holds
        ``role`` and ``content``; with tools, the fields that may be there or not: None)."""
        return None if key in self._optional_keys else key in ("role", "content")

    def _field_defined(self, node: nodes.Node) -> bool | None:
        """Whether ``message.key`` is defined for every message a skeleton fills, as
        :meth:`_holds` says; None where it may differ, or names a dict's own attribute."""
        if not isinstance(node, nodes.Getattr | nodes.Getitem) or not self._is_read_message(node.node):
            return None
        key = key_of(node)
        return None if key is None or key in _DICT_ATTRIBUTES else self._holds(key)

    def _is_loop_message(self, node: nodes.Node) -> bool:
        return isinstance(node, nodes.Name) and node.name in self._message_names

    def _is_read_message(self, node: nodes.Node) -> bool:
        """A loop's message or its neighbour: reading its key either finds what every
        message of the shape holds or fails (a neighbour past an end), so tests of its role
        and fields prune as the loop message's do; ``'key' in`` one does not (past an end
        it is false)."""
        return self._is_loop_message(node) or self._is_neighbour(node)

    def _check_not_captured(self, output: nodes.Output) -> None:
        node: nodes.Node | None = output
        while node is not None:
            if isinstance(node, nodes.Macro | nodes.AssignBlock | nodes.FilterBlock):
                raise _Refusal(f"a text is printed inside a {type(node).__name__}")
            if isinstance(node, nodes.CallBlock) and not _is_generation_block(node):
                raise _Refusal("a text is printed inside a call block")
            node = self._parents.get(id(node))

    def _parent(self, node: nodes.Node) -> nodes.Node:
        return self._parents[id(node)]


def _constant_argument(call: nodes.Node, callee: nodes.Node) -> str | None:
    """The one constant string ``call`` passes ``callee``, if it is such a call."""
    if (
        isinstance(call, nodes.Call)
        and call.node is callee
        and len(call.args) == 1
        and isinstance(call.args[0], nodes.Const)
        and isinstance(call.args[0].value, str)
        and not (call.kwargs or call.dyn_args or call.dyn_kwargs)
    ):
        return call.args[0].value
    return None


def _target_key(target: nodes.Node) -> str | None:
    """What a ``set`` gives a value to: a name, or a namespace's attribute as ``ns.attr``
    (no name holds a dot); None for other targets (unpacking)."""
    if isinstance(target, nodes.Name):
        return target.name
    if isinstance(target, nodes.NSRef):
        return f"{target.name}.{target.attr}"
    return None


def _dumps_as_default(node: nodes.Filter) -> bool:
    """``tojson`` as it writes by default: without options, or ``ensure_ascii=False``
    (GLM's), which is its default (transformers' filter, and
    :func:`~kvroute.tokenizer_index.chat_template.tojson`)."""
    if node.name != "tojson" or node.args or node.dyn_args or node.dyn_kwargs:
        return False
    return all(
        keyword.key == "ensure_ascii" and isinstance(keyword.value, nodes.Const) and keyword.value.value is False
        for keyword in node.kwargs
    )


def _has_arguments(node: nodes.Filter | nodes.Call) -> bool:
    """Whether a filter or call passes arguments (``tojson(indent=2)``)."""
    return bool(node.args or node.kwargs or node.dyn_args or node.dyn_kwargs)


def _is_field(node: nodes.Node, key: str, owner: Callable[[nodes.Node], bool]) -> bool:
    """``x.key`` or ``x['key']`` where ``owner`` says ``x`` is what it must be."""
    return isinstance(node, nodes.Getattr | nodes.Getitem) and key_of(node) == key and owner(node.node)


def _not_sliced(item: nodes.Getitem) -> bool:
    return not isinstance(item.arg, nodes.Slice)


def _stores(target: nodes.Node, name: str) -> bool:
    """Whether a loop's ``target`` sets ``name``."""
    return any(isinstance(node, nodes.Name) and node.name == name for node in _walk(target))


def _walk(node: nodes.Node) -> Iterator[nodes.Node]:
    yield node
    for child in node.iter_child_nodes():
        yield from _walk(child)


def _is_generation_block(node: nodes.CallBlock) -> bool:
    """``{% generation %}`` (:class:`~kvroute.tokenizer_index.chat_template._GenerationTag`),
    which renders its body unchanged."""
    call = node.call
    return (
        isinstance(call, nodes.Call)
        and isinstance(call.node, nodes.ExtensionAttribute)
        and call.node.name == "_render_body"
    )
