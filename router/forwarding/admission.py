"""Admission control: how many requests run at once, and who waits how long for a turn.

Both limits count requests, not tokens (the load policies weigh is
``Backend.in_flight_work_tokens``; here a slot is one request). Both are optional
(``None``: unlimited, and this module costs nothing):

* ``max_concurrency``: requests the router lets run at once, fleet-wide. A request holds
  its slot from admission until its answer is finished, retries included.
* ``max_backend_concurrency``: requests this router has in flight on any one backend
  (each router replica enforces its own; peers' reported load does not count). A request is
  routed only among the candidates below the limit; when every candidate is full it waits.

A request that cannot run at once waits in one bounded FIFO queue (``queue_size``) for at
most ``queue_timeout_s``; a full queue or a wait that times out is answered ``429`` with
``Retry-After``, in OpenAI's error form, before anything was sent to an engine. Clients
(the ``openai`` SDK included) back off and retry on 429, which is what an overloaded fleet
needs, instead of piling more work onto engines that already queue.

Wake-ups are handed over, not broadcast: when a slot frees (a request finished, a backend
joined or recovered), the first waiter that can run *now* is woken, and a global slot is
reserved for it before it resumes, so a newcomer cannot overtake the queue in between.
A waiter whose client hangs up leaves the queue (and passes on a wake-up it was given).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from kvroute.router.errors import RouterError

log = logging.getLogger("kvroute.admission")


class HoldsRequests(Protocol):
    """What admission reads of a backend: this router's requests in flight there."""

    @property
    def own_in_flight(self) -> int: ...


B = TypeVar("B", bound=HoldsRequests)


class _Waiter(Generic[B]):
    """One queued request: its wake-up future, what it waits for, and what it holds."""

    __slots__ = ("eligible", "future", "needs_request_slot", "reserved")

    def __init__(
        self, future: asyncio.Future[None], eligible: Callable[[], Sequence[B]], needs_request_slot: bool
    ) -> None:
        self.future = future
        self.eligible = eligible
        self.needs_request_slot = needs_request_slot
        #: A global request slot was counted for it when it was woken.
        self.reserved = False


class AdmissionControl(Generic[B]):
    """The limits and the wait queue of one router; see the module docstring."""

    def __init__(
        self,
        *,
        max_concurrency: int | None,
        max_backend_concurrency: int | None,
        queue_size: int,
        queue_timeout_s: float,
    ) -> None:
        self._max_requests = max_concurrency
        self._max_requests_per_backend = max_backend_concurrency
        self._queue_size = queue_size
        self._timeout_s = queue_timeout_s
        self._waiters: deque[_Waiter[B]] = deque()
        #: Requests admitted and not yet finished (counted only with a global limit).
        self.active = 0
        #: Requests turned away with 429, by why (for metrics).
        self.rejected = {"queue_full": 0, "queue_timeout": 0}

    @property
    def limited(self) -> bool:
        """Whether any limit is configured (otherwise :meth:`admit` returns at once)."""
        return self._max_requests is not None or self._max_requests_per_backend is not None

    @property
    def queued(self) -> int:
        """Requests waiting for a turn now."""
        return len(self._waiters)

    def below_request_limit(self, candidates: Sequence[B]) -> Sequence[B]:
        """The candidates with fewer requests in flight than the per-backend limit."""
        limit = self._max_requests_per_backend
        if limit is None:
            return candidates
        return [backend for backend in candidates if backend.own_in_flight < limit]

    async def admit(self, eligible: Callable[[], Sequence[B]], *, holds_request_slot: bool) -> Sequence[B]:
        """Wait for this request's turn; return the eligible backends it may use now.

        ``eligible()`` lists the backends the request may go to (it is re-read after a
        wait: backends come and go meanwhile). ``holds_request_slot``: the request already
        holds a global slot (a retry); otherwise it takes one, to give back with :meth:`leave`.
        An empty result means no backend can take the request at all (the caller answers
        404/503); a full queue or a timeout raises :class:`RouterError` 429.
        """
        needs_request_slot = not holds_request_slot and self._max_requests is not None
        full = needs_request_slot and self._max_requests is not None and self.active >= self._max_requests
        if not self._waiters and not full:
            candidates = eligible()
            open_backends = self.below_request_limit(candidates)
            if open_backends or not candidates:
                if needs_request_slot:
                    self.active += 1
                return open_backends
        future = asyncio.get_running_loop().create_future()
        return await self._wait(_Waiter(future, eligible, needs_request_slot))

    def leave(self) -> None:
        """An admitted request finished: give its global slot to the next waiter."""
        if self._max_requests is not None:
            self.active -= 1
        self.wake()

    def wake(self) -> None:
        """Capacity may have freed (a request ended, a backend joined or recovered)."""
        waiters = self._waiters
        if not waiters:
            return
        for waiter in waiters:
            if self._ready(waiter.eligible, waiter.needs_request_slot):
                waiters.remove(waiter)
                if waiter.needs_request_slot:
                    # Counted now, so nobody overtakes it before it resumes.
                    self.active += 1
                    waiter.needs_request_slot = False
                    waiter.reserved = True
                waiter.future.set_result(None)
                return

    # --- internals -----------------------------------------------------------------------
    def _ready(self, eligible: Callable[[], Sequence[B]], needs_request_slot: bool) -> bool:
        if needs_request_slot and self._max_requests is not None and self.active >= self._max_requests:
            return False
        limit = self._max_requests_per_backend
        if limit is None:
            return True
        candidates = eligible()
        # No candidate at all is not a reason to wait: the caller answers 404/503 at once.
        return not candidates or any(backend.own_in_flight < limit for backend in candidates)

    async def _wait(self, waiter: _Waiter[B]) -> Sequence[B]:
        if len(self._waiters) >= self._queue_size:
            self.rejected["queue_full"] += 1
            raise self._too_many("the router is at its concurrency limit and its wait queue is full")
        self._waiters.append(waiter)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout_s):
                while True:
                    await waiter.future
                    candidates = self.below_request_limit(waiter.eligible())
                    if candidates or not waiter.eligible():
                        return candidates
                    # A backend filled up between the wake-up and now: wait again, first in line.
                    waiter.future = loop.create_future()
                    self._waiters.appendleft(waiter)
        except TimeoutError:
            self._give_up(waiter)
            self.rejected["queue_timeout"] += 1
            raise self._too_many(
                f"the router is at its concurrency limit; no turn within {self._timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            self._give_up(waiter)  # the client went away while waiting
            raise

    def _give_up(self, waiter: _Waiter[B]) -> None:
        """A waiter leaves without running: out of the queue, its slot and turn passed on."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass  # woken just as it gave up
        if waiter.reserved:
            self.active -= 1
        self.wake()

    def _too_many(self, message: str) -> RouterError:
        return RouterError(429, message, code="too_many_requests", headers={"Retry-After": str(self.retry_after_s())})

    def retry_after_s(self) -> int:
        """Seconds a turned-away client should wait: about one queue timeout, at least 1."""
        return max(1, math.ceil(min(self._timeout_s, 5.0)))
