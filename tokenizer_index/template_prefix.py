"""Which chat templates render a conversation as a head, one text per message, and a tail.

A conversation's next turn repeats its messages and adds a few; re-rendering all of them
costs ~10 us a message (~3 ms for an agent's 300). A template may render the same
message differently depending on the others (``loop.last``, ``messages | length``, a
last-query index kept in a namespace, the message after it), so the render of a prefix
of the messages is in general no prefix of the whole render. This module decides, from
the template's syntax tree, whether a template is of a shape where it is:

* exactly one loop over ``messages``, at the top level, with a plain loop variable;
* everything before it (the head) and the loop's body read ``messages`` only as
  ``messages[0]...`` or ``messages | length > 0`` (the same for every non-empty list that
  starts with the same first message), and the body reads of its loop only ``loop.first``;
* nothing carries state from one message to the next: no ``{% set ns.x %}`` in the body or
  in a macro, no ``{% break %}``, no stateful or random globals and filters
  (``cycler``, ``joiner``, ``lipsum``, ``random``, ``strftime_now``), no identity test;
* after the loop only ``{% if add_generation_prompt ... %}`` blocks without ``else``, and
  ``add_generation_prompt`` read nowhere else;
* no ``extends``, ``include``, ``import`` or blocks (no other template's code).

For such a template and any non-empty message list ``L``, with the other variables fixed,
``render(L) = head(L[0]) + text(L[0], first) + ... + text(L[-1], not first) +
tail(L[0], add_generation_prompt)``, and the tail is empty without a generation prompt.
So, for a conversation ``P + Q``: ``render(P + Q) = render(P, no generation prompt) +
render([P[0]] + Q)[len(render([P[0]], no generation prompt)):]``, which
:mod:`kvroute.tokenizer_index.render_memo` uses to render only the new messages. Every
other template is rendered whole every time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import jinja2.nodes as nodes

MESSAGES = "messages"
GENERATION_FLAG = "add_generation_prompt"
# Globals with state across calls or with a different answer each call.
_UNSTABLE_GLOBALS = frozenset({"cycler", "joiner", "lipsum", "strftime_now"})
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


@dataclass(frozen=True)
class _Scope:
    """Where a node sits: in the messages loop's own body (not a nested loop's), inside a
    macro or the messages loop (no namespace writes), after the loop (the tail)."""

    in_message_loop: bool = False
    in_any_loop: bool = False
    no_namespace_writes: bool = False
    in_tail: bool = False


class _Refusal(Exception):
    """The template is not of the shape above; the message says why."""


def prefix_stable_reason(tree: nodes.Template) -> str | None:
    """``None`` when the template renders every message on its own (see the module
    docstring), else why not."""
    try:
        _check_template(tree)
    except _Refusal as refusal:
        return str(refusal)
    return None


def _check_template(tree: nodes.Template) -> None:
    loops = [node for node in tree.body if isinstance(node, nodes.For) and _is_messages(node.iter)]
    if len(loops) != 1:
        raise _Refusal("no single top-level loop over messages")
    loop = loops[0]
    if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
        raise _Refusal("the messages loop has an else, a filter, recursion or an unpacking target")
    position = tree.body.index(loop)
    for node in tree.body[:position]:
        _check(node, _Scope())
    for node in loop.body:
        _check(node, _Scope(in_message_loop=True, in_any_loop=True, no_namespace_writes=True))
    for node in tree.body[position + 1 :]:
        _check_tail_node(node)


def _check_tail_node(node: nodes.Node) -> None:
    """After the loop: only text-free output or blocks shown with the generation prompt."""
    if isinstance(node, nodes.Output) and all(
        isinstance(part, nodes.TemplateData) and not part.data for part in node.nodes
    ):
        return
    if not (isinstance(node, nodes.If) and not node.elif_ and not node.else_ and _needs_generation_flag(node.test)):
        raise _Refusal("something after the messages loop is not under {% if add_generation_prompt %}")
    _check(node, _Scope(in_tail=True))


def _needs_generation_flag(test: nodes.Node) -> bool:
    """Whether ``test`` is false whenever ``add_generation_prompt`` is."""
    if isinstance(test, nodes.Name):
        return test.name == GENERATION_FLAG
    if isinstance(test, nodes.And):
        return _needs_generation_flag(test.left) or _needs_generation_flag(test.right)
    return False


def _check(node: nodes.Node, scope: _Scope) -> None:
    """Refuse ``node`` or anything under it that could make one message's text depend on
    another message, on the list's length, or on state kept between messages."""
    if isinstance(node, _REFUSED_NODES):
        raise _Refusal(f"the template uses {type(node).__name__}")
    if _is_first_message(node) or _is_non_empty_test(node):
        return  # the same for every list that starts with the same message
    if isinstance(node, nodes.Name):
        _check_name(node, scope)
    elif isinstance(node, nodes.Filter) and node.name in _UNSTABLE_FILTERS:
        raise _Refusal(f"the template uses the {node.name!r} filter")
    elif isinstance(node, nodes.Test) and node.name in _IDENTITY_TESTS:
        raise _Refusal(f"the template uses the {node.name!r} test")
    elif isinstance(node, nodes.NSRef) and scope.no_namespace_writes:
        raise _Refusal("a namespace is written inside the messages loop or a macro")
    elif isinstance(node, nodes.Break) and scope.in_message_loop:
        raise _Refusal("the messages loop may break")
    elif isinstance(node, nodes.Getattr) and _is_loop(node.node) and scope.in_message_loop:
        if node.attr != "first":
            raise _Refusal(f"the messages loop reads loop.{node.attr}")
        return
    for child, child_scope in _children(node, scope):
        _check(child, child_scope)


def _check_name(name: nodes.Name, scope: _Scope) -> None:
    if name.name == MESSAGES:
        raise _Refusal("messages is read other than as messages[0] or messages | length > 0")
    if name.name in _UNSTABLE_GLOBALS:
        raise _Refusal(f"the template calls {name.name}")
    if name.name == GENERATION_FLAG and not scope.in_tail:
        raise _Refusal("add_generation_prompt is read before the end of the messages loop")
    if name.name == "loop" and (scope.in_message_loop or not scope.in_any_loop):
        # In the messages loop only loop.first (checked above) is position-free; outside
        # any loop, a macro could be handed a loop in ways not worth following.
        raise _Refusal("the messages loop's loop object is read whole")


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
        )
        for child in node.iter_child_nodes():
            yield child, inner
        return
    for child in node.iter_child_nodes():
        yield child, scope


def _is_messages(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Name) and node.name == MESSAGES and node.ctx == "load"


def _is_loop(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Name) and node.name == "loop"


def _is_first_message(node: nodes.Node) -> bool:
    """``messages[0]``."""
    return (
        isinstance(node, nodes.Getitem)
        and _is_messages(node.node)
        and isinstance(node.arg, nodes.Const)
        and type(node.arg.value) is int
        and node.arg.value == 0
    )


def _is_non_empty_test(node: nodes.Node) -> bool:
    """``messages | length > 0``."""
    if not (isinstance(node, nodes.Compare) and len(node.ops) == 1):
        return False
    length, [operand] = node.expr, node.ops
    return (
        isinstance(length, nodes.Filter)
        and length.name == "length"
        and length.node is not None
        and _is_messages(length.node)
        and not (length.args or length.kwargs or length.dyn_args or length.dyn_kwargs)
        and operand.op == "gt"
        and isinstance(operand.expr, nodes.Const)
        and type(operand.expr.value) is int
        and operand.expr.value == 0
    )
