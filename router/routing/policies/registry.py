"""The policy registry: every policy by its ``--policy`` name, one line each.

Adding a policy: its class in a module of this package (a subclass of
:class:`~kvroute.router.routing.policies.base.Policy`; the first line of its docstring is
its row in the README), and one line in :data:`POLICIES`. :data:`LOAD_ONLY_POLICIES`, the
README's policy table (``python -m kvroute.router.routing.policies``) and the
policies the routing engine builds come from here; the name also goes into
``PolicyName`` in :mod:`kvroute.router.config`, the layer below this room, which cannot
import it (mypy checks the keys below against it, and a test the order).
"""

from __future__ import annotations

from kvroute.router.config import PolicyName, Settings
from kvroute.router.routing.policies.base import Policy, PolicyContext
from kvroute.router.routing.policies.cache_aware import CacheAware
from kvroute.router.routing.policies.simple import LeastLoad, PowerOfTwo, Random, RoundRobin
from kvroute.router.routing.policies.sticky import Sticky

#: Every policy by its ``--policy`` name, in the order ``kvroute serve --help`` lists them.
POLICIES: dict[PolicyName, type[Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "random": Random,
    "power_of_two": PowerOfTwo,
    "sticky": Sticky,
    "cache_aware": CacheAware,
}

#: Policies that look at load only; they need neither the tokenizer nor the prefix index.
LOAD_ONLY_POLICIES: frozenset[str] = frozenset(
    name for name, policy in POLICIES.items() if not policy.needs_prefix_match
)


def make_policy(name: str, context: PolicyContext) -> Policy:
    """A new policy instance by its ``--policy`` name."""
    policy = next((policy for known, policy in POLICIES.items() if known == name), None)
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
