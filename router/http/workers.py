"""What one worker of ``kvroute serve --workers N`` knows of its siblings, and asks them.

The supervisor (:mod:`kvroute.router.workers`) gives every worker the same private
directory (mode 0700). Worker ``i`` serves, besides the shared TCP port, a small
*internal* application on ``DIR/worker-i.sock`` (a Unix socket: only this user can reach
it, and nothing there is exposed on the network):

* ``GET /metrics``: this worker's own exposition, unmerged;
* ``POST``/``DELETE /admin/backends``, ``POST /admin/backends/drain``: the admin write,
  applied to this worker only (the public route has already checked the admin token).

The public ``/metrics`` of whichever worker a scrape lands on fetches every sibling's
internal ``/metrics`` (each within :data:`SIBLING_TIMEOUT_S`; a sibling that does not
answer is left out and counted) and merges them
(:mod:`kvroute.router.forwarding.metrics_merge`). A public admin write is applied here,
then forwarded to every sibling.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

log = logging.getLogger("kvroute")

#: How long a scrape or an admin write waits for one sibling.
SIBLING_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class WorkerGroup:
    """Worker ``index`` of ``count``, and the private directory they share."""

    index: int
    count: int
    directory: Path

    def socket_path(self, index: int) -> Path:
        """Where worker ``index`` serves its internal application."""
        return self.directory / f"worker-{index}.sock"

    def placements_endpoint(self, index: int) -> str:
        """Where worker ``index`` publishes its placements (its ``peer_bind``)."""
        return f"unix://{self.directory / f'worker-{index}.placements'}"

    @property
    def siblings(self) -> list[int]:
        return [index for index in range(self.count) if index != self.index]


@dataclass(frozen=True, slots=True)
class SiblingAnswer:
    """One sibling's answer: its status and body, or why there is none."""

    index: int
    status: int | None
    body: bytes = b""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and self.status < 300


@dataclass(slots=True)
class Siblings:
    """HTTP over the siblings' Unix sockets (one small session each, opened in the event loop)."""

    group: WorkerGroup
    timeout_s: float = SIBLING_TIMEOUT_S
    #: Scrapes or writes a sibling did not answer in time (or refused the connection).
    failures: int = 0
    _sessions: dict[int, aiohttp.ClientSession] = field(default_factory=dict)

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()

    def _session(self, index: int) -> aiohttp.ClientSession:
        session = self._sessions.get(index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(path=str(self.group.socket_path(index)))
            session = self._sessions[index] = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        return session

    async def request(
        self, index: int, method: str, path: str, *, query: Mapping[str, str] | None = None, body: bytes = b""
    ) -> SiblingAnswer:
        """One call to sibling ``index``'s internal application."""
        headers = {"Content-Type": "application/json"} if body else None
        try:
            async with self._session(index).request(
                method, "http://worker" + path, params=query, data=body or None, headers=headers
            ) as response:
                return SiblingAnswer(index, response.status, await response.read())
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.failures += 1
            return SiblingAnswer(index, None, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    async def each(
        self, method: str, path: str, *, query: Mapping[str, str] | None = None, body: bytes = b""
    ) -> Sequence[SiblingAnswer]:
        """The same call to every sibling at once."""
        return await asyncio.gather(
            *(self.request(index, method, path, query=query, body=body) for index in self.group.siblings)
        )
