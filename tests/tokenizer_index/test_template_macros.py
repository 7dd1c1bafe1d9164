"""Macros the syntax checks read through: those that print a string argument as it is."""

from __future__ import annotations

import pytest
from jinja2 import nodes

from kvroute.tokenizer_index.chat_template import ChatTemplate
from kvroute.tokenizer_index.template_macros import identity_macros, is_identity_call

#: Macros that, given a string first, print just that.
IDENTITY = {
    "plain": "{% macro show(t) %}{{ t }}{% endmacro %}",
    # Qwen 3.5's render_content: the parts branch (counting images in a namespace) never runs for a string.
    "parts_walked_otherwise": (
        "{% set count = namespace(value=0) %}{% macro show(t, counted=false) %}{% if t is string %}{{ t }}"
        "{% elif t is iterable and t is not mapping %}{% for p in t %}{% if counted %}"
        "{% set count.value = count.value + 1 %}{% endif %}{{ p.text }}{% endfor %}"
        "{% elif t is none or t is undefined %}{{ '' }}{% else %}{{ raise_exception('no') }}{% endif %}{% endmacro %}"
    ),
    "not_a_mapping_first": "{% macro show(t) %}{% if t is not mapping %}{{ t }}{% else %}{{ t.text }}{% endif %}{% endmacro %}",
}
#: Macros that add to a string, change it, or branch on something else first.
OTHERS = {
    "adds": "{% macro show(t) %}{{ t }}!{% endmacro %}",
    "twice": "{% macro show(t) %}{{ t }}{{ t }}{% endmacro %}",
    "trims": "{% macro show(t) %}{{ t | trim }}{% endmacro %}",
    "sets": "{% macro show(t) %}{% set u = t %}{{ u }}{% endmacro %}",
    "other_argument": "{% macro show(a, t) %}{{ t }}{% endmacro %}",
    "flag_first": "{% macro show(t, x) %}{% if x %}{{ t }}{% else %}{{ t | upper }}{% endif %}{% endmacro %}",
    "calls": "{% macro show(t) %}{{ raise_exception('no') if t is string else t }}{% endmacro %}",
    "no_arguments": "{% macro show() %}x{% endmacro %}",
}


@pytest.mark.parametrize("name", sorted(IDENTITY))
def test_a_macro_printing_a_string_as_it_is_is_an_identity(name: str) -> None:
    tree = ChatTemplate.from_source(IDENTITY[name] + "{{ show('a') }}").syntax_tree
    assert identity_macros(tree) == {"show"}
    (call,) = [
        node for node in tree.find_all(nodes.Call) if isinstance(node.node, nodes.Name) and node.node.name == "show"
    ]
    assert is_identity_call(call, frozenset({"show"})) and not is_identity_call(call, frozenset())


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_macros_are_not(name: str) -> None:
    assert identity_macros(ChatTemplate.from_source(OTHERS[name]).syntax_tree) == frozenset()


def test_a_call_without_a_first_argument_by_position_is_not_an_identity_call() -> None:
    tree = ChatTemplate.from_source(IDENTITY["plain"] + "{{ show(t='a') }}{{ show(*['a']) }}").syntax_tree
    calls = [
        node for node in tree.find_all(nodes.Call) if isinstance(node.node, nodes.Name) and node.node.name == "show"
    ]
    assert len(calls) == 2 and not any(is_identity_call(call, frozenset({"show"})) for call in calls)
