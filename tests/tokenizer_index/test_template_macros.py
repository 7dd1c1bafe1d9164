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


#: Macros that, given a list of text parts first, print just each part's text.
PARTS_IDENTITY = {
    "loop": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}",
    # GLM 4.5's visible_text: a string printed, a list's text parts (and strings) printed.
    "glm": (
        "{% macro show(content) %}{% if content is string %}{{ content }}"
        "{% elif content is iterable and content is not mapping %}{% for item in content %}"
        "{% if item is mapping and item.type == 'text' %}{{ item.text }}{% elif item is string %}{{ item }}"
        "{% elif item is mapping and item.type in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}"
        "{% endfor %}{% else %}{{ content }}{% endif %}{% endmacro %}"
    ),
    # Qwen 3.5's render_content: media counted in namespaces, never for a text part.
    "keys_tested": (
        "{% set count = namespace(value=0) %}{% macro show(c, counted=false) %}{% if c is string %}{{ c }}"
        "{% else %}{% for p in c %}{% if 'image' in p or p['type'] == 'image' %}"
        "{% if counted %}{% set count.value = count.value + 1 %}{% endif %}<image>"
        "{% elif 'text' in p %}{{ p['text'] }}{% else %}{{ raise_exception('no') }}{% endif %}{% endfor %}"
        "{% endif %}{% endmacro %}"
    ),
}
#: Macros that print something else of a list of text parts, or more than their texts.
PARTS_OTHERS = {
    "twice": "{% macro show(c) %}{% for p in c %}{{ p.text }}{{ p.text }}{% endfor %}{% endmacro %}",
    "whole_part": "{% macro show(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}",
    "after_loop": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}!{% endmacro %}",
    "trimmed": "{% macro show(c) %}{% for p in c %}{{ p.text | trim }}{% endfor %}{% endmacro %}",
    "other_key": "{% macro show(c) %}{% for p in c %}{{ p.type }}{% endfor %}{% endmacro %}",
    "indexed": "{% macro show(c) %}{% for p in c %}{{ p.text }}{{ loop.index }}{% endfor %}{% endmacro %}",
    "counts": (
        "{% set n = namespace(v=0) %}{% macro show(c) %}{% for p in c %}{% set n.v = n.v + 1 %}{{ p.text }}"
        "{% endfor %}{% endmacro %}"
    ),
    "text_tested_as_image": (
        "{% macro show(c) %}{% for p in c %}{% if p.type == 'text' %}<image>{% else %}{{ p.text }}{% endif %}"
        "{% endfor %}{% endmacro %}"
    ),
    "two_loops": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% for p in c %}{% endfor %}{% endmacro %}",
    "loop_else": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% else %}-{% endfor %}{% endmacro %}",
    "filtered_loop": "{% macro show(c) %}{% for p in c if p.text %}{{ p.text }}{% endfor %}{% endmacro %}",
}


@pytest.mark.parametrize("name", sorted(PARTS_IDENTITY))
def test_a_macro_printing_its_parts_texts_is_an_identity_for_parts(name: str) -> None:
    tree = ChatTemplate.from_source(PARTS_IDENTITY[name]).syntax_tree
    assert identity_macros(tree, parts=True) == {"show"}
    # What it prints of one text part, the form vLLM hands a text in: that text.
    template = ChatTemplate.from_source(PARTS_IDENTITY[name] + "{{ show(messages[0].content) }}")
    assert template.render([{"role": "user", "content": [{"type": "text", "text": " a\n"}]}]) == " a\n"


@pytest.mark.parametrize("name", sorted(PARTS_OTHERS))
def test_other_macros_are_not_identities_for_parts(name: str) -> None:
    assert identity_macros(ChatTemplate.from_source(PARTS_OTHERS[name]).syntax_tree, parts=True) == frozenset()
