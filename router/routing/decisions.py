"""Explained decisions: one record per finished attempt, to the decision log and a ring.

A record says which request (``request_id``), which conversation (its session key, or the
key the conversation ledger follows it by), where it went and why, every candidate's
cost terms as the policy priced them (prefill, queue, capacity; see
:class:`kvroute.router.routing.policies.base.CandidateCost`), and what came back (the engine's cached
tokens, TTFT, status). So a loss can be read request by request: ``--decision-log``
writes each record as one JSON line (logger ``kvroute.decisions``), and with the admin
API on, ``GET /admin/decisions?last=N`` returns the last ones from a bounded ring.

Cost: the policy builds the candidate terms only when a sink is on (``Policy.explain``),
and the record is built after the response, off the request's path to the engine.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from kvroute.router.routing.routing_engine import RoutePlan

#: The logger of ``--decision-log``'s lines (at INFO: ``kvroute serve`` lets them through
#: whatever ``--log-level`` says of the rest).
DECISION_LOGGER = "kvroute.decisions"
decision_log = logging.getLogger(DECISION_LOGGER)

#: Decisions the ring keeps when the admin API is on (a few KB each with 4-8 candidates).
RING_SIZE = 1024


@dataclass(slots=True)
class AttemptOutcome:
    """One finished attempt: where it went and what its response said. Built once by the
    proxy, read by the metrics (``RouterMetrics.record_request``) and the decision records.

    Not frozen, though never changed: a frozen dataclass's ``__init__`` sets each of the ten
    fields through ``object.__setattr__``, ~3 us more per request on the development machine
    (4.4 against 1.2 us).
    """

    request_id: str
    backend: str
    policy: str
    #: The endpoint's short name (``chat``, ``completions``, ...), a metrics label.
    endpoint: str
    #: The HTTP status the client got, as a label ("499": the client went away).
    status: str
    duration_s: float
    ttft_s: float | None
    #: The engine's ``usage.prompt_tokens`` (None: no usage reported).
    prompt_tokens: int | None
    #: Prompt tokens the router predicted to be cached on ``backend``.
    predicted_cached_tokens: int
    #: The engine's cached prompt tokens, as its engine module reads them (None: not reported).
    cached_tokens: int | None


class DecisionRecorder:
    """Builds decision records for the log and keeps the last :data:`RING_SIZE` of them."""

    def __init__(self, *, log: bool, ring_size: int) -> None:
        self._log = log
        self._ring: deque[dict[str, Any]] | None = deque(maxlen=ring_size) if ring_size > 0 else None

    @property
    def active(self) -> bool:
        """Whether anyone reads records (the policies explain their decisions only then)."""
        return self._log or self._ring is not None

    @property
    def ring_enabled(self) -> bool:
        return self._ring is not None

    def record(self, plan: RoutePlan, outcome: AttemptOutcome) -> None:
        """One finished attempt of ``plan``."""
        if not self.active:
            return
        entry = build_record(plan, outcome)
        if self._ring is not None:
            self._ring.append(entry)
        if self._log:
            decision_log.info(orjson.dumps(entry).decode())

    def last(self, count: int) -> list[dict[str, Any]]:
        """The last ``count`` records, oldest first (none when the ring is off)."""
        if self._ring is None or count <= 0:
            return []
        ring = self._ring
        return list(ring)[-count:]


def build_record(plan: RoutePlan, outcome: AttemptOutcome) -> dict[str, Any]:
    """The JSON-ready record of one decision and its outcome."""
    request = plan.request
    decision = plan.decision
    conversation = request.conversation
    record: dict[str, Any] = {
        "request_id": outcome.request_id,
        "session_key": request.session_key,
        "conversation": conversation.key if conversation is not None else None,
        "backend": plan.backend,
        "policy": plan.policy,
        "reason": plan.reason,
        "endpoint": outcome.endpoint,
        "status": outcome.status,
        "prompt_tokens": request.prompt_tokens if outcome.prompt_tokens is None else outcome.prompt_tokens,
        "predicted_cached_tokens": plan.predicted_cached_tokens,
        # What the router's own model of the cache predicted (differs where KV events answered).
        "modelled_cached_tokens": plan.modelled_cached_tokens,
        "observed_cached_tokens": outcome.cached_tokens,
        "ttft_s": outcome.ttft_s,
        "duration_s": round(outcome.duration_s, 6),
    }
    explanation = decision.explanation
    if explanation is not None:
        record["home"] = explanation.home
        record["load_weight"] = round(explanation.load_weight, 4)
        # Each candidate's recent share of answers showing evictions the model missed: how
        # much the ledger's thrash estimate counts there (policies.cache_aware.thrash_weight).
        record["eviction_rates"] = {url: round(rate, 3) for url, rate in request.eviction_rates.items()}
        record["candidates"] = [asdict(candidate) for candidate in explanation.candidates]
    return record
