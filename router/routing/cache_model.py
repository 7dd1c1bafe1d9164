"""How much of each engine's configured KV cache the router may count on, learnt from feedback.

The prefix index models each engine's cache as an LRU of ``capacity_tokens``. A real
engine holds less than that: running requests' blocks, preemption, other clients and
block-granular eviction all take room the model does not see. When an engine reports
fewer ``cached_tokens`` than blocks that *completed* requests put in the index, the model
was too optimistic: the engine evicted earlier than modelled. What to correct is the
model's capacity, not the prompt's blocks -- the engine has just computed the whole
prompt and holds every full block of it now.

So each backend carries a *scale* in ``[MIN_SCALE, 1]`` of its configured capacity:

* a shortfall lowers it to what the index holds minus what the engine missed (the
  engine's cache evidently holds that much less), at most :data:`MAX_DROP` of it per
  event, so one engine restart or a burst of another client's traffic cannot halve it;
* a confirmed prediction (the engine held at least what completed requests put in the
  index) raises it by :data:`GROW` of the configured capacity, so the model creeps back
  when the engine holds more again.

Additive increase, bounded multiplicative decrease: the scale settles where the model
evicts about when the engine does. No I/O; the routing engine owns one.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The model never believes less than this share of the configured cache.
MIN_SCALE = 0.25
#: At most this share of the current scale is lost per shortfall.
MAX_DROP = 0.25
#: Share of the configured capacity regained per confirmed prediction.
GROW = 0.01
#: Weight of the newest answer in a backend's running eviction rate (about the last ten).
EVICTION_RATE_WEIGHT = 0.1


@dataclass(slots=True)
class AnswerCounts:
    """This router's answers from one backend that checked a prediction of its model."""

    #: The engine held all that completed requests had put in the index.
    held: int = 0
    #: It held less: it evicted earlier than the model did.
    evicted: int = 0


@dataclass(frozen=True, slots=True)
class Correction:
    """One change of a backend's scale (for the decision log and tests)."""

    backend: str
    before: float
    after: float


class CacheModel:
    """Per backend, the share of its configured capacity the index models."""

    def __init__(self) -> None:
        self._scales: dict[str, float] = {}
        self._eviction_rates: dict[str, float] = {}
        self._answers: dict[str, AnswerCounts] = {}
        #: Counts the changes of any scale (what a capacity applied earlier was computed from).
        self.version = 0

    def eviction_rate(self, backend: str) -> float | None:
        """The recent share of ``backend``'s answers that showed an eviction the index did not
        foresee (a running mean); None before its first answer with a prediction to check."""
        return self._eviction_rates.get(backend)

    def answered(self, backend: str, *, evicted: bool) -> None:
        """An answer checked a prediction: the engine evicted part of it (a :meth:`shortfall`
        follows where the capacity is known), or held all of it, and the modelled cache
        creeps back towards the configured size."""
        self._count_answer(backend, evicted)
        counts = self._answers.get(backend)
        if counts is None:
            counts = self._answers[backend] = AnswerCounts()
        if evicted:
            counts.evicted += 1
        else:
            counts.held += 1
            self._grow(backend)

    def answers(self) -> dict[str, AnswerCounts]:
        """Per backend, this router's answers that checked a prediction (not its peers')."""
        return dict(self._answers)

    def peer_answered(self, backend: str, evicted: bool) -> None:
        """A peer router's answer: moves the eviction rate as this router's own do, so the
        routers of a fleet weigh the thrash estimate alike; the scale stays this model's."""
        self._count_answer(backend, evicted)

    def _count_answer(self, backend: str, evicted: bool) -> None:
        rate = self._eviction_rates.get(backend, 0.0)
        self._eviction_rates[backend] = rate + EVICTION_RATE_WEIGHT * (float(evicted) - rate)

    def scale(self, backend: str) -> float:
        return self._scales.get(backend, 1.0)

    def capacity(self, backend: str, configured_tokens: int) -> int:
        """Tokens the index should model for ``backend`` with ``configured_tokens`` configured."""
        return int(configured_tokens * self.scale(backend))

    def shortfall(self, backend: str, configured_tokens: int, held_tokens: int, missing_tokens: int) -> Correction:
        """The engine missed ``missing_tokens`` the index (holding ``held_tokens``) said it had."""
        before = self.scale(backend)
        evident = max(0, held_tokens - missing_tokens) / configured_tokens
        after = max(MIN_SCALE, before * (1.0 - MAX_DROP), min(before, evident))
        self._scales[backend] = after
        self.version += 1
        return Correction(backend, before, after)

    def _grow(self, backend: str) -> None:
        before = self._scales.get(backend)
        if before is not None:
            self.version += 1
            after = min(1.0, before + GROW)
            if after >= 1.0:
                del self._scales[backend]
            else:
                self._scales[backend] = after

    def forget(self, backend: str) -> None:
        if self._scales.pop(backend, None) is not None:
            self.version += 1
        self._eviction_rates.pop(backend, None)
        self._answers.pop(backend, None)
