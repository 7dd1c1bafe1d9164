"""Macros a template's syntax checks may read through: those that print a string argument as it is.

Qwen 3.5's template (and 3.6's) passes every message's text through ``render_content(content,
...)``, which prints ``content`` when it is a string and otherwise walks content parts,
counting images and videos in namespaces. Given a string, such a macro is the identity:
its call is the text itself, and nothing else of its body runs. The skeletons' check
(:mod:`~kvroute.tokenizer_index.template_verbatim`) takes such a call with one text as that
text and leaves the body unread. (The render memo's check,
:mod:`~kvroute.tokenizer_index.template_prefix`, could too where the content format hands
every content over as a string; ``benchmarks/README.md`` says what else Qwen 3.5 needs there.)
"""

from __future__ import annotations

from functools import partial

from jinja2 import nodes

from kvroute.tokenizer_index.template_syntax import decided, live

# What may run in a macro that only prints its first argument, a string.
_IDENTITY_NODES = (nodes.If, nodes.Test, nodes.Name, nodes.Output, nodes.Not, nodes.And, nodes.Or, nodes.Const)
# Type tests a string passes, and those it fails.
_STRING_PASSES = frozenset({"string", "defined", "iterable", "sequence"})
_STRING_FAILS = frozenset({"none", "undefined", "mapping", "number", "boolean", "integer", "float"})


def identity_macros(tree: nodes.Template) -> frozenset[str]:
    """The names of ``tree``'s macros that print just their first argument when it is a
    string (:func:`prints_first_string`)."""
    return frozenset(macro.name for macro in tree.find_all(nodes.Macro) if prints_first_string(macro))


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
