"""Which backend stored which Responses API answer, so its continuations go back there.

A vLLM started with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` keeps each ``/v1/responses``
answer in its own memory; a request continuing it (``previous_response_id``) finds the
history only on that replica and is answered 404 elsewhere. The router remembers the
backend of every answer's id (the engine's ``usage`` reader finds it beside the usage) and
routes a continuation there whatever the policy, when that backend is still a candidate.

Bounded: the most recent :data:`REMEMBERED` ids (an id is ~30 bytes, a backend URL shared).
Per router process: with ``--workers`` or several routers a continuation that reaches
another process is routed by its policy.
"""

from __future__ import annotations

from collections import OrderedDict

#: Answers remembered; the oldest is forgotten beyond (about 10 MB at most).
REMEMBERED = 65_536


class StoredResponses:
    """Response id -> the backend that answered it, the most recent :data:`REMEMBERED`."""

    def __init__(self, capacity: int = REMEMBERED) -> None:
        self._capacity = capacity
        self._backends: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._backends)

    def remember(self, response_id: str, backend: str) -> None:
        """``backend`` answered (and may have stored) ``response_id``."""
        backends = self._backends
        backends[response_id] = backend
        backends.move_to_end(response_id)
        if len(backends) > self._capacity:
            backends.popitem(last=False)

    def backend_of(self, response_id: object) -> str | None:
        """The backend that answered ``response_id``, if remembered."""
        return self._backends.get(response_id) if isinstance(response_id, str) else None

    def forget_backend(self, backend: str) -> None:
        """The backend left the pool (its store went with it)."""
        for response_id in [key for key, value in self._backends.items() if value == backend]:
            del self._backends[response_id]
