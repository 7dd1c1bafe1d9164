"""TurnBatch: the work of one event-loop turn's requests, done in a row, each its own answer."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.router.forwarding.turn_batch import TurnBatch


def _doubling(calls: list[int]) -> TurnBatch[int, int]:
    def work(item: int) -> int:
        calls.append(item)
        if item < 0:
            raise ValueError(f"negative: {item}")
        return 2 * item

    return TurnBatch(work)


async def test_one_turns_items_are_worked_in_one_batch_in_order() -> None:
    calls: list[int] = []
    batch = _doubling(calls)
    results = await asyncio.gather(*(batch.run(item) for item in range(5)))
    assert results == [0, 2, 4, 6, 8]
    assert calls == [0, 1, 2, 3, 4]
    assert (batch.batches, batch.items) == (1, 5)


async def test_each_turn_gets_its_own_batch() -> None:
    batch = _doubling([])
    assert await batch.run(1) == 2
    assert await asyncio.gather(batch.run(2), batch.run(3)) == [4, 6]
    assert (batch.batches, batch.items) == (2, 3)


async def test_an_exception_goes_to_its_own_caller_only() -> None:
    batch = _doubling([])
    results = await asyncio.gather(batch.run(1), batch.run(-1), batch.run(3), return_exceptions=True)
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError) and str(results[1]) == "negative: -1"


async def test_a_caller_cancelled_while_waiting_is_skipped() -> None:
    calls: list[int] = []
    batch = _doubling(calls)
    kept = asyncio.ensure_future(batch.run(1))
    dropped = asyncio.ensure_future(batch.run(2))
    await asyncio.sleep(0)  # both are waiting for the batch
    dropped.cancel()
    assert await kept == 2
    with pytest.raises(asyncio.CancelledError):
        await dropped
    assert calls == [1] and batch.items == 1
