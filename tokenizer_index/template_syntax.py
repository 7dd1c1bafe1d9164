"""Readings of a chat template's syntax tree that its checks share: which nodes run once
some tests are decided, the constant key a read takes, and a comparison of a role.

:mod:`~kvroute.tokenizer_index.template_verbatim` decides tests by what every message a
skeleton fills holds, :mod:`~kvroute.tokenizer_index.template_macros` by a macro's argument
being a string, :mod:`~kvroute.tokenizer_index.template_prefix` reads keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from jinja2 import nodes

#: A test's value where it is decided, None where it may go either way.
Truth = Callable[[nodes.Node], bool | None]


def live(node: nodes.Node, truth: Truth, skipped: frozenset[int] = frozenset()) -> Iterator[nodes.Node]:
    """``node`` and the nodes under it, less the branches of ``if`` statements whose tests
    ``truth`` decides against (never rendered), the branches after one it decides for, and
    the nodes under those in ``skipped`` (by id)."""
    yield node
    if id(node) in skipped:
        return
    if not isinstance(node, nodes.If):
        for child in node.iter_child_nodes():
            yield from live(child, truth, skipped)
        return
    for branch in (node, *node.elif_):
        yield from live(branch.test, truth, skipped)
        taken = truth(branch.test)
        if taken is not False:
            for child in branch.body:
                yield from live(child, truth, skipped)
        if taken is True:
            return
    for child in node.else_:
        yield from live(child, truth, skipped)


def decided(test: nodes.Node, leaf: Truth) -> bool | None:
    """``test``'s value where ``leaf`` decides the tests it is made of with ``not``,
    ``and`` and ``or`` (True decides an ``or``, False an ``and``, whatever the other side)."""
    if isinstance(test, nodes.Not):
        inner = decided(test.node, leaf)
        return None if inner is None else not inner
    if isinstance(test, nodes.And | nodes.Or):
        left, right = decided(test.left, leaf), decided(test.right, leaf)
        deciding = isinstance(test, nodes.Or)
        if deciding in (left, right):
            return deciding
        return None if None in (left, right) else not deciding
    return leaf(test)


def key_of(node: nodes.Node) -> str | None:
    """The constant key ``node`` reads (``x.key``, ``x['key']``), if it is such a read."""
    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
        return node.arg.value
    return None


def role_comparison(test: nodes.Node) -> tuple[nodes.Node, tuple[object, ...], bool] | None:
    """``x.role == 'a'`` (or ``'a' == x.role``, ``!=``), ``x.role in ['a', 'b']`` (or ``not
    in``): what ``x`` is, the constants, and whether the test holds for exactly those roles
    (False: for every other)."""
    if not isinstance(test, nodes.Compare) or len(test.ops) != 1:
        return None
    (operand,) = test.ops
    read, other = test.expr, operand.expr
    if operand.op in ("eq", "ne") and isinstance(read, nodes.Const):
        read, other = other, read
    if not (isinstance(read, nodes.Getattr | nodes.Getitem) and key_of(read) == "role"):
        return None
    if operand.op in ("eq", "ne") and isinstance(other, nodes.Const):
        constants: tuple[object, ...] = (other.value,)
    elif operand.op in ("in", "notin") and isinstance(other, nodes.List | nodes.Tuple):
        if not all(isinstance(item, nodes.Const) for item in other.items):
            return None
        constants = tuple(item.value for item in other.items)  # type: ignore[attr-defined]
    else:
        return None
    return read.node, constants, operand.op in ("eq", "in")
