"""Eviction evidence routers share: how often each engine evicted what their models held.

The capacity term counts the ledger's thrash estimate on a backend in proportion to that
backend's recent eviction rate (:func:`~kvroute.router.routing.policies.cache_aware.thrash_weight`),
learnt from the engines' answers (:meth:`~kvroute.router.routing.cache_model.CacheModel.answered`).
Routers behind one client-side balancer each see only their share of the answers, so their
rates, and so their capacity terms, drift apart: under pressure one router protects a
backend's conversations while the other crowds it, and neither keeps any (two routers on 2 x
8K sims kept 0.74 of prompts where one kept 0.79; benchmarks/README, "Several routers").
So each router sends its peers what its answers said since its last message, per backend:
how many checked a prediction and how many of those showed an eviction; the peers fold them
into their own rates. A message is a delta, never a total, so none replaces another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from kvroute.router.routing.peer_load import count_pairs, decode_object

#: The topic of evidence on the ZMQ exchange (routers without it do not subscribe to it).
EVIDENCE_TOPIC = b"kvroute-evidence"
#: The head of evidence on a ``unix://`` link (never a valid placement head).
EVIDENCE_HEAD = b"kvroute-evidence/1"
#: Largest accepted message: a few hundred backends' counts.
MAX_EVIDENCE_BYTES = 1 << 20


@dataclass(slots=True)
class Answers:
    """Answers about one backend: those that checked a prediction, and those of them that
    showed an eviction the sender's model did not foresee."""

    checked: int = 0
    evicted: int = 0

    def add(self, evicted: bool) -> None:
        self.checked += 1
        self.evicted += evicted

    def in_order(self) -> list[bool]:
        """The answers as a sequence with the evictions spread evenly (their order is not sent)."""
        return [
            (position + 1) * self.evicted // self.checked > position * self.evicted // self.checked
            for position in range(self.checked)
        ]


def encode_evidence(answers: Mapping[str, Answers]) -> bytes:
    return orjson.dumps({url: [counts.checked, counts.evicted] for url, counts in answers.items()})


def decode_evidence(data: bytes) -> dict[str, Answers]:
    """The inverse of :func:`encode_evidence`; ``ValueError`` on anything else."""
    answers = {}
    for url, (checked, evicted) in count_pairs(decode_object(data, MAX_EVIDENCE_BYTES, "evidence"), "evidence").items():
        if evicted > checked:
            raise ValueError("malformed evidence")
        answers[url] = Answers(checked, evicted)
    return answers
