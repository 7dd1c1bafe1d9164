"""The contract between the proxy and its routing policies.

A policy is a small synchronous class: given one request and a read-only view of the
eligible backends, it picks one and says why. It does no I/O and never blocks; the proxy
does the tokenizing, the prefix match and all bookkeeping around it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol


class BackendView(Protocol):
    """What a policy may read about a backend. Implemented by ``kvroute.router.fleet.backends.Backend``."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """Requests this router has sent there and not yet seen finish."""

    @property
    def in_flight_tokens(self) -> int:
        """Prompt tokens plus expected decode tokens of those requests (0 when unknown)."""

    @property
    def capacity_tokens(self) -> int | None:
        """KV cache size in tokens (configured or scraped from the engine); None if unknown."""

    @property
    def engine_waiting(self) -> int | None:
        """The engine's own waiting queue length from its /metrics; None if not scraped."""

    @property
    def engine_running(self) -> int | None:
        """The engine's running requests from its /metrics; None if not scraped."""

    @property
    def index_tokens(self) -> int:
        """Tokens the router's prefix index believes this backend holds."""


@dataclass(slots=True)
class RouteRequest:
    """One request as the policies see it."""

    endpoint: str
    model: str | None = None
    session_key: str | None = None
    # Filled only when the proxy tracks prefixes (a cache-aware policy is configured):
    prompt_tokens: int | None = None
    matched_tokens: Mapping[str, int] = field(default_factory=dict)  # backend url -> tokens
    expected_output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CandidateCost:
    """One backend's price for a request, in prompt tokens, as a cost-based policy saw it."""

    backend: str
    matched_tokens: int
    #: Prompt tokens it would prefill there.
    prefill: int
    #: Work queued there (tokens, net of what this request shares with it) and its price.
    queued_tokens: float
    queue: float
    #: What the placement does to the caches: thrash it adds there, relief it brings home.
    capacity: float
    #: Hysteresis: the margin a conversation's move must pay for the history it leaves.
    stay: float
    cost: float
    in_flight: int
    #: Over the bounded-load test: skipped unless every candidate is.
    over_bound: bool


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a cost-based policy chose as it did: every candidate's terms (when asked for)."""

    candidates: tuple[CandidateCost, ...]
    #: Price of one token of queued work against one token of prefill, as applied.
    load_weight: float
    #: Where the request's conversation lived before it (None: new or not followed).
    home: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen backend and a short machine-readable reason (``x-kvroute-reason``)."""

    backend: str
    reason: str
    matched_tokens: int = 0
    #: Filled only when the policy's ``explain`` is on (the decision log or ring wants it).
    explanation: Explanation | None = None


class Policy(ABC):
    """Base class of all routing policies."""

    name: ClassVar[str]
    #: True when the policy reads ``RouteRequest.prompt_tokens`` / ``matched_tokens``.
    needs_prefix_match: ClassVar[bool] = False
    #: Attach an :class:`Explanation` to each decision (costs a little; off on the hot path).
    explain: bool = False

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        """Pick one of ``candidates`` (never empty: healthy backends serving the model)."""

    def forget_backend(self, url: str) -> None:  # noqa: B027 (a hook: stateless policies keep nothing)
        """Drop any state about a backend that left the pool."""
