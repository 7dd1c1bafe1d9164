"""``kvroute serve --workers N``: a supervisor and N router processes on one port.

Each worker is a whole router (:func:`kvroute.router.serve.run_router`): it parses,
renders, tokenizes and routes on its own core, listening on the same host and port with
``SO_REUSEPORT``, so the kernel spreads new connections over the workers. What they share:

* **placements**: worker ``i`` publishes every placement on
  ``unix://DIR/worker-i.placements`` and subscribes to every sibling's (the peer exchange
  of several router replicas, :mod:`kvroute.router.routing.peer_exchange`, over Unix
  stream sockets: :mod:`kvroute.router.routing.unix_links`), plus the
  external ``--peers`` (or ``--peers-dns``) if any; with ``--peer-bind`` the supervisor
  binds it and relays every worker's messages there
  (:mod:`kvroute.router.routing.peer_relay`), so other routers hear this one as one; the
  exchange also carries each worker's load reports and eviction evidence, as between
  routers;
* **metrics and admin writes**: over each worker's Unix socket ``DIR/worker-i.sock``
  (:mod:`kvroute.router.http.workers`).

What each keeps to itself: its health probes, breaker and engine scrapes, the capacity
scale its model learns, ``/admin/decisions`` and ``/admin/backends``.

The workers are new interpreters (``sys.executable -m kvroute.router.workers``), not
forks: the supervisor has imported pydantic and aiohttp, and a router holds numba's
compiled kernels, ZMQ contexts and threads, none of which survive a fork safely; a fresh
interpreter costs a second or two once. The supervisor hands each worker its settings as
one JSON line on its stdin (no secrets on command lines or in the environment) and keeps
that pipe open: when the supervisor dies, even by SIGKILL, the worker reads end-of-file
and drains itself. The worker answers ``ready`` on its stdout once it listens; the
supervisor logs ``kvroute listening on ...`` only when every worker has.

Signals: SIGTERM or SIGINT to the supervisor is forwarded (as SIGTERM) to every worker,
each drains its in-flight requests (``drain_timeout_s``), and the supervisor exits when
all have, 0 if every worker exited 0. A worker that fails to start stops the others and
``kvroute serve`` exits non-zero (the worker's own message is on stderr). A worker that
dies later is restarted, at most :data:`MAX_RESTARTS` times per :data:`RESTART_WINDOW_S`;
past that the supervisor stops the rest and exits 1.

Workers share the supervisor's process group (tools that account a router's CPU by its
process group see all of it); a terminal's Ctrl-C reaches them too, which they ignore
until they serve, and then treat as the supervisor's forwarded SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvroute.router.config import Settings
from kvroute.router.http.workers import WorkerGroup
from kvroute.router.routing.peer_relay import PeerRelay

log = logging.getLogger("kvroute")

#: Restarts of crashed workers allowed within :data:`RESTART_WINDOW_S` before giving up.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: How long a worker may take to build its router and listen.
START_TIMEOUT_S = 120.0
#: Beyond ``drain_timeout_s``, how long a stopping worker may take before it is killed.
STOP_GRACE_S = 10.0
READY = b"ready\n"


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` workers until SIGTERM/SIGINT; the exit status of ``kvroute serve``."""
    directory = Path(tempfile.mkdtemp(prefix="kvroute-workers-"))  # mode 0700: only this user
    try:
        try:
            reservation = reserve_port(settings.host, settings.port)
        except OSError as exc:
            print(f"kvroute serve: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
            return 2
        with reservation:
            port = reservation.getsockname()[1]
            return asyncio.run(Supervisor(settings, port, directory).run())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to ``host:port`` with SO_REUSEPORT, holding the port for the workers.

    First a plain bind, which fails when anything else listens there, even another
    ``SO_REUSEPORT`` group of this user (which the workers would otherwise silently join),
    and picks the port when ``port`` is 0. A bound socket that does not listen gets no
    connections: the kernel spreads them over the workers' listening sockets only.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers do
        probe.bind(address)
        chosen = probe.getsockname()[1]
    reservation = socket.socket(family, kind, proto)
    try:
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reservation.bind((address[0], chosen, *address[2:]))
    except OSError:
        reservation.close()
        raise
    return reservation


def worker_settings(settings: Settings, group: WorkerGroup, port: int) -> Settings:
    """What worker ``group.index`` runs with: the chosen port, its own placement endpoint,
    its siblings' and the configured peers."""
    siblings = [group.placements_endpoint(index) for index in group.siblings]
    return settings.model_copy(
        update={
            "port": port,
            "workers": 1,  # this process is one worker; the group says how many there are
            "peer_bind": group.placements_endpoint(group.index),
            "peers": [*siblings, *settings.peers],
        }
    )


@dataclass(slots=True)
class _Worker:
    index: int
    process: asyncio.subprocess.Process


class WorkerFailed(Exception):
    """A worker exited before it listened."""

    def __init__(self, index: int, code: int | None) -> None:
        super().__init__(f"worker {index} exited with status {code} before listening (its message is above)")
        self.index = index
        self.code = code


class Supervisor:
    """Starts the workers, forwards signals, restarts crashed workers, reports their status."""

    def __init__(self, settings: Settings, port: int, directory: Path) -> None:
        self.settings = settings
        self.port = port
        self.directory = directory
        self.count = settings.workers
        self.workers: dict[int, _Worker] = {}
        self._restarts: deque[float] = deque()
        self._stop = asyncio.Event()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        relay = self._peer_relay()
        if relay is not None:
            try:
                relay.start()  # before the workers: a bad --peer-bind fails at once
            except zmq.ZMQError as exc:
                log.error("peer_bind %s: %s", self.settings.peer_bind, exc)
                return 2
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        try:
            try:
                await self._until_stopped(asyncio.gather(*(self._start(index) for index in range(self.count))))
            except WorkerFailed as failed:
                log.error("%s", failed)
                await self._stop_all()
                return failed.code if failed.code and failed.code > 0 else 1  # not a signal's negative code
            if self._stop.is_set():
                return await self._stop_all()
            log.info("workers' private directory (Unix sockets, placement endpoints): %s", self.directory)
            log.info(
                "kvroute listening on http://%s:%d (policy %s, %d workers, pids %s)",
                self.settings.host,
                self.port,
                self.settings.policy,
                self.count,
                " ".join(str(worker.process.pid) for worker in self.workers.values()),
            )
            return await self._supervise()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            if relay is not None:
                relay.stop()

    def _peer_relay(self) -> PeerRelay | None:
        """With ``--peer-bind``: the relay of every worker's placements and load reports."""
        settings = self.settings
        if settings.peer_bind is None:
            return None
        group = WorkerGroup(0, self.count, self.directory)
        sources = [group.placements_endpoint(index) for index in range(self.count)]
        return PeerRelay(settings.peer_bind, sources, settings.peer_key(), settings.peer_accepted_key())

    async def _until_stopped(self, work: asyncio.Future[Any]) -> None:
        """Wait for ``work`` unless a stop signal comes first (then leave it cancelled)."""
        stopping: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if work in done:
            work.result()  # raises WorkerFailed
        else:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, WorkerFailed):
                await work

    async def _start(self, index: int) -> None:
        """Start worker ``index`` and wait until it listens; WorkerFailed if it exits first."""
        group = WorkerGroup(index, self.count, self.directory)
        spec = {
            "settings": worker_settings(self.settings, group, self.port).model_dump(mode="json"),
            "index": index,
            "count": self.count,
            "directory": str(self.directory),
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvroute.router.workers",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self.workers[index] = _Worker(index, process)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(spec).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await process.stdin.drain()
        try:
            line = await asyncio.wait_for(process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            line = b""
        if line != READY:
            code = await process.wait()
            raise WorkerFailed(index, code)

    async def _supervise(self) -> int:
        """Until a stop signal: restart workers that die (within the budget)."""
        while True:
            exits: dict[asyncio.Future[Any], _Worker] = {
                asyncio.ensure_future(worker.process.wait()): worker for worker in self.workers.values()
            }
            stopping: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
            done, _ = await asyncio.wait({*exits, stopping}, return_when=asyncio.FIRST_COMPLETED)
            for future in (*exits, stopping):
                if future not in done:
                    future.cancel()
            if stopping in done:
                return await self._stop_all()
            for future in done:
                worker = exits[future]
                code = future.result()
                log.error(
                    "worker %d (pid %d) exited unexpectedly with status %s", worker.index, worker.process.pid, code
                )
                if not self._may_restart():
                    log.error("workers restarted %d times in %.0f s: giving up", MAX_RESTARTS, RESTART_WINDOW_S)
                    await self._stop_all()
                    return 1
                try:
                    await self._until_stopped(asyncio.ensure_future(self._start(worker.index)))
                except WorkerFailed as failed:
                    log.error("%s", failed)
                    await self._stop_all()
                    return 1
                if not self._stop.is_set():
                    log.info("worker %d restarted (pid %d)", worker.index, self.workers[worker.index].process.pid)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= MAX_RESTARTS:
            return False
        self._restarts.append(now)
        return True

    async def _stop_all(self) -> int:
        """SIGTERM every live worker, wait for their drain; 0 if every one exited 0."""
        live = [worker for worker in self.workers.values() if worker.process.returncode is None]
        if live:
            log.info("stopping %d workers: draining for up to %.1f s", len(live), self.settings.drain_timeout_s)
        for worker in live:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
        deadline = self.settings.drain_timeout_s + STOP_GRACE_S
        status = 0
        for worker in live:
            try:
                code = await asyncio.wait_for(worker.process.wait(), max(0.1, deadline))
            except TimeoutError:
                log.error("worker %d did not stop in time: killed", worker.index)
                worker.process.kill()
                code = await worker.process.wait()
            if code != 0:
                log.error("worker %d exited with status %d", worker.index, code)
                status = 1
        log.info("kvroute stopped")
        return status


def worker_main() -> int:
    """One worker: settings from the supervisor's line on stdin, ``ready`` on stdout once it listens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C: the supervisor forwards it
    line = sys.stdin.buffer.readline()
    if not line:
        print("kvroute.router.workers: started by kvroute serve --workers only", file=sys.stderr)
        return 2
    spec = json.loads(line)
    settings = Settings.model_validate(spec["settings"])
    group = WorkerGroup(spec["index"], spec["count"], Path(spec["directory"]))

    from kvroute.router.serve import run_router

    return run_router(settings, workers=group, on_listening=_announce_ready)


def _announce_ready() -> None:
    """Tell the supervisor this worker listens, and drain when the supervisor goes away."""
    os.write(sys.stdout.fileno(), READY)
    loop = asyncio.get_running_loop()

    def supervisor_gone() -> None:
        try:
            data = os.read(0, 4096)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                return
            data = b""
        if not data:
            loop.remove_reader(0)
            log.warning("the supervisor is gone: stopping")
            os.kill(os.getpid(), signal.SIGTERM)

    loop.add_reader(0, supervisor_gone)


if __name__ == "__main__":
    sys.exit(worker_main())
