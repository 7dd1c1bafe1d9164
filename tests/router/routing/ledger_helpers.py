"""Shared steps of the ledger and cache-aware tests."""

from __future__ import annotations

from kvroute.router.routing.ledger import Conversation, WorkingSets


def settle(working_sets: WorkingSets, key: str, backend: str, tokens: int) -> Conversation:
    """A conversation that has taken two turns on ``backend`` (so it counts there)."""
    conversation = working_sets.find(key, [], 0)
    assert conversation is not None
    working_sets.record(conversation, backend, tokens - 10, None)
    working_sets.record(conversation, backend, tokens, None)
    return conversation
