"""``python -m kvroute.router.routing.policies``: the README's policy table."""

from kvroute.router.routing.policies.registry import policy_table_markdown

print(policy_table_markdown())
