"""The contract between the routing engine and its policies.

A policy is a small synchronous class: given one request and a read-only view of the
eligible backends, it picks one and says why. It does no I/O and never blocks; the routing
engine does the tokenizing, the prefix match and all bookkeeping around it, and hands the
policy what it knows in the :class:`RouteRequest`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Self

from kvroute.router.config import Settings
from kvroute.router.routing.ledger import Conversation, WorkingSets


class BackendView(Protocol):
    """What a policy may read about a backend. Implemented by ``kvroute.router.fleet.backends.Backend``."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """Requests in flight there that this router knows of: those it sent and has not seen
        finish, plus those its peer routers last reported (``--peers``)."""

    @property
    def in_flight_work_tokens(self) -> int:
        """The load those requests put there: the sum of their :meth:`RouteRequest.work_tokens`."""

    @property
    def capacity_tokens(self) -> int | None:
        """KV cache size in tokens (configured or scraped from the engine); None if unknown."""

    @property
    def engine_waiting(self) -> int | None:
        """The engine's own waiting queue length from its /metrics; None if not scraped."""

    @property
    def engine_running(self) -> int | None:
        """The engine's running requests from its /metrics; None if not scraped."""


@dataclass(slots=True)
class RouteRequest:
    """One request as the policies see it, with what the routing engine knows about it."""

    endpoint: str
    model: str | None = None
    session_key: str | None = None
    expected_output_tokens: int = 0
    # The rest is filled only when the routing engine tracks prefixes (some policy in use
    # reads them) and could tokenize the request. Mappings are keyed by backend url.
    prompt_tokens: int | None = None
    #: Leading prompt tokens the prefix index believes each backend holds.
    matched_tokens: Mapping[str, int] = field(default_factory=dict)
    #: The part of each backend's match that requests in flight there are still computing:
    #: work this request would share rather than wait behind.
    computing_tokens: Mapping[str, int] = field(default_factory=dict)
    #: Tokens the prefix index holds per candidate backend, whatever the prompt.
    index_tokens: Mapping[str, int] = field(default_factory=dict)
    #: For a prompt no candidate holds any of, the tokens the prefix index may hold per
    #: candidate whose cache size is known: the size, scaled down where the engine's answers
    #: showed it evicts earlier (the cache model). Empty otherwise.
    index_capacity_tokens: Mapping[str, int] = field(default_factory=dict)
    #: Per candidate whose answers check the index's predictions, the recent share of them
    #: that showed an eviction the index did not foresee (0..1). Absent: no evidence yet, or
    #: the backend's index follows its KV events.
    eviction_rates: Mapping[str, float] = field(default_factory=dict)
    #: The conversation this request continues or begins (the ledger's entry; read only).
    conversation: Conversation | None = None

    def work_tokens(self, matched_tokens: int) -> int:
        """The load this request puts on a backend holding ``matched_tokens`` of its prompt:
        the uncached prompt tokens plus the expected output tokens (no prompt tokens when
        the prompt is unknown). Counted in ``BackendView.in_flight_work_tokens`` from dispatch
        to finish."""
        return max(0, (self.prompt_tokens or 0) - matched_tokens) + self.expected_output_tokens


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


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may be built from: the settings and the routing engine's ledger."""

    settings: Settings
    working_sets: WorkingSets


def over_load_bound(in_flight: int, total_in_flight: int, candidates: int, factor: float, floor: float = 2.0) -> bool:
    """The bounded-load test: ``in_flight + 1 > factor * (mean in_flight of the others + floor)``.

    Counted in requests, because a long cached prefix can make hundreds of cheap requests
    look like little work in tokens while they share one replica's batch (or, for new
    sessions, in the conversations each backend hosts). ``floor`` keeps a few requests on
    an otherwise idle fleet from counting as overload.
    """
    if candidates < 2:
        return False
    others = (total_in_flight - in_flight) / (candidates - 1)
    return in_flight + 1 > factor * (others + floor)


class Policy(ABC):
    """Base class of all routing policies; the first line of a subclass's docstring is its
    summary in the README's policy table."""

    #: True when the policy reads the prompt: ``RouteRequest.prompt_tokens`` and the
    #: fields after it (the routing engine then tokenizes and matches every request).
    needs_prefix_match: ClassVar[bool] = False
    #: Attach an :class:`Explanation` to each decision (costs a little; off on the hot path).
    explain: bool = False

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        """A new instance for a router (policies with knobs read them from ``context.settings``)."""
        return cls()

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        """Pick one of ``candidates`` (never empty: healthy backends serving the model)."""

    def forget_backend(self, url: str) -> None:  # noqa: B027 (a hook: stateless policies keep nothing)
        """Drop any state about a backend that left the pool."""
