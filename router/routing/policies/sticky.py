"""Sticky sessions: consistent hashing with bounded load.

A request's session key comes from the ``session_header`` header (``x-session-id`` by
default) or the body's ``prompt_cache_key``, ``user`` or Anthropic ``metadata.user_id``
field (the routing engine extracts it: ``request_info.session_key_of``). A new session is
placed by rendezvous hashing -- every backend gets a score ``hash(key, url)`` and the
session goes to the highest-scoring one -- so every router replica, with no shared
state, makes the same first choice, and adding or removing a backend moves only the
sessions that must move. The choice is then remembered, and a session moves only when
its backend is gone or over the load bound; it then goes to the next backend in its own
score order that is within the bound, and stays there.

Load bound (as in "consistent hashing with bounded loads"), in requests: a backend is full
when ``in_flight + 1 > overload_factor * (mean in_flight of the other candidates + 2)``
(:func:`~kvroute.router.routing.policies.base.over_load_bound`, the cache-aware policy's test too).

Requests without a session key are routed by the fallback policy (cache-aware).
Reasons: ``sticky`` (kept or first placed by its hash), ``overload`` (moved because its
backend was over the bound), or the fallback's reason.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Self

from kvroute.router.routing.policies.base import (
    BackendView,
    Decision,
    Policy,
    PolicyContext,
    RouteRequest,
    over_load_bound,
)
from kvroute.router.routing.policies.cache_aware import CacheAware

#: Bound on remembered sessions (about 150 bytes each); the least recent are forgotten and
#: simply placed by their hash again when they come back.
MAX_SESSIONS = 500_000


def rendezvous_score(key: str, url: str) -> int:
    """A stable 64-bit score of (session, backend); the same in every process."""
    digest = hashlib.blake2b(f"{key}\x00{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Sticky(Policy):
    """One backend per session key (`x-session-id`, else the body's `prompt_cache_key`, `user` or Anthropic `metadata.user_id`): rendezvous hashing with bounded load; no key: `cache_aware`.

    See the module docstring.
    """

    needs_prefix_match = True  # for requests without a session key (the fallback)

    def __init__(self, fallback: Policy, *, overload_factor: float = 2.0, max_sessions: int = MAX_SESSIONS) -> None:
        self._fallback = fallback
        self._overload_factor = overload_factor
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session key -> backend url

    @classmethod
    def build(cls, context: PolicyContext) -> Self:
        return cls(CacheAware.build(context), overload_factor=context.settings.overload_factor)

    def __len__(self) -> int:
        return len(self._sessions)

    @property  # type: ignore[override]
    def explain(self) -> bool:
        """Requests without a session key are the fallback's: it explains them."""
        return self._fallback.explain

    @explain.setter
    def explain(self, value: bool) -> None:
        self._fallback.explain = value

    def choose(self, request: RouteRequest, candidates: Sequence[BackendView]) -> Decision:
        key = request.session_key
        if key is None:
            return self._fallback.choose(request, candidates)
        sessions = self._sessions
        assigned = sessions.get(key)
        total = sum(backend.in_flight for backend in candidates)
        count = len(candidates)
        factor = self._overload_factor

        def full(backend: BackendView) -> bool:
            return over_load_bound(backend.in_flight, total, count, factor)

        reason = "sticky"
        if assigned is not None:
            for backend in candidates:
                if backend.url == assigned:
                    if not full(backend):
                        sessions.move_to_end(key)
                        return Decision(assigned, "sticky", request.matched_tokens.get(assigned, 0))
                    reason = "overload"
                    break
        ranked = sorted(candidates, key=lambda backend: rendezvous_score(key, backend.url), reverse=True)
        chosen = next((b for b in ranked if not full(b)), ranked[0])
        if assigned is None and chosen is not ranked[0]:
            reason = "overload"
        sessions[key] = chosen.url
        sessions.move_to_end(key)
        if len(sessions) > self._max_sessions:
            sessions.popitem(last=False)
        return Decision(chosen.url, reason, request.matched_tokens.get(chosen.url, 0))

    def forget_backend(self, url: str) -> None:
        """Sessions on a removed backend are placed again by their hash on their next request."""
        for key in [key for key, backend in self._sessions.items() if backend == url]:
            del self._sessions[key]
        self._fallback.forget_backend(url)
