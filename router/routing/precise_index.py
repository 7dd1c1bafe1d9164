"""Precise mode: the prefix index kept exact from the engines' own KV events.

Every router replica subscribes to every engine's event stream (``kvroute.router.routing.kv_events``) and
applies the same events in the same order, so all replicas hold the same index without
talking to each other.

Layers, per backend:

* **exact** — the blocks the engine announced (``BlockStored``) and has not evicted
  (``BlockRemoved``, ``AllBlocksCleared``). The tokens a ``BlockStored`` carries are hashed
  with the router's own chained hash (``kvroute.tokenizer_index.hashing``), continuing from the
  parent block's router hash, so a request hashed by the router finds them; vLLM's own
  hash is never reproduced. A per-backend map *engine hash -> router hash* resolves parent
  links and removals. The engine may hold several physical copies of one block hash and
  announces each store and each eviction, so copies are counted.
* **speculative** — right after a routing decision the request's blocks are inserted for
  the chosen backend with a short TTL (``speculative_ttl_s``), so a burst of siblings
  co-locates before the engine's events arrive, and again when the engine answers unless
  the events confirmed them already (they can come after the answer). The engine's
  ``BlockStored`` then confirms them in the exact layer; a ``BlockRemoved`` drops them
  from both; the rest expire.
* **approximate** — the routing engine's own index, passed in to :meth:`PreciseIndex.match`,
  answers for a backend whose stream is not usable (see ``KVEventsState``), and fills in
  for blocks older than the history a late-joining router could replay (``PARTIAL``).

Salt: the engine announces what besides the tokens keys a block: ``lora_name`` and, in the
first block's ``extra_keys`` (vLLM order: LoRA name, multimodal keys, ``cache_salt``,
prompt-embedding digests), the request's ``cache_salt``. :func:`precise_salt` turns those two
into the salt of the first block; the router side passes the request's model (a LoRA
adapter when the engines announced it as one) and ``cache_salt`` to :meth:`prepare`. Blocks
keyed by multimodal inputs or prompt embeddings can never equal a router-side hash, so they
are tracked (for removals) but not indexed; nor are blocks whose parent the router never saw.

Block size: the engine's, from its ``BlockStored`` events; each backend is indexed under
its own block size (normally one for the fleet), and :meth:`prepare` hashes a request once
per block size in use. ``engine_block_size`` exposes it for the routing engine.

Memory: the index layers cost what ``PrefixIndex`` documents per backend-block; the engine
hash map is a Python dict, about 100 bytes per engine block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import numpy as np
import zmq.asyncio

from kvroute.router.backend_url import endpoint_with_port, split_rank_name
from kvroute.router.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventsState,
    KVEventSubscriber,
    engine_hash,
)
from kvroute.router.routing.sliced_insert import PendingInsert, insert_blocks
from kvroute.tokenizer_index import PrefixIndex
from kvroute.tokenizer_index.hashing import block_hashes, chain_hash

if TYPE_CHECKING:
    from kvroute.router.config import Settings

log = logging.getLogger(__name__)

#: Media whose blocks a request can hit; "CPU"/disk tiers of offloading connectors are not.
INDEXED_MEDIA = frozenset({None, "GPU", "gpu"})
#: Answers per backend whose confirming event is awaited (to time it), the oldest dropped
#: beyond: the events of some prompts never come (blocks after an image).
AWAITED_ANSWERS = 1024


def precise_salt(lora_name: str | None, cache_salt: str | None) -> str | None:
    """The salt of a sequence's first block: LoRA adapter and ``cache_salt``, as the engine
    keys them (an empty ``cache_salt`` is no salt, as in vLLM). None when unsalted, so plain
    requests hash exactly as ``block_hashes(tokens, block_size)``."""
    if not lora_name and not cache_salt:
        return None
    return f"lora={lora_name or ''}\x1fcache_salt={cache_salt or ''}"


def _first_block_cache_salt(event: BlockStored) -> str | None:
    """``cache_salt`` from the first block's extra keys: the first string after the LoRA name
    (multimodal keys are arrays, prompt-embedding keys bytes)."""
    if not event.extra_keys or not event.extra_keys[0]:
        return None
    keys = list(event.extra_keys[0])
    if event.lora_name is not None and keys and keys[0] == event.lora_name:
        keys = keys[1:]
    return next((key for key in keys if isinstance(key, str)), None)


def _blocks_are_plain(event: BlockStored) -> bool:
    """True unless a block is keyed by something a router-side hash cannot contain
    (multimodal features, prompt embeddings: anything in ``extra_keys`` but strings)."""
    if not event.extra_keys:
        return True
    return all(keys is None or all(isinstance(key, str) for key in keys) for keys in event.extra_keys)


def events_endpoint_for(backend_url: str, port: int) -> str:
    """``tcp://HOST:PORT`` on the backend's host (IPv6 hosts bracketed)."""
    host = urlsplit(backend_url).hostname or "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass(slots=True)
class PreciseHashes:
    """A request's prompt hashed for the precise index: once per block size it uses."""

    tokens: Sequence[int] | np.ndarray
    salt: str | None
    hashes: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass(slots=True)
class _Backend:
    """One backend's engine blocks and stream state."""

    block_size: int | None = None
    # engine hash -> router hash; None: held by the engine but not matchable by requests.
    router_hash: dict[int, int | None] = field(default_factory=dict)
    copies: dict[int, int] = field(default_factory=dict)  # engine hash -> copies beyond one
    # Index changes not yet written to the index layers (see PreciseIndex.flush).
    pending_insert: dict[int, None] = field(default_factory=dict)  # ordered set
    pending_remove: set[int] = field(default_factory=set)
    state: KVEventsState = KVEventsState.APPROXIMATE
    complete: bool = True  # False: history before the stream unknown (PARTIAL)
    unmatchable_stores: int = 0
    ignored_events: int = 0
    answers_before_events: int = 0  # answers whose blocks the events had not all confirmed
    # Such an answer's last block (router hash) -> when it came, until an event stores it.
    awaited: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PreciseStats:
    """What the precise index holds, per backend."""

    blocks: dict[str, int]
    engine_blocks: dict[str, int]
    speculative_blocks: dict[str, int]
    states: dict[str, KVEventsState]
    block_sizes: dict[str, int | None]
    #: Engine answers that came before the events of all their prompt's blocks.
    answers_before_events: dict[str, int]


class PreciseIndex:
    """The index built from KV events, plus the speculative layer; see the module docstring.

    Routing engine side (synchronous, per request)::

        prepared = precise.prepare(tokens, model=model, cache_salt=cache_salt)
        matched = precise.match(prepared, approximate_matches)   # backend -> tokens
        ...choose...
        precise.speculate(chosen_backend, prepared)

    Proxy side: ``add_backend`` / ``remove_backend`` as backends come and go,
    ``await start()`` / ``await stop()`` with the app, ``on_state`` to export
    ``kvroute_kv_events_state{backend}``, ``on_event_lag`` to export how long after an
    answer the event that confirms its prompt's last block came (answers that came first).
    """

    def __init__(
        self,
        *,
        speculative_ttl_s: float = 2.0,
        topic: str = "kv-events",
        silence_s: float = 30.0,
        events_port: int | None = None,
        replay_port: int | None = None,
        on_state: Callable[[str, KVEventsState], None] | None = None,
        on_event_lag: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._speculative_ttl_s = speculative_ttl_s
        self._on_event_lag = on_event_lag
        self._topic = topic
        self._silence_s = silence_s
        self._events_port = events_port
        self._replay_port = replay_port
        self._on_state = on_state
        self._clock = clock
        self._backends: dict[str, _Backend] = {}
        self._exact: dict[int, PrefixIndex] = {}  # block size -> confirmed blocks
        self._speculative: dict[int, PrefixIndex] = {}  # block size -> routed, unconfirmed
        self._lora_names: set[str] = set()
        self._dirty: set[str] = set()  # backends with pending index changes
        self._engine_block_size: int | None = None
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self._configured: dict[str, tuple[str | None, str | None]] = {}  # url -> endpoints
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        # One context (one I/O thread) for all subscribers; terminated by stop().
        self._context = zmq.asyncio.Context()
        self._running = False

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        on_state: Callable[[str, KVEventsState], None] | None = None,
        on_event_lag: Callable[[str, float], None] | None = None,
    ) -> PreciseIndex:
        """A precise index subscribed to every configured backend that has an endpoint."""
        index = cls(
            speculative_ttl_s=settings.speculative_ttl_s,
            topic=settings.kv_events_topic,
            silence_s=settings.kv_events_silence_s,
            events_port=settings.kv_events_port,
            replay_port=settings.kv_events_replay_port,
            on_state=on_state,
            on_event_lag=on_event_lag,
        )
        for backend in settings.backend_ranks():
            index.configure_backend(backend.name, backend.kv_events_endpoint, backend.kv_events_replay_endpoint)
            index.add_backend(backend.name)
        return index

    # -- properties ------------------------------------------------------------------

    @property
    def engine_block_size(self) -> int | None:
        """The engines' block size once an event announced it (the most common one when
        engines differ); None before."""
        return self._engine_block_size

    def _update_engine_block_size(self) -> None:
        sizes = [state.block_size for state in self._backends.values() if state.block_size]
        self._engine_block_size = max(set(sizes), key=sizes.count) if sizes else None

    @property
    def nbytes(self) -> int:
        """Memory of the index layers plus an estimate of the engine-hash maps (two 64-bit
        Python ints per engine block besides the dict's own table)."""
        layers = sum(index.stats().bytes for index in (*self._exact.values(), *self._speculative.values()))
        maps = sum(sys.getsizeof(known.router_hash) + 72 * len(known.router_hash) for known in self._backends.values())
        return layers + maps

    def state(self, backend: str) -> KVEventsState:
        """The backend's stream state (``APPROXIMATE`` for an unknown backend)."""
        known = self._backends.get(backend)
        return known.state if known is not None else KVEventsState.APPROXIMATE

    def states(self) -> dict[str, KVEventsState]:
        """Every known backend's stream state."""
        return {backend: known.state for backend, known in self._backends.items()}

    def blocks(self, backend: str) -> int:
        """Blocks of the backend in the exact layer (what ``kvroute_index_blocks`` shows)."""
        known = self._backends.get(backend)
        if known is None or known.block_size is None:
            return 0
        self.flush()
        return self._exact[known.block_size].blocks(backend)

    def tokens(self, backend: str) -> int:
        """Tokens of the backend's blocks in the exact layer."""
        known = self._backends.get(backend)
        return self.blocks(backend) * known.block_size if known is not None and known.block_size else 0

    def engine_blocks(self, backend: str) -> int:
        """Distinct block hashes the engine holds, matchable or not."""
        known = self._backends.get(backend)
        return len(known.router_hash) if known is not None else 0

    def stats(self) -> PreciseStats:
        """Per-backend block counts, states and block sizes."""
        names = list(self._backends)
        return PreciseStats(
            blocks={name: self.blocks(name) for name in names},
            engine_blocks={name: self.engine_blocks(name) for name in names},
            speculative_blocks={name: self._speculative_blocks(name) for name in names},
            states=self.states(),
            block_sizes={name: known.block_size for name, known in self._backends.items()},
            answers_before_events={name: known.answers_before_events for name, known in self._backends.items()},
        )

    def _speculative_blocks(self, backend: str) -> int:
        known = self._backends[backend]
        if known.block_size is None:
            return 0
        return self._speculative[known.block_size].blocks(backend)

    # -- routing side ----------------------------------------------------------------

    def prepare(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> PreciseHashes:
        """Hash a request once per block size in use. ``model`` counts as a LoRA adapter
        when an engine announced blocks of an adapter by that name."""
        lora_name = model if model in self._lora_names else None
        prepared = PreciseHashes(tokens, precise_salt(lora_name, cache_salt))
        # A snapshot of the sizes: prepare may run in a worker thread (routing.prepare).
        for block_size in tuple(self._exact):
            prepared.hashes[block_size] = block_hashes(tokens, block_size, prepared.salt)
        return prepared

    def match(self, prepared: PreciseHashes, approximate: Mapping[str, int]) -> dict[str, int]:
        """Matched prompt tokens per backend: from events for backends with a usable stream
        (exact or speculative, whichever is longer), from ``approximate`` (the routing
        engine's index) for the others, and the longest of all three while ``PARTIAL``."""
        self._catch_up()
        matched = {
            backend: tokens
            for backend, tokens in approximate.items()
            if self.state(backend) is KVEventsState.APPROXIMATE
        }
        for block_size, hashes in prepared.hashes.items():
            if len(hashes) == 0:
                continue
            exact = self._exact[block_size].match_hashes(hashes)
            speculative = self._speculative[block_size].match_hashes(hashes)
            for backend in exact.keys() | speculative.keys():
                known = self._backends.get(backend)
                if known is None or known.state is KVEventsState.APPROXIMATE:
                    continue
                tokens = max(exact.get(backend, 0), speculative.get(backend, 0))
                if not known.complete:
                    tokens = max(tokens, approximate.get(backend, 0))
                matched[backend] = tokens
        for backend, tokens in approximate.items():
            known = self._backends.get(backend)
            if known is not None and not known.complete and backend not in matched:
                matched[backend] = tokens
        return matched

    def speculate(self, backend: str, prepared: PreciseHashes, *, sliced: bool = False) -> PendingInsert | None:
        """The request was routed to ``backend``: hold its blocks there until the engine's
        events confirm them or ``speculative_ttl_s`` passes. ``sliced``: of more than
        :data:`INSERT_SLICE_BLOCKS` blocks insert the last slice, and return the rest."""
        known = self._backends.get(backend)
        if known is None:
            return None
        subscriber = self._subscribers.get(backend)
        if subscriber is not None:
            subscriber.note_routed()
        held = self._hashes_for(known, prepared)
        if held is None:
            return None
        block_size, hashes = held
        return insert_blocks(self._speculative[block_size], backend, hashes, sliced=sliced)

    def answered(self, backend: str, prepared: PreciseHashes, *, sliced: bool = False) -> PendingInsert | None:
        """``backend``'s engine answered the request: it holds the prompt's blocks now. Unless
        its events confirmed them all already, hold them speculatively for another
        ``speculative_ttl_s``, so that the TTL counts from the answer, not from the routing.

        vLLM can publish a request's events after its answer. A request that spent longer
        than the TTL in the engine's queue had lost its guesses by then, and the next turn,
        sent at once, found only the shared system prompt (the e2e tier, on a loaded CPU).
        Nothing for a backend whose stream is not usable (no events to wait for). ``sliced``
        as in :meth:`speculate`."""
        known = self._backends.get(backend)
        if known is None or known.state is KVEventsState.APPROXIMATE:
            return None
        held = self._hashes_for(known, prepared)
        if held is None:
            return None
        block_size, hashes = held
        self._catch_up()
        if self._exact[block_size].match_hashes(hashes).get(backend, 0) == len(hashes) * block_size:
            return None
        known.answers_before_events += 1
        awaited = known.awaited
        if len(awaited) >= AWAITED_ANSWERS:
            del awaited[next(iter(awaited))]
        awaited[int(hashes[-1])] = self._clock()
        return insert_blocks(self._speculative[block_size], backend, hashes, sliced=sliced)

    def _catch_up(self) -> None:
        """Apply the events every stream has received, and write them to the index layers."""
        for subscriber in self._subscribers.values():
            subscriber.drain()
        self.flush()

    @staticmethod
    def _hashes_for(known: _Backend, prepared: PreciseHashes) -> tuple[int, np.ndarray] | None:
        """The backend's block size and the prompt's hashes under it; None if there are none."""
        if known.block_size is None:
            return None
        hashes = prepared.hashes.get(known.block_size)
        if hashes is None or not len(hashes):
            return None
        return known.block_size, hashes

    # -- event side (kvroute.router.routing.kv_events.EventSink) -------------------------------------

    def apply_events(self, backend: str, events: Sequence[KVEvent]) -> None:
        """Apply one batch of the backend's events, in order.

        The engine-hash map changes at once; the index layers get the net change of many
        batches in one vectorized write at the next :meth:`flush` (a subscriber flushes
        when its socket runs dry, and every read flushes first).
        """
        known = self._backend(backend)
        for event in events:
            try:
                if isinstance(event, BlockStored):
                    self._store(backend, known, event)
                elif isinstance(event, BlockRemoved):
                    self._remove(backend, known, event)
                elif isinstance(event, AllBlocksCleared):
                    self.clear_backend(backend)
            except (OverflowError, ValueError, TypeError):
                # Token ids or hashes outside 64 bits: not from a well-behaved engine.
                known.ignored_events += 1

    def flush(self) -> None:
        """Write the pending net changes of every backend to the index layers."""
        if not self._dirty:
            return
        for backend in self._dirty:
            known = self._backends.get(backend)
            if known is not None and known.block_size is not None:
                self._write_pending(backend, known, known.block_size)
        self._dirty.clear()

    def _write_pending(self, backend: str, known: _Backend, block_size: int) -> None:
        if known.pending_remove:
            removed = np.fromiter(known.pending_remove, dtype=np.uint64, count=len(known.pending_remove))
            self._exact[block_size].remove_blocks(backend, removed)
            self._speculative[block_size].remove_blocks(backend, removed)
            known.pending_remove.clear()
        if known.pending_insert:
            inserted = np.fromiter(known.pending_insert, dtype=np.uint64, count=len(known.pending_insert))
            self._exact[block_size].insert_hashes(backend, inserted)
            known.pending_insert.clear()

    def clear_backend(self, backend: str) -> None:
        """Forget every block of the backend (engine reset or restart, lost history)."""
        known = self._backend(backend)
        known.router_hash.clear()
        known.copies.clear()
        known.pending_insert.clear()
        known.pending_remove.clear()
        known.awaited.clear()
        if known.block_size is not None:
            self._exact[known.block_size].clear(backend)
            self._speculative[known.block_size].clear(backend)

    def set_state(self, backend: str, state: KVEventsState) -> None:
        """The backend's stream changed state (called by its subscriber); ignored for a
        backend that is not (or no longer) tracked."""
        known = self._backends.get(backend)
        if known is None:
            return
        if state is KVEventsState.PRECISE:
            known.complete = True
        elif state is KVEventsState.PARTIAL:
            known.complete = False
        if state is not known.state:
            known.state = state
            log.info("kv events of %s: %s", backend, state.name.lower())
            if self._on_state is not None:
                self._on_state(backend, state)

    def _backend(self, backend: str) -> _Backend:
        known = self._backends.get(backend)
        if known is None:
            known = self._backends[backend] = _Backend()
        return known

    def _use_block_size(self, backend: str, known: _Backend, block_size: int) -> None:
        """Index the backend under ``block_size``, starting over if the engine changed it."""
        if known.block_size != block_size:
            if known.block_size is not None:
                log.warning("kv events of %s: block size %s -> %d", backend, known.block_size, block_size)
                self.clear_backend(backend)
            known.block_size = block_size
            self._update_engine_block_size()
            if block_size not in self._exact:
                self._exact[block_size] = PrefixIndex(block_size=block_size, clock=self._clock)
                self._speculative[block_size] = PrefixIndex(
                    block_size=block_size, ttl_s=self._speculative_ttl_s, clock=self._clock
                )

    def _store(self, backend: str, known: _Backend, event: BlockStored) -> None:
        size = event.block_size
        engine_hashes = event.block_hashes
        if (
            size <= 0
            or len(event.token_ids) != len(engine_hashes) * size
            or event.medium not in INDEXED_MEDIA
            or event.group_idx not in (None, 0)
        ):
            known.ignored_events += 1
            return
        self._use_block_size(backend, known, size)
        if event.lora_name is not None:
            self._lora_names.add(event.lora_name)
        router_hashes = self._router_hashes(known, event)
        held, copies = known.router_hash, known.copies
        pending_insert, pending_remove = known.pending_insert, known.pending_remove
        for engine_value, router_value in zip(engine_hashes, router_hashes):
            key = engine_value if type(engine_value) is int else engine_hash(engine_value)
            if key in held:
                copies[key] = copies.get(key, 0) + 1
                continue
            held[key] = router_value
            if router_value is not None:
                pending_remove.discard(router_value)
                pending_insert[router_value] = None
        if known.awaited:
            self._confirm_awaited(backend, known, router_hashes)
        self._dirty.add(backend)

    def _confirm_awaited(self, backend: str, known: _Backend, router_hashes: list[int | None]) -> None:
        """Time the answers whose prompt's last block these stored blocks include."""
        now = self._clock()
        for router_value in router_hashes:
            answered_at = known.awaited.pop(router_value, None) if router_value is not None else None
            if answered_at is not None and self._on_event_lag is not None:
                self._on_event_lag(backend, now - answered_at)

    def _router_hashes(self, known: _Backend, event: BlockStored) -> list[int | None]:
        """The router's chained hashes of the stored blocks, or Nones when they cannot be
        matched (parent unknown or unmatchable, or keyed by more than tokens and salt)."""
        count = len(event.block_hashes)
        if not _blocks_are_plain(event):
            return [None] * count
        size = event.block_size
        if event.parent_block_hash is None:
            if event.lora_id is not None and event.lora_name is None:
                return [None] * count  # an adapter known only by number: no request names it
            salt = precise_salt(event.lora_name, _first_block_cache_salt(event))
            return block_hashes(event.token_ids, size, salt).tolist()  # type: ignore[no-any-return]
        parent = known.router_hash.get(engine_hash(event.parent_block_hash))
        if parent is None:
            known.unmatchable_stores += 1
            return [None] * count
        tokens = event.token_ids
        hashes: list[int | None] = []
        for start in range(0, count * size, size):
            parent = chain_hash(parent, tokens[start : start + size])
            hashes.append(parent)
        return hashes

    def _remove(self, backend: str, known: _Backend, event: BlockRemoved) -> None:
        if event.medium not in INDEXED_MEDIA or event.group_idx not in (None, 0):
            known.ignored_events += 1
            return
        held, copies = known.router_hash, known.copies
        pending_insert, pending_remove = known.pending_insert, known.pending_remove
        for value in event.block_hashes:
            key = value if type(value) is int else engine_hash(value)
            extra = copies.get(key)
            if extra:
                if extra == 1:
                    del copies[key]
                else:
                    copies[key] = extra - 1
                continue
            router_value = held.pop(key, None)
            if router_value is not None:
                pending_insert.pop(router_value, None)
                pending_remove.add(router_value)
        self._dirty.add(backend)

    # -- subscriptions ---------------------------------------------------------------

    def endpoints(
        self,
        backend_url: str,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
    ) -> tuple[str, str | None] | None:
        """(events endpoint, replay endpoint) of a backend, or None when it has none.

        Events: the configured endpoint, else the backend's host with ``events_port``.
        Replay: the configured endpoint, else the events endpoint's host with ``replay_port``
        (without either, gaps cannot be filled and the stream goes ``PARTIAL`` after one).
        """
        # Rank r of a data-parallel engine publishes r ports above the engine's ports.
        url, rank = split_rank_name(backend_url)
        offset = rank or 0
        endpoint = kv_events_endpoint
        if endpoint is None and self._events_port is not None:
            endpoint = events_endpoint_for(url, self._events_port + offset)
        if endpoint is None:
            return None
        replay = kv_events_replay_endpoint
        if replay is None and self._replay_port is not None:
            replay = endpoint_with_port(endpoint, self._replay_port + offset)
        return endpoint, replay

    def configure_backend(
        self,
        backend_url: str,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
    ) -> None:
        """Remember a backend's configured endpoints for whenever it is added (again)."""
        self._configured[backend_url] = (kv_events_endpoint, kv_events_replay_endpoint)

    def add_backend(
        self,
        backend_url: str,
        kv_events_endpoint: str | None = None,
        kv_events_replay_endpoint: str | None = None,
    ) -> None:
        """Track a backend; subscribe to its events when it has an endpoint (given here,
        configured, or derived: see :meth:`endpoints`), at once if the index is running."""
        if backend_url in self._subscribers:
            return
        configured_events, configured_replay = self._configured.get(backend_url, (None, None))
        endpoints = self.endpoints(
            backend_url, kv_events_endpoint or configured_events, kv_events_replay_endpoint or configured_replay
        )
        if backend_url not in self._backends and self._on_state is not None:
            self._on_state(backend_url, KVEventsState.APPROXIMATE)  # exported from the start
        self._backend(backend_url)
        if endpoints is None:
            return
        endpoint, replay = endpoints
        self._subscribers[backend_url] = KVEventSubscriber(
            backend_url,
            endpoint,
            self,
            replay_endpoint=replay,
            topic=self._topic,
            context=self._context,
            silence_s=self._silence_s,
            clock=self._clock,
        )
        if self._running:
            self._start_subscriber(backend_url)

    def remove_backend(self, backend_url: str) -> None:
        """Stop the backend's subscriber and drop everything known about it."""
        task = self._tasks.pop(backend_url, None)
        if task is not None:
            task.cancel()
        self._subscribers.pop(backend_url, None)
        known = self._backends.pop(backend_url, None)
        if known is not None and known.block_size is not None:
            self._exact[known.block_size].remove_backend(backend_url)
            self._speculative[known.block_size].remove_backend(backend_url)
            self._update_engine_block_size()

    def subscriber(self, backend_url: str) -> KVEventSubscriber | None:
        """The backend's subscriber (for its counters), if it has one."""
        return self._subscribers.get(backend_url)

    def expect_block_size(self, backend: str, block_size: int) -> None:
        """The engine's block size as its metrics state it: index the backend under it until
        a stored event says otherwise, so that the blocks of the first requests routed there
        are held speculatively before the engine has announced any. Ignored once events have
        told it, and for a backend that is not tracked."""
        known = self._backends.get(backend)
        if known is None or known.block_size is not None or block_size <= 0:
            return
        self._use_block_size(backend, known, block_size)

    def stream_counts(self) -> dict[str, dict[str, int]]:
        """Per backend with a subscriber, its stream's counters by name (messages, gaps,
        disconnects, ...; what its decoder skipped included; answers that came before the
        events of their blocks), for ``/metrics``."""
        return {
            url: asdict(subscriber.stats)
            | asdict(subscriber.decoder.stats)
            | {"answers_before_events": self._backends[url].answers_before_events}
            for url, subscriber in self._subscribers.items()
        }

    async def start(self) -> None:
        """Start every subscriber and the silence watchdog (needs the running loop); once."""
        if self._running:
            return
        self._running = True
        for name in self._subscribers:
            self._start_subscriber(name)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_silence())

    async def stop(self) -> None:
        """Cancel the subscribers and the watchdog and close their sockets."""
        self._running = False
        tasks = [*self._tasks.values(), *([self._watchdog] if self._watchdog else [])]
        self._tasks.clear()
        self._watchdog = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._context.term()

    def _start_subscriber(self, name: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run_subscriber(self._subscribers[name]), name=f"kv-events {name}"
        )
        self._tasks[name] = task

    async def _run_subscriber(self, subscriber: KVEventSubscriber) -> None:
        try:
            await subscriber.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug must not take routing down: the backend falls back to approximate.
            log.exception("kv events subscriber of %s failed", subscriber.backend)
            self.set_state(subscriber.backend, KVEventsState.APPROXIMATE)

    async def _watch_silence(self) -> None:
        interval = min(1.0, self._silence_s / 4)
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            for subscriber in list(self._subscribers.values()):
                subscriber.check_silence(now)

    def backends(self) -> Iterable[str]:
        """Every tracked backend."""
        return list(self._backends)
