"""A recording of the fleet's KV-event streams, to explain a precise router's missed prediction.

A precise router's prediction can miss for reasons no assertion shows: the engine published
the blocks after the router routed (and its speculative hold had lapsed), the router applied
the events differently from the engine, or the engine kept blocks it announced as removed.
:class:`EventCapture` subscribes to every stream of the fleet alongside the routers and
keeps each message with the time it arrived; :func:`explain_misses` replays them into a
fresh :class:`~kvroute.router.routing.precise_index.PreciseIndex` up to the moments that
matter and says, for each missed request, what the events alone had announced by then.
The router's own records of the conversation (``/admin/decisions``) come with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

import httpx
import zmq

from kvroute.benchmarks.workloads import WorkloadRequest
from kvroute.router.backend_url import offset_endpoint_port, rank_names
from kvroute.router.config import Settings
from kvroute.router.routing.kv_events import BlockRemoved, BlockStored, KVEventDecoder, KVEventsState
from kvroute.router.routing.precise_index import PreciseIndex
from kvroute.router.routing.routing_engine import RoutingEngine
from tests.e2e.fleet import BLOCK_SIZE, Result, RouterProcess, RunSummary, VllmFleet

TOPIC = "kv-events"
#: Longer than any run: the replay answers what the events announced, not what expired.
NO_EXPIRY_S = 1e9


@dataclass(frozen=True)
class Received:
    """One message of one backend's stream and when it arrived (``time.monotonic()``)."""

    at: float
    backend: str
    frames: tuple[bytes, ...]


class EventCapture:
    """Every message of every backend's stream (each data-parallel rank its own), recorded by
    a thread from ``__enter__`` to ``__exit__``. Enter it before the caches are reset, so
    that it holds each stream from an ``AllBlocksCleared`` on."""

    def __init__(self, fleet: VllmFleet) -> None:
        self._endpoints = {
            name: offset_endpoint_port(replica.events_endpoint, rank)
            for replica in fleet.replicas
            for rank, name in enumerate(rank_names(replica.url, fleet.data_parallel_size))
        }
        self._received: list[Received] = []
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._record, name="kv-event capture", daemon=True)
        self._context = zmq.Context()

    def __enter__(self) -> EventCapture:
        self._thread.start()
        self._connected.wait(timeout=10)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._context.term()

    def _record(self) -> None:
        sockets: dict[zmq.Socket[bytes], str] = {}
        poller = zmq.Poller()
        for backend, endpoint in self._endpoints.items():
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
            socket.connect(endpoint)
            poller.register(socket, zmq.POLLIN)
            sockets[socket] = backend
        self._connected.set()
        try:
            while not self._stop.is_set():
                for socket, _ in poller.poll(50):
                    frames = socket.recv_multipart()
                    self._received.append(Received(time.monotonic(), sockets[socket], tuple(frames)))
        finally:
            for socket in sockets:
                socket.close()

    def messages(self, backend: str, until: float | None = None) -> list[Received]:
        """The backend's messages in arrival order, up to ``until`` if given."""
        return [
            message
            for message in list(self._received)
            if message.backend == backend and (until is None or message.at <= until)
        ]

    def replay(self, until: float | None = None) -> PreciseIndex:
        """An index of what every stream announced by ``until`` (all of it without)."""
        index = PreciseIndex(speculative_ttl_s=NO_EXPIRY_S)
        for backend in self._endpoints:
            index.add_backend(backend)
            index.set_state(backend, KVEventsState.PRECISE)
            decoder = KVEventDecoder()
            for message in self.messages(backend, until):
                index.apply_events(backend, decoder.decode_message(message.frames).events)
        index.flush()
        return index

    def counts(self, backend: str, since: float, until: float) -> tuple[int, int]:
        """Blocks the backend announced as stored and as removed between the two times."""
        stored = removed = 0
        decoder = KVEventDecoder()
        for message in self.messages(backend):
            events = decoder.decode_message(message.frames).events
            if not since <= message.at <= until:
                continue
            stored += sum(len(event.block_hashes) for event in events if isinstance(event, BlockStored))
            removed += sum(len(event.block_hashes) for event in events if isinstance(event, BlockRemoved))
        return stored, removed


def explain_misses(
    run: RunSummary,
    workload: Sequence[WorkloadRequest],
    capture: EventCapture,
    router: RouterProcess,
    admin_token: str,
) -> str:
    """For each request predicted wrong: when its conversation's turns were sent and
    answered, what the events alone had announced on its backend when it was sent and by
    the end of the run, what the stream stored and removed since the turn before, and the
    router's decision records of the conversation."""
    bodies = {(request.session_id or "", request.turn): request.body for request in workload}
    by_turn = {(result.session, result.turn): result for result in run.results}
    decisions = httpx.get(
        router.url + "/admin/decisions",
        params={"last": 1024},
        headers={"Authorization": f"Bearer {admin_token}"},
        timeout=10,
    ).json()["decisions"]
    at_end = capture.replay()
    start = min(result.sent_s for result in run.results)
    lines = []
    for result in run.results:
        if result.predicted_tokens == result.cached_tokens:
            continue
        before = by_turn.get((result.session, result.turn - 1))
        since = before.sent_s if before is not None else result.sent_s
        announced = _matched(capture.replay(until=result.sent_s), bodies[(result.session, result.turn)])
        stored, removed = capture.counts(result.backend, since, result.answered_s)
        lines.append(
            f"{result.session} turn {result.turn} on {result.backend}: predicted {result.predicted_tokens}, "
            f"vLLM {result.cached_tokens}; events announced {announced} when it was sent, "
            f"{_matched(at_end, bodies[(result.session, result.turn)])} by the end; "
            f"{stored} blocks stored and {removed} removed there since the turn before was sent"
        )
        for turn in _turns(run.results, result.session):
            lines.append(
                f"  turn {turn.turn} on {turn.backend}: sent {turn.sent_s - start:.3f} s, answered "
                f"{turn.answered_s - start:.3f} s, predicted {turn.predicted_tokens}, vLLM {turn.cached_tokens}"
            )
        session_key = result.session
        lines.extend(f"  decision {record}" for record in decisions if record.get("session_key") == session_key)
    return "\n".join(lines)


def _turns(results: Sequence[Result], session: str) -> list[Result]:
    return sorted((result for result in results if result.session == session), key=lambda result: result.turn)


def _matched(index: PreciseIndex, body: dict[str, object]) -> dict[str, int]:
    """Prompt tokens of ``body`` each backend holds by ``index`` (the router's tokenization)."""
    routing = RoutingEngine(Settings(block_size=BLOCK_SIZE), precise=index)
    prepared = routing.prepare("/v1/chat/completions", body)
    assert prepared is not None and prepared.precise is not None
    return index.match(prepared.precise, {})
