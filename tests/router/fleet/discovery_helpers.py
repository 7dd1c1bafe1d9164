"""What the discovery tests share: a recorder of ``on_change`` calls and task helpers.

Imported as ``from discovery_helpers import ...`` (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

WAIT_S = 15.0


class Changes:
    """Collects ``on_change`` calls and waits for a wanted backend set."""

    def __init__(self) -> None:
        self.calls: list[set[str]] = []
        self._event = asyncio.Event()

    async def __call__(self, urls: set[str]) -> None:
        self.calls.append(urls)
        self._event.set()

    async def until(self, wanted: set[str]) -> None:
        async def wait() -> None:
            while not self.calls or self.calls[-1] != wanted:
                self._event.clear()
                await self._event.wait()

        try:
            await asyncio.wait_for(wait(), WAIT_S)
        except TimeoutError:
            pytest.fail(f"backends never became {sorted(wanted)}; reported: {self.calls}")


async def running(source: Any, changes: Changes) -> asyncio.Task[None]:
    return asyncio.create_task(source.run(changes))


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def eventually(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")
