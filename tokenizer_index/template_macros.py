"""Macros a template's syntax checks may read through: those that print a string argument as it is.

Qwen 3.5's template (and 3.6's) passes every message's text through ``render_content(content,
...)``, which prints ``content`` when it is a string and otherwise walks content parts,
counting images and videos in namespaces. Given a string, such a macro is the identity:
its call is the text itself, and nothing else of its body runs. The skeletons' check
(:mod:`~kvroute.tokenizer_index.template_verbatim`) takes such a call with one text as that
text and leaves the body unread. (The render memo's check,
:mod:`~kvroute.tokenizer_index.template_prefix`, could too where the content format hands
every content over as a string; ``benchmarks/README.md`` says what else Qwen 3.5 needs there.)

GLM 4.5's and 4.6's ``visible_text(content)`` is such a macro too, and under the content
format of parts, the one vLLM detects for GLM (its template loops over a tool result's
content), it is handed a list with one text part, ``[{"type": "text", "text": ...}]``, and
prints that part's text: :func:`identity_macros` with ``parts`` finds the macros that,
given a list of text parts, print each part's ``text`` and nothing else.
"""

from __future__ import annotations

from functools import partial

from jinja2 import nodes

from kvroute.tokenizer_index.template_syntax import decided, key_of, live

# What may run in a macro that only prints its first argument, a string.
_IDENTITY_NODES = (nodes.If, nodes.Test, nodes.Name, nodes.Output, nodes.Not, nodes.And, nodes.Or, nodes.Const)
# What may run in one that prints the texts of a list of text parts: also its loop over
# them, and reads and comparisons of a part's type.
_PARTS_NODES = (*_IDENTITY_NODES, nodes.For, nodes.Getattr, nodes.Getitem, nodes.Compare, nodes.Operand, nodes.List)
# Type tests a string passes, and those it fails.
_STRING_PASSES = frozenset({"string", "defined", "iterable", "sequence"})
_STRING_FAILS = frozenset({"none", "undefined", "mapping", "number", "boolean", "integer", "float"})
# The same for a list of parts, and for one text part (a dict: Jinja's ``sequence`` test
# asks only for a length and an item getter).
_LIST_PASSES = frozenset({"defined", "iterable", "sequence"})
_LIST_FAILS = frozenset({"string", "none", "undefined", "mapping", "number", "boolean", "integer", "float"})
_PART_PASSES = frozenset({"defined", "iterable", "sequence", "mapping"})
_PART_FAILS = frozenset({"string", "none", "undefined", "number", "boolean", "integer", "float"})
# A text part's keys, and the value of its type.
_PART_KEYS = frozenset({"type", "text"})
_TEXT_TYPE = "text"


def identity_macros(tree: nodes.Template, *, parts: bool = False) -> frozenset[str]:
    """The names of ``tree``'s macros that print just their first argument when it is a
    string (:func:`prints_first_string`), or with ``parts`` just the texts of its parts when
    it is a list of text parts (:func:`prints_parts_texts`)."""
    prints = prints_parts_texts if parts else prints_first_string
    return frozenset(macro.name for macro in tree.find_all(nodes.Macro) if prints(macro))


def prints_first_string(macro: nodes.Macro) -> bool:
    """Whether ``macro``, given a string as its first argument, prints just that: what runs
    then (its ``if`` branches decided by type tests of that argument) is only tests of it
    and one output of it alone."""
    if not macro.args:
        return False
    argument = macro.args[0].name
    truth = partial(decided, leaf=partial(_string_truth, argument=argument))
    ran = [node for child in macro.body for node in live(child, truth)]
    outputs = [node for node in ran if isinstance(node, nodes.Output)]
    if len(outputs) != 1 or len(outputs[0].nodes) != 1:
        return False
    (printed,) = outputs[0].nodes
    return (
        isinstance(printed, nodes.Name)
        and printed.name == argument
        and all(isinstance(node, _IDENTITY_NODES) for node in ran)
        and all(node.name == argument for node in ran if isinstance(node, nodes.Name))
    )


def prints_parts_texts(macro: nodes.Macro) -> bool:
    """Whether ``macro``, given a list of text parts as its first argument, prints just each
    part's text: what runs then (its ``if`` branches decided by type tests of the list, and
    by type tests, key tests and type comparisons of a part) is one loop over the list,
    printing the part's ``text`` alone once, and only such tests around it."""
    if not macro.args:
        return False
    argument = macro.args[0].name
    loops = [node for node in macro.find_all(nodes.For) if _is_name(node.iter, argument)]
    if len(loops) != 1:
        return False
    (loop,) = loops
    if not isinstance(loop.target, nodes.Name):
        return False
    part = loop.target.name
    if loop.else_ or loop.test is not None or loop.recursive or part == argument:
        return False
    truth = partial(decided, leaf=partial(_parts_truth, argument=argument, part=part))
    ran = [node for child in macro.body for node in live(child, truth)]
    outputs = [node for node in ran if isinstance(node, nodes.Output)]
    if (
        len(outputs) != 1
        or len(outputs[0].nodes) != 1
        or not any(outputs[0] is node for node in loop.find_all(nodes.Output))
    ):
        return False
    (printed,) = outputs[0].nodes
    return (
        _is_part_text(printed, part)
        and all(isinstance(node, _PARTS_NODES) for node in ran)
        and all(node.name in (argument, part) for node in ran if isinstance(node, nodes.Name))
        and all(_part_key(node, part) is not None for node in ran if isinstance(node, nodes.Getattr | nodes.Getitem))
    )


def is_identity_call(node: nodes.Node, macros: frozenset[str]) -> bool:
    """A call of one of ``macros`` with a first argument (by position, no ``*args``)."""
    return (
        isinstance(node, nodes.Call)
        and isinstance(node.node, nodes.Name)
        and node.node.name in macros
        and bool(node.args)
        and node.dyn_args is None
        and node.dyn_kwargs is None
    )


def _string_truth(test: nodes.Node, argument: str) -> bool | None:
    """A type test of ``argument``'s, decided for a string (None for any other test)."""
    if isinstance(test, nodes.Test) and isinstance(test.node, nodes.Name) and test.node.name == argument:
        if test.name in _STRING_PASSES:
            return True
        return False if test.name in _STRING_FAILS else None
    return None


def _parts_truth(test: nodes.Node, argument: str, part: str) -> bool | None:
    """A test decided for ``argument`` a list of text parts and ``part`` one of them: their
    types, ``'key' in part``, ``part.type == 'x'`` (or ``!=``, ``in [...]``); None for any
    other test."""
    if isinstance(test, nodes.Test) and isinstance(test.node, nodes.Name):
        passes, fails = {argument: (_LIST_PASSES, _LIST_FAILS), part: (_PART_PASSES, _PART_FAILS)}.get(
            test.node.name, (frozenset(), frozenset())
        )
        if test.name in passes:
            return True
        return False if test.name in fails else None
    if not isinstance(test, nodes.Compare) or len(test.ops) != 1:
        return None
    (operand,) = test.ops
    left, right = test.expr, operand.expr
    if operand.op in ("in", "notin") and isinstance(left, nodes.Const) and _is_name(right, part):
        return (left.value in _PART_KEYS) == (operand.op == "in")
    if _part_key(left, part) != "type":
        return None
    if operand.op in ("eq", "ne") and isinstance(right, nodes.Const):
        return (right.value == _TEXT_TYPE) == (operand.op == "eq")
    if operand.op in ("in", "notin") and isinstance(right, nodes.List | nodes.Tuple):
        if all(isinstance(item, nodes.Const) for item in right.items):
            held = any(item.value == _TEXT_TYPE for item in right.items)  # type: ignore[attr-defined]
            return held == (operand.op == "in")
    return None


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name and node.ctx == "load"


def _part_key(node: nodes.Node, part: str) -> str | None:
    """The constant key ``node`` reads of ``part`` (``part.type``, ``part['text']``)."""
    if isinstance(node, nodes.Getattr | nodes.Getitem) and _is_name(node.node, part):
        return key_of(node)
    return None


def _is_part_text(node: nodes.Node, part: str) -> bool:
    return _part_key(node, part) == "text"
