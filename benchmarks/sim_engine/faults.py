"""Fault injection: what the next N generation requests should suffer (``POST /sim/fault``).

The reliability suite uses this to make a live replica misbehave on demand, the way a
real engine does when it crashes, overloads or wedges, without restarting anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

FaultMode = Literal[
    "none",
    "error_500",
    "error_503",
    "hang_before_first_byte",
    "stall_mid_stream",
    "close_mid_stream",
]
FAULT_MODES: tuple[str, ...] = get_args(FaultMode)


@dataclass(slots=True)
class FaultState:
    """The active fault and how many more requests it applies to (None: until reset)."""

    mode: FaultMode = "none"
    remaining: int | None = None
    applied: int = 0


class FaultInjector:
    """Hands out the active fault to generation requests, one count per request."""

    def __init__(self) -> None:
        self._state = FaultState()

    @property
    def state(self) -> FaultState:
        return self._state

    def set(self, mode: FaultMode, count: int | None) -> None:
        """Activate ``mode`` for the next ``count`` requests (None: every request)."""
        self._state = FaultState(mode=mode, remaining=count)

    def take(self) -> FaultMode:
        """The fault for the request now arriving; uses up one count of it."""
        state = self._state
        if state.mode == "none":
            return "none"
        if state.remaining is not None:
            if state.remaining <= 0:
                self._state = FaultState()
                return "none"
            state.remaining -= 1
        state.applied += 1
        mode = state.mode
        if state.remaining == 0:
            self._state = FaultState(applied=state.applied)
        return mode
