"""When to probe each backend next: the normal interval while it is healthy, fast while not.

A router started a moment before its engines (a Compose or Kubernetes rollout) finds them
down; probing them again only after a full health interval keeps a fleet idle for that long
after it is ready. So a backend that is unhealthy (never answered yet, or marked unhealthy
since) is probed after ``first_retry_s`` (0.25 s), then at doubling intervals up to the
normal one, until it is healthy again. While a passing backend still needs more passing
checks (``healthy_after``), the next one follows after ``first_retry_s`` too, so recovery
takes a fraction of a second once the engine is back. A healthy backend is probed every
``interval_s``.

Pure bookkeeping on caller-supplied ``time.monotonic()`` values; the health checker does the
probing and tells the schedule what happened.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

#: The first retry of an unhealthy backend; the interval doubles from here.
FIRST_RETRY_S = 0.25


@dataclass(slots=True)
class _Plan:
    """The next probe of one backend."""

    due: float
    #: The delay that set ``due`` (the next failed fast probe doubles it).
    delay: float
    #: Planned as an unhealthy backend (fast retries).
    fast: bool
    #: A probe is running; ``due`` is set again when it reports.
    pending: bool = False


class ProbeSchedule:
    """Next-probe times per backend URL; see the module docstring."""

    def __init__(self, interval_s: float, first_retry_s: float = FIRST_RETRY_S) -> None:
        if interval_s <= 0 or first_retry_s <= 0:
            raise ValueError("probe intervals must be positive")
        self._interval_s = interval_s
        self._first_retry_s = min(first_retry_s, interval_s)
        self._plans: dict[str, _Plan] = {}

    def track(self, url: str, healthy: bool, now: float) -> None:
        """Plan a backend seen in the pool: a newcomer (probed once when it joined) gets its
        next probe; one that turned unhealthy between probes is retried fast from now on."""
        plan = self._plans.get(url)
        if plan is None:
            self._plans[url] = self._fresh(healthy, now)
        elif not healthy and not plan.fast and not plan.pending:
            self._plans[url] = self._fresh(False, now)

    def retain(self, urls: Iterable[str]) -> None:
        """Forget backends that left the pool."""
        keep = set(urls)
        for url in [url for url in self._plans if url not in keep]:
            del self._plans[url]

    def due(self, now: float) -> list[str]:
        """Backends whose probe is due and not already running."""
        return [url for url, plan in self._plans.items() if not plan.pending and plan.due <= now]

    def started(self, url: str) -> None:
        """A probe of ``url`` is running: it is not due again until it reports."""
        plan = self._plans.get(url)
        if plan is not None:
            plan.pending = True

    def probed(self, url: str, *, passed: bool, healthy: bool, now: float) -> None:
        """A probe finished: ``passed`` is its own result, ``healthy`` the backend's health after it."""
        plan = self._plans.get(url)
        if plan is None:
            return  # the backend left the pool while it was probed
        if healthy:
            delay = self._interval_s
        elif passed or not plan.fast:
            # Confirming a recovery (healthy_after), or the first retry after falling ill.
            delay = self._first_retry_s
        else:
            delay = min(plan.delay * 2, self._interval_s)
        self._plans[url] = _Plan(now + delay, delay, fast=not healthy)

    def next_due(self) -> float | None:
        """The earliest planned probe that is not running (None: nothing planned)."""
        due = min((plan.due for plan in self._plans.values() if not plan.pending), default=math.inf)
        return None if due == math.inf else due

    def _fresh(self, healthy: bool, now: float) -> _Plan:
        delay = self._interval_s if healthy else self._first_retry_s
        return _Plan(now + delay, delay, fast=not healthy)
