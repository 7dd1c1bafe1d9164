"""Which backend stored which Responses API answer, so its continuations go back there.

A vLLM started with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` keeps each ``/v1/responses``
answer in its own memory; a request continuing it (``previous_response_id``) finds the
history only on that replica and is answered 404 elsewhere. The router remembers the
backend of every answer's id (the engine's ``usage`` reader finds it beside the usage, or
in its first stream event) and routes a continuation, and the stored response's own
calls, there whatever the policy, when that backend is still a candidate.

Bounded: the most recent ``--stored-responses`` ids (~180 bytes each, a backend URL
shared). Peer routers and workers tell each other what they learned
(:mod:`~kvroute.router.routing.peer_responses`); an id a process does not know is
searched for by the proxy, one 404 per replica that lacks it.
"""

from __future__ import annotations

from collections import OrderedDict


class StoredResponses:
    """Response id -> the backend that answered it, the most recent ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._backends: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._backends)

    def remember(self, response_id: str, backend: str) -> bool:
        """``backend`` answered (and may have stored) ``response_id``; whether that is news
        (an id not remembered, or remembered elsewhere)."""
        backends = self._backends
        news = backends.get(response_id) != backend
        backends[response_id] = backend
        backends.move_to_end(response_id)
        if len(backends) > self._capacity:
            backends.popitem(last=False)
        return news

    def backend_of(self, response_id: object) -> str | None:
        """The backend that answered ``response_id``, if remembered."""
        return self._backends.get(response_id) if isinstance(response_id, str) else None

    def forget_backend(self, backend: str) -> None:
        """The backend left the pool (its store went with it)."""
        for response_id in [key for key, value in self._backends.items() if value == backend]:
            del self._backends[response_id]
