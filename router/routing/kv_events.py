"""KV cache events from the engines: vLLM's wire format decoded, and one subscriber per backend.

Wire format (vLLM's ``ZmqEventPublisher``; see ``../shared/notes/vllm-cpu.md``):

* PUB socket, one message per engine step, 3 frames
  ``[topic, sequence number (8 bytes, big-endian, from 0), msgpack payload]``.
* Payload ``[timestamp, [event, ...], data_parallel_rank]`` (newer vLLMs may send the same
  batch as a map ``{ts, events, data_parallel_rank}``; both are accepted).
* Events ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, either as maps with a
  ``type`` key or as positional arrays whose first element is the type name, trailing fields
  omitted. Fields vLLM adds later are ignored; unknown event types are skipped and counted;
  a malformed message is counted and skipped, never raised.
* Block hashes are integers (vLLM's default) or the raw digest as bytes
  (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); :func:`engine_hash` folds both to one int.
* Replay socket (ROUTER): a DEALER sends ``["", start_seq (8 bytes)]`` and receives
  ``["", seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
  ``["", -1 (8 bytes, signed), b""]``.

The subscriber only ever *connects* (engines bind ``tcp://*:PORT``). It keeps the stream
gap-free: a jump in sequence numbers is filled from the replay socket; a sequence that goes
back (the engine restarted) clears that backend; after a reconnect the last applied batch is
compared with the engine's replay of it, so a restart that happens to continue past our
sequence number is caught too. What it decodes goes to an :class:`EventSink` (the precise
index), together with the stream's :class:`KVEventsState`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.router.backend_url import split_rank_name
from kvroute.router.routing.zmq_inbox import Inbox

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


# --------------------------------------------------------------------------- events


class BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    """Full blocks that became cached. ``token_ids`` holds every stored block's tokens in
    order; ``parent_block_hash`` is the engine hash of the block before the first one (None
    when the first stored block starts the sequence); ``extra_keys`` has one entry per block
    (LoRA name, multimodal keys, ``cache_salt`` on block 0, in vLLM's order)."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    """Blocks evicted from the cache (one entry per physical block)."""

    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    """The engine dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


# The positional-array form: the same classes (isinstance holds), fields in vLLM's order.
class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray


def engine_hash(value: int | bytes) -> int:
    """An engine block hash as one int: bytes digests fold to their last 8 bytes, big-endian
    (the integer vLLM publishes for the same block when it sends ints)."""
    if type(value) is int:
        return value
    return int.from_bytes(value[-8:], "big")  # type: ignore[index,arg-type]


# --------------------------------------------------------------------------- decoding


class MalformedMessage(ValueError):
    """A message that is not ``[topic, 8-byte sequence, payload]`` or whose payload is not a
    batch of events. ``seq`` is set when the sequence frame itself was readable."""

    def __init__(self, reason: str, seq: int | None = None) -> None:
        super().__init__(reason)
        self.seq = seq


@dataclass(slots=True)
class EventBatch:
    """One decoded engine step."""

    seq: int
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class DecodeStats:
    """What the decoder had to skip."""

    malformed_messages: int = 0
    malformed_events: int = 0
    unknown_events: int = 0


def _payload_type(name: str, events: Any, array_like: bool) -> Any:
    """A batch struct (``ts``, ``events``, ``data_parallel_rank``) made at run time, hence ``Any``."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("ts", float),
        ("events", events),
        ("data_parallel_rank", int | None, None),
    ]
    return msgspec.defstruct(name, fields, array_like=array_like, gc=False)


def _is_array(first_byte: int) -> bool:
    """msgpack fixarray / array16 / array32 marker."""
    return 0x90 <= first_byte <= 0x9F or first_byte in (0xDC, 0xDD)


def _is_map(first_byte: int) -> bool:
    """msgpack fixmap / map16 / map32 marker."""
    return 0x80 <= first_byte <= 0x8F or first_byte in (0xDE, 0xDF)


class KVEventDecoder:
    """Decodes messages of one engine into :class:`EventBatch` objects.

    The fast path decodes a whole payload into typed structs in one msgspec call. The event
    form (map or array) the engine used last is tried first; a payload that fails both
    typed forms (an unknown event type, one bad event) is decoded event by event so the good
    events survive.
    """

    def __init__(self) -> None:
        self.stats = DecodeStats()
        self._events_as_arrays = False
        # (batch is an array, events are arrays) -> decoder
        self._typed = {
            (batch_array, events_array): msgspec.msgpack.Decoder(
                _payload_type(
                    f"_Batch{int(batch_array)}{int(events_array)}",
                    list[_ArrayEvent] if events_array else list[_MapEvent],
                    batch_array,
                )
            )
            for batch_array in (True, False)
            for events_array in (True, False)
        }
        self._raw = {
            batch_array: msgspec.msgpack.Decoder(
                _payload_type(f"_RawBatch{int(batch_array)}", list[msgspec.Raw], batch_array)
            )
            for batch_array in (True, False)
        }
        self._event: dict[bool, msgspec.msgpack.Decoder[_ArrayEvent] | msgspec.msgpack.Decoder[_MapEvent]] = {
            True: msgspec.msgpack.Decoder(_ArrayEvent),
            False: msgspec.msgpack.Decoder(_MapEvent),
        }
        self._generic = msgspec.msgpack.Decoder()

    def decode_message(self, frames: Sequence[bytes]) -> EventBatch:
        """``[topic, seq, payload]`` -> batch; raises :class:`MalformedMessage` (counted)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed_messages += 1
            raise MalformedMessage(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
        seq = int.from_bytes(frames[1], "big")
        return self.decode_payload(seq, frames[2])

    def decode_payload(self, seq: int, payload: bytes) -> EventBatch:
        """One msgpack payload -> batch; raises :class:`MalformedMessage` (counted)."""
        if not payload or not (_is_array(payload[0]) or _is_map(payload[0])):
            self.stats.malformed_messages += 1
            raise MalformedMessage("payload is not a msgpack array or map", seq)
        batch_array = _is_array(payload[0])
        for events_array in (self._events_as_arrays, not self._events_as_arrays):
            try:
                batch = self._typed[(batch_array, events_array)].decode(payload)
            except msgspec.DecodeError:
                continue
            self._events_as_arrays = events_array
            return EventBatch(seq, batch.ts, batch.events, batch.data_parallel_rank)
        return self._decode_event_by_event(seq, payload, batch_array)

    def _decode_event_by_event(self, seq: int, payload: bytes, batch_array: bool) -> EventBatch:
        try:
            batch = self._raw[batch_array].decode(payload)
        except msgspec.DecodeError as exc:
            self.stats.malformed_messages += 1
            raise MalformedMessage(f"not an event batch: {exc}", seq) from exc
        events: list[KVEvent] = []
        for raw in batch.events:
            event = self._decode_event(raw)
            if event is not None:
                events.append(event)
        return EventBatch(seq, batch.ts, events, batch.data_parallel_rank)

    def _decode_event(self, raw: msgspec.Raw) -> KVEvent | None:
        for events_array in (self._events_as_arrays, not self._events_as_arrays):
            try:
                event: KVEvent = self._event[events_array].decode(raw)
            except msgspec.DecodeError:
                continue
            self._events_as_arrays = events_array
            return event
        if self._type_name(raw) in EVENT_TYPES:
            self.stats.malformed_events += 1
        else:
            self.stats.unknown_events += 1
        return None

    def _type_name(self, raw: msgspec.Raw) -> str | None:
        try:
            value = self._generic.decode(raw)
        except msgspec.DecodeError:
            return None
        if isinstance(value, list) and value and isinstance(value[0], str):
            return value[0]
        if isinstance(value, dict) and isinstance(value.get("type"), str):
            return value["type"]
        return None


# --------------------------------------------------------------------------- state and sink


class KVEventsState(enum.IntEnum):
    """A backend's event stream, as exported by ``kvroute_kv_events_state{backend}``.

    * ``APPROXIMATE`` (0): no usable stream (not configured, not connected yet, disconnected,
      or silent while requests were sent there); the approximate index answers for it.
    * ``PRECISE`` (1): gap-free since the engine's first batch, or since it last emptied its
      cache (``AllBlocksCleared``, e.g. ``POST /reset_prefix_cache``); the events answer.
    * ``RECOVERING`` (2): fetching batches missed in a gap from the replay socket; the
      events keep answering (they are right up to the gap).
    * ``PARTIAL`` (3): gap-free from now on, but part of the engine's history could not be
      replayed (the router joined late, or a gap outran the replay buffer): blocks seen in
      events answer exactly, and the approximate index fills in for older blocks, until
      the engine empties its cache.
    """

    APPROXIMATE = 0
    PRECISE = 1
    RECOVERING = 2
    PARTIAL = 3


class EventSink(Protocol):
    """Where a subscriber delivers a backend's events (``kvroute.router.routing.precise_index.PreciseIndex``)."""

    def apply_events(self, backend: str, events: Sequence[KVEvent]) -> None:
        """Apply one batch's events in order (the sink may defer work until :meth:`flush`)."""

    def flush(self) -> None:
        """Make everything applied so far visible (called when the stream runs dry)."""

    def clear_backend(self, backend: str) -> None:
        """Forget everything known about the backend's cache (engine restart, lost history)."""

    def set_state(self, backend: str, state: KVEventsState) -> None:
        """The backend's stream changed state."""


@dataclass(slots=True)
class SubscriberStats:
    """Counters of one backend's stream."""

    messages: int = 0
    events: int = 0
    gaps: int = 0
    replayed_messages: int = 0
    unrecoverable_gaps: int = 0
    restarts: int = 0
    disconnects: int = 0
    replay_failures: int = 0
    apply_errors: int = 0
    #: Batches from another data-parallel rank than the backend's (a misconfigured endpoint).
    other_rank_batches: int = 0


class ReplayFailed(RuntimeError):
    """The replay socket did not answer in time."""


# --------------------------------------------------------------------------- subscriber


class KVEventSubscriber:
    """One backend's event stream: SUB socket, gap detection, replay, restart detection.

    ``run()`` is a coroutine that runs until cancelled. Messages are handled one at a time
    in arrival order; while a gap is being filled from the replay socket, newer messages
    wait in the SUB socket's queue, so batches are always applied in sequence order. Long
    bursts yield to the event loop every ``yield_every_s`` of work.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        sink: EventSink,
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        context: zmq.asyncio.Context | None = None,
        silence_s: float = 30.0,
        replay_timeout_s: float = 5.0,
        yield_every_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        #: The data-parallel rank the backend is (its batches must say so), or None.
        self.rank = split_rank_name(backend)[1]
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.stats = SubscriberStats()
        self.decoder = KVEventDecoder()
        self._sink = sink
        self._ctx = context or zmq.asyncio.Context.instance()
        self._silence_s = silence_s
        self._replay_timeout_s = replay_timeout_s
        self._yield_every_s = yield_every_s
        self._clock = clock
        self._state = KVEventsState.APPROXIMATE
        self._expected: int | None = None  # next sequence number; None before the first
        self._last_payload: bytes | None = None  # of batch expected - 1, to recognise the engine
        self._complete = True  # every batch since the engine's first has been applied
        self._verify_engine = False  # set on reconnect: is it still the same engine?
        self._ever_connected = False
        self._awaiting_since: float | None = None  # first routing since the last message
        self._last_yield = clock()
        self._inbox: Inbox | None = None  # while run() reads the socket
        self._handling = False  # run() is inside handle_message (it may await a replay)

    # -- state -----------------------------------------------------------------------

    @property
    def state(self) -> KVEventsState:
        """The stream's current state."""
        return self._state

    @property
    def expected_seq(self) -> int | None:
        """The sequence number the next batch should carry (None before the first)."""
        return self._expected

    def note_routed(self, now: float | None = None) -> None:
        """A request was just sent to this backend: its events should follow soon."""
        if self._awaiting_since is None:
            self._awaiting_since = self._clock() if now is None else now

    def check_silence(self, now: float | None = None) -> None:
        """Fall back to the approximate index when requests went to the backend but no
        event came for ``silence_s``. An idle engine is not silent: its cache is unchanged."""
        if self._awaiting_since is None or self._state not in (
            KVEventsState.PRECISE,
            KVEventsState.PARTIAL,
        ):
            return
        if (self._clock() if now is None else now) - self._awaiting_since > self._silence_s:
            log.warning("kv events of %s silent for %.0f s: approximate index", self.backend, self._silence_s)
            self._set_state(KVEventsState.APPROXIMATE)

    def _set_state(self, state: KVEventsState) -> None:
        if state is not self._state:
            self._state = state
            self._sink.set_state(self.backend, state)

    # -- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, then handle messages until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # vLLM's PUB buffers up to 100k batches; match it so a replay does not overflow us.
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        watcher = asyncio.get_running_loop().create_task(self._watch_connection(monitor))
        sub.connect(self.endpoint)
        inbox = self._inbox = Inbox(sub)
        try:
            while True:
                frames = await inbox.next()
                self._handling = True
                try:
                    await self.handle_message(frames)
                finally:
                    self._handling = False
                if not inbox.pending():
                    self._sink.flush()  # a burst is over: write it to the index in one go
                await self._maybe_yield()
        finally:
            self._inbox = None
            inbox.close()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._set_state(KVEventsState.APPROXIMATE)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self._verify_engine = self._ever_connected and self._expected is not None
                self._ever_connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
                self._set_state(KVEventsState.APPROXIMATE)

    async def _maybe_yield(self) -> None:
        now = self._clock()
        if now - self._last_yield >= self._yield_every_s:
            await asyncio.sleep(0)
            self._last_yield = self._clock()

    def drain(self) -> None:
        """Apply now the batches already waiting in the socket, in sequence (a request is
        being routed: an engine's answer can reach the next turn's client before the event
        loop has read the events the engine published first). A message that needs more
        (a gap, the first one, an engine check) goes back to :meth:`run`."""
        inbox = self._inbox
        if inbox is None or self._handling or not inbox.signalled():
            return
        while (frames := inbox.take()) is not None:
            if not self._apply_in_sequence(frames):
                inbox.put_back(frames)
                return

    def _apply_in_sequence(self, frames: Sequence[bytes]) -> bool:
        """Apply a well-formed message that is the next in sequence when no engine check is
        due; False (nothing done) for anything else, which :meth:`handle_message` sorts out."""
        if len(frames) != 3 or len(frames[1]) != 8 or self._verify_engine:
            return False
        seq = int.from_bytes(frames[1], "big")
        if seq != self._expected:
            return False
        self._awaiting_since = None
        self._apply(seq, bytes(frames[2]))
        self._set_state(KVEventsState.PRECISE if self._complete else KVEventsState.PARTIAL)
        return True

    async def handle_message(self, frames: Sequence[bytes]) -> None:
        """One message from the SUB socket: check its sequence number, fill any gap, apply."""
        if self._apply_in_sequence(frames):
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self.decoder.stats.malformed_messages += 1
            return
        seq = int.from_bytes(frames[1], "big")
        payload = bytes(frames[2])
        self._awaiting_since = None
        if self._verify_engine:
            self._verify_engine = False
            if not await self._same_engine():
                self._engine_restarted()
        if self._expected is not None and seq < self._expected:
            self._engine_restarted()
        if self._expected is None:
            await self._catch_up(0, seq)
        elif seq > self._expected:
            self.stats.gaps += 1
            await self._catch_up(self._expected, seq)
        self._apply(seq, payload)
        self._set_state(KVEventsState.PRECISE if self._complete else KVEventsState.PARTIAL)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        self._last_payload = payload
        self.stats.messages += 1
        try:
            batch = self.decoder.decode_payload(seq, payload)
        except MalformedMessage as exc:
            log.warning("kv events of %s: skipping batch %d: %s", self.backend, seq, exc)
            return
        if self.rank is not None and batch.data_parallel_rank not in (None, self.rank):
            # Another rank's cache: applying it would make this rank's index wrong.
            if not self.stats.other_rank_batches:
                log.warning(
                    "kv events of %s: batches come from data-parallel rank %d: this endpoint (%s) "
                    "is not rank %d's; not applied, the index is partial",
                    self.backend,
                    batch.data_parallel_rank,
                    self.endpoint,
                    self.rank,
                )
            self.stats.other_rank_batches += 1
            self._complete = False
            return
        self.stats.events += len(batch.events)
        try:
            self._sink.apply_events(self.backend, batch.events)
        except Exception:
            # Never let one bad batch stop the stream; what it held is unknown now.
            log.exception("kv events of %s: cannot apply batch %d", self.backend, seq)
            self.stats.apply_errors += 1
            self._sink.clear_backend(self.backend)
            self._complete = False
            return
        if not self._complete and any(isinstance(event, AllBlocksCleared) for event in batch.events):
            # The engine holds nothing from before this batch, and every batch since is
            # applied: the history this stream missed no longer matters.
            log.info("kv events of %s: the engine emptied its cache, the index is complete", self.backend)
            self._complete = True

    def _engine_restarted(self) -> None:
        log.info("kv events of %s: engine restarted, clearing its blocks", self.backend)
        self.stats.restarts += 1
        self._sink.clear_backend(self.backend)
        self._expected = None
        self._last_payload = None
        self._complete = True

    async def _same_engine(self) -> bool:
        """After a reconnect: does the engine still hold our last batch under its number?"""
        if self.replay_endpoint is None or self._expected is None or self._expected == 0:
            return True
        try:
            replayed = await self._request_replay(self._expected - 1)
        except ReplayFailed:
            return True  # cannot tell; the sequence check still catches most restarts
        return bool(replayed) and replayed[0] == (self._expected - 1, self._last_payload)

    async def _catch_up(self, start: int, end: int) -> None:
        """Apply batches ``start .. end-1`` from the replay socket, before batch ``end``.

        When they cannot all be had, whatever was applied may miss removals, so the backend
        is cleared and rebuilt from the longest run of batches that ends just before ``end``;
        the stream is then ``PARTIAL``. Joining late (``start == 0``) needs no clearing.
        """
        if end <= start:
            return
        replayed: list[tuple[int, bytes]] = []
        if self.replay_endpoint is not None:
            if self._state is not KVEventsState.APPROXIMATE:
                # Filling a gap: the index is right up to it. (While a joining router
                # replays history it stays APPROXIMATE: its index is still being built.)
                self._set_state(KVEventsState.RECOVERING)
            try:
                replayed = [item for item in await self._request_replay(start) if start <= item[0] < end]
            except ReplayFailed:
                self.stats.replay_failures += 1
        run_start = end
        for seq, _ in reversed(replayed):
            if seq != run_start - 1:
                break
            run_start = seq
        if run_start != start:
            log.warning(
                "kv events of %s: batches %d..%d lost (replayed from %d)",
                self.backend,
                start,
                end - 1,
                run_start,
            )
            self._complete = False
            if start > 0:
                self.stats.unrecoverable_gaps += 1
                self._sink.clear_backend(self.backend)
        for seq, payload in replayed:
            if seq >= run_start:
                self.stats.replayed_messages += 1
                self._apply(seq, payload)
                await self._maybe_yield()

    async def _request_replay(self, start: int) -> list[tuple[int, bytes]]:
        """Every buffered batch with ``seq >= start``, in order, from the replay socket."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        replayed: list[tuple[int, bytes]] = []
        try:
            try:
                await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), self._replay_timeout_s)
            except TimeoutError as exc:
                raise ReplayFailed(f"cannot reach {self.replay_endpoint}") from exc
            while True:
                try:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), self._replay_timeout_s)
                except TimeoutError as exc:
                    raise ReplayFailed(f"no replay from {self.replay_endpoint}") from exc
                # ["", seq, payload] as documented, or ["", topic, seq, payload] as vLLM 0.32
                # sends it (its end marker is ["", "", -1, ""]).
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    self.decoder.stats.malformed_messages += 1
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return replayed
                replayed.append((seq, bytes(frames[-1])))
        finally:
            dealer.close(linger=0)
