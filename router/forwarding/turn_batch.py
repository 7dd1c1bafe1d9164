"""CPU work that several requests need, done for all the requests of one event-loop turn in a row.

A loaded router's requests take turns on one thread: between two requests' chat template
renders run the HTTP parsing, the relays and the socket writes of others, and each render
starts with the template's code and data evicted from the CPU's caches (a ~2 KB chat's
render, tokenization and hashing cost ~60 us back to back, ~250 us that way). A request
that needs the work hands it to a :class:`TurnBatch` and awaits it; the first one of a
turn schedules one callback for the next turn, which does every request's work one after
the other, so all but the first find the code in the caches. Each request gets its own
result (or exception) in the order the requests came, so what they compute is unchanged;
a request that is cancelled while waiting is skipped. Alone in its turn (a quiet router),
a request waits one turn and pays for a future (a few microseconds).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class TurnBatch(Generic[Item, Result]):
    """Runs ``work`` on the items submitted during one event-loop turn, in a row, in the next."""

    def __init__(self, work: Callable[[Item], Result]) -> None:
        self._work = work
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        #: Batches run and items worked on (tests, profiling).
        self.batches = 0
        self.items = 0

    async def run(self, item: Item) -> Result:
        """``work(item)``, done with the other items of this turn."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._run_pending)
        self._pending.append((item, future))
        return await future

    def _run_pending(self) -> None:
        pending, self._pending = self._pending, []
        self.batches += 1
        work = self._work
        for item, future in pending:
            if future.cancelled():
                continue
            self.items += 1
            try:
                result = work(item)
            except Exception as exc:  # the request that asked gets it, as if it had called work itself
                future.set_exception(exc)
            else:
                future.set_result(result)
