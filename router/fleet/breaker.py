"""Per-backend circuit breaker: outlier ejection on request failures, with recovery probing.

Health checks ask an engine "are you up?" (``GET /health``); the breaker watches what
really matters, the answers to real requests. An engine whose ``/health`` still says 200
while every request fails (a wedged GPU worker, an engine that lost its model, a proxy in
front of it answering 502) would otherwise keep receiving a share of the traffic.

States, as in Envoy's outlier detection and the classic circuit breaker:

* **closed**: requests flow; ``threshold`` consecutive failures (connection errors,
  timeouts, 5xx answers, streams broken by the engine) open it. Any good answer resets
  the count.
* **open**: the backend is ejected (no requests) for the cooldown.
* **half-open**: after the cooldown, exactly one real request is let through as a probe.
  If it succeeds the breaker closes; if it fails it opens again with the cooldown doubled
  (up to ``MAX_COOLDOWN_FACTOR`` times the base), so a backend that stays broken costs
  one failed attempt per growing interval, each retried elsewhere before the client sees
  anything. A probe whose client went away proves nothing: the next request probes again.

The breaker holds no timers: :meth:`CircuitBreaker.reopens_at` tells the pool when an
open breaker becomes half-open, and the pool checks that deadline on its hot path.
"""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    """The breaker's state; the value is what ``kvroute_backend_breaker_state`` exports."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


#: An open breaker's cooldown doubles per failed probe up to this multiple of the base.
MAX_COOLDOWN_FACTOR = 16


class CircuitBreaker:
    """The breaker of one backend. Not thread-safe: used on the event loop only."""

    __slots__ = (
        "_base_cooldown_s",
        "_cooldown_s",
        "_reopens_at",
        "_threshold",
        "failures",
        "probing",
        "state",
        "trips",
    )

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        if threshold < 1 or cooldown_s <= 0:
            raise ValueError("a breaker needs threshold >= 1 and cooldown_s > 0")
        self.state = BreakerState.CLOSED
        #: Consecutive failed requests while closed.
        self.failures = 0
        #: How many times it opened (for the admin API and tests).
        self.trips = 0
        #: A half-open probe request is in flight.
        self.probing = False
        self._threshold = threshold
        self._base_cooldown_s = cooldown_s
        self._cooldown_s = cooldown_s
        self._reopens_at = 0.0

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.state.name}, failures={self.failures}, trips={self.trips})"

    @property
    def admits(self) -> bool:
        """Whether a new request may be sent now (closed, or half-open with no probe out)."""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self.probing)

    @property
    def reopens_at(self) -> float | None:
        """When an open breaker turns half-open (a ``time.monotonic()`` value); None otherwise."""
        return self._reopens_at if self.state is BreakerState.OPEN else None

    def tick(self, now: float) -> bool:
        """Advance time: an open breaker whose cooldown is over turns half-open. True if it changed."""
        if self.state is BreakerState.OPEN and now >= self._reopens_at:
            self.state = BreakerState.HALF_OPEN
            self.probing = False
            return True
        return False

    def on_dispatch(self) -> bool:
        """A request is being sent; in half-open state it is the probe. True if admission changed."""
        if self.state is BreakerState.HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def on_success(self) -> bool:
        """The engine answered well (any non-5xx answer). True if the state changed.

        An open breaker stays open: a request sent before it opened proves little, and
        only the half-open probe decides when the backend comes back.
        """
        self.failures = 0
        if self.state is not BreakerState.HALF_OPEN:
            return False
        self.state = BreakerState.CLOSED
        self.probing = False
        self._cooldown_s = self._base_cooldown_s
        return True

    def on_failure(self, now: float) -> bool:
        """A request failed because of the engine. True if the breaker opened."""
        state = self.state
        if state is BreakerState.CLOSED:
            self.failures += 1
            if self.failures < self._threshold:
                return False
        elif state is BreakerState.HALF_OPEN:
            # The probe failed: stay out for longer this time.
            self._cooldown_s = min(self._cooldown_s * 2, self._base_cooldown_s * MAX_COOLDOWN_FACTOR)
        else:
            return False  # already open: requests sent before it opened are still finishing
        self.state = BreakerState.OPEN
        self.probing = False
        self.failures = 0
        self.trips += 1
        self._reopens_at = now + self._cooldown_s
        return True

    def on_abandoned(self) -> bool:
        """The request ended without telling anything (its client left). True if admission changed."""
        if self.state is BreakerState.HALF_OPEN and self.probing:
            self.probing = False
            return True
        return False
