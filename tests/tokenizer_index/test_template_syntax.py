"""The syntax-tree readings the template checks share: live branches, decided tests, keys."""

from __future__ import annotations

from functools import partial

import pytest
from jinja2 import nodes

from kvroute.tokenizer_index.chat_template import ChatTemplate
from kvroute.tokenizer_index.template_syntax import decided, key_of, live


def _tree(source: str) -> nodes.Template:
    return ChatTemplate.from_source(source).syntax_tree


def _names_known(test: nodes.Node) -> bool | None:
    """``yes`` is true, ``no`` false, any other name undecided."""
    if isinstance(test, nodes.Name):
        return {"yes": True, "no": False}.get(test.name)
    return None


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("yes", True),
        ("not no", True),
        ("yes or other", True),  # True decides an or
        ("no and other", False),  # False decides an and
        ("other or no", None),
        ("yes and other", None),
        ("not (no or no)", True),
        ("yes and not no", True),
        ("other", None),
    ],
)
def test_a_test_is_decided_by_its_parts(expression: str, value: bool | None) -> None:
    (output,) = _tree("{{ " + expression + " }}").body
    assert decided(output.nodes[0], _names_known) is value


def test_live_leaves_out_the_branches_decided_against_and_those_after_one_taken() -> None:
    tree = _tree(
        "{% if no %}{{ a }}{% elif other %}{{ b }}{% elif yes %}{{ c }}{% elif other %}{{ d }}{% else %}{{ e }}{% endif %}"
        "{% macro m() %}{{ f }}{% endmacro %}"
    )
    truth = partial(decided, leaf=_names_known)
    printed = {node.name for node in live(tree, truth) if isinstance(node, nodes.Name) and node.ctx == "load"}
    assert printed >= {"b", "c"} and not printed & {"a", "d", "e"}
    (macro,) = tree.find_all(nodes.Macro)
    skipped = {node.name for node in live(tree, truth, frozenset({id(macro)})) if isinstance(node, nodes.Name)}
    assert "f" in printed and "f" not in skipped


def test_a_key_is_read_only_when_constant() -> None:
    (output,) = _tree("{{ x.a }}{{ x['b'] }}{{ x[k] }}{{ x[0] }}").body
    assert [key_of(node) for node in output.nodes] == ["a", "b", None, None]
