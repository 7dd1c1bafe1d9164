"""The policy registry: every policy class by its ``--policy`` name.

The names and where each class lives are one line each in
:data:`kvroute.router.policy_catalog.POLICY_CLASSES` (the base layer, so that configuration
offers exactly them); this module imports the classes. :data:`LOAD_ONLY_POLICIES`, the
README's policy table (``python -m kvroute.router.routing.policies``) and the policies the
routing engine builds come from here.
"""

from __future__ import annotations

import importlib

from kvroute.router.config import Settings
from kvroute.router.policy_catalog import POLICY_CLASSES
from kvroute.router.routing.policies.base import Policy, PolicyContext


def load(location: str) -> type[Policy]:
    """The policy class at ``"module:Class"``."""
    module_name, _, class_name = location.partition(":")
    policy = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(policy, type) and issubclass(policy, Policy)):
        raise TypeError(f"{location} is not a Policy subclass")
    return policy


#: Every policy by its ``--policy`` name, in the catalog's order.
POLICIES: dict[str, type[Policy]] = {name: load(location) for name, location in POLICY_CLASSES.items()}

#: Policies that look at load only; they need neither the tokenizer nor the prefix index.
LOAD_ONLY_POLICIES: frozenset[str] = frozenset(
    name for name, policy in POLICIES.items() if not policy.needs_prefix_match
)


def make_policy(name: str, context: PolicyContext) -> Policy:
    """A new policy instance by its ``--policy`` name."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return policy.build(context)


def summary(policy: type[Policy]) -> str:
    """What the policy does, in one line: the first line of its docstring."""
    return (policy.__doc__ or "").strip().splitlines()[0]


def policy_table_markdown() -> str:
    """The README's policy table, one row per registered policy."""
    default = Settings.model_fields["policy"].default
    rows = ["| `--policy` | reads prompts | what it does |", "| --- | --- | --- |"]
    for name, policy in POLICIES.items():
        shown = f"`{name}` (default)" if name == default else f"`{name}`"
        rows.append(f"| {shown} | {'yes' if policy.needs_prefix_match else 'no'} | {summary(policy)} |")
    return "\n".join(rows)
