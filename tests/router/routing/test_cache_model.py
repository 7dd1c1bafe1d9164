"""The model of each engine's cache: its scale learnt from shortfalls and confirmations,
its eviction rate, and the answers it counts (what ``kvroute_cache_model_*`` export)."""

from __future__ import annotations

from kvroute.router.routing.cache_model import GROW, MAX_DROP, MIN_SCALE, AnswerCounts, CacheModel

URL = "http://b0"


def test_a_shortfall_lowers_the_scale_to_what_the_engine_evidently_holds_within_the_bound() -> None:
    model = CacheModel()
    small = model.shortfall(URL, 8192, held_tokens=8192, missing_tokens=64)
    assert small.after == (8192 - 64) / 8192  # a few blocks missed: a little less
    large = model.shortfall(URL, 8192, held_tokens=8192, missing_tokens=8000)
    assert large.after == small.after * (1 - MAX_DROP)  # never more than a quarter at once
    for _ in range(20):
        model.shortfall(URL, 8192, held_tokens=8192, missing_tokens=8000)
    assert model.scale(URL) == MIN_SCALE and model.capacity(URL, 8192) == 8192 * MIN_SCALE


def test_held_answers_grow_the_scale_back_and_every_answer_is_counted() -> None:
    model = CacheModel()
    model.answered(URL, evicted=True)
    model.shortfall(URL, 1000, held_tokens=1000, missing_tokens=100)
    model.answered(URL, evicted=False)
    assert model.scale(URL) == 0.9 + GROW
    assert model.answers() == {URL: AnswerCounts(held=1, evicted=1)}
    rate = model.eviction_rate(URL)
    assert rate is not None and 0 < rate < 0.1
    model.peer_answered(URL, True)  # moves the rate, not this router's counts or scale
    assert model.eviction_rate(URL) > rate and model.answers()[URL] == AnswerCounts(1, 1)
    for _ in range(10):
        model.answered(URL, evicted=False)
    assert model.scale(URL) == 1.0


def test_a_forgotten_backend_starts_afresh() -> None:
    model = CacheModel()
    model.answered(URL, evicted=True)
    model.shortfall(URL, 1000, held_tokens=1000, missing_tokens=500)
    model.forget(URL)
    assert (model.scale(URL), model.eviction_rate(URL), model.answers()) == (1.0, None, {})
