"""Recent long prompts and their ids, so a conversation's next turn skips what it repeats.

Turn N+1 of a conversation re-sends turn N's messages, and its rendered text starts with
turn N's text. The piece cache (:mod:`kvroute.tokenizer_index.piece_cache`) already spares
tokenizing that text again, but finding, hashing and looking up its hundreds of pieces and
joining their arrays still costs about 1 ms per 100K tokens. The request tokenizer keeps
its last long prompts here, each with where its pieces end and its ids; when a new prompt
starts with one of them it takes that prefix's ids as one slice and cuts and looks up only
the rest (:meth:`kvroute.tokenizer_index.tokenizer.RequestTokenizer.encode_chat_array`).

A prompt is filed under a key its conversation's next request can compute (a hash of its
last message's text, :func:`conversation_keys`); a key only proposes candidates, and the
caller compares texts, so a collision costs a comparison, never a wrong id. Within a byte
bound, an entry a conversation's next turn superseded (the turn it was built from) is
evicted first, so a conversation holds one entry's worth of the bound, not one per turn it
sent lately; then one whose conversation seems to have ended, then the one expected back
last (:mod:`kvroute.tokenizer_index.return_order`). Thread-safe. The same memo keeps
rendered conversations (:mod:`kvroute.tokenizer_index.render_memo`), filed the same way.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from kvroute.tokenizer_index.piece_cache import join_ids
from kvroute.tokenizer_index.return_order import ReturnOrder

#: Candidates kept per key (the most recent first): conversations that share a last message.
PER_KEY = 4
# Bytes an entry costs beyond its text and arrays (objects, dict slots).
ENTRY_OVERHEAD_BYTES = 400
#: Runs of ids a remembered prompt keeps before they are joined into one array.
MAX_RUNS = 64
#: The last messages of a request whose text may name the turn before it.
PROBE_MESSAGES = 8
#: What a remembered prompt keeps its ids and offsets as: half of int64's bytes (an agent's
#: 200 messages, ~15K ids, cost 190 KB a turn as int64), and every vocabulary and prompt
#: fits. Joined back into int64 (``join_ids``) for the caller.
STORED_DTYPE = np.int32


def conversation_keys(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Keys a conversation is remembered and looked up by: hashes of its last messages' texts,
    the last message first (its next turn finds it among the messages it repeats)."""
    keys = []
    for message in reversed(messages[-PROBE_MESSAGES:]):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str) and content:
            keys.append(hash(content))
    return keys


class Remembered(Protocol):
    """What the memo keeps: an entry that knows its cost and which older entry it replaces."""

    @property
    def nbytes(self) -> int: ...

    def replaces(self, other: Any) -> bool: ...


Entry = TypeVar("Entry", bound=Remembered)


@dataclass(frozen=True, slots=True)
class RememberedPrompt:
    """A prompt's text, where its pieces end, and its ids (read-only)."""

    text: str
    #: Character offset where each piece of ``text`` ends (:data:`STORED_DTYPE`, increasing;
    #: the last is ``len(text)``).
    piece_ends: np.ndarray
    #: How many ids the pieces up to each of those ends have.
    token_ends: np.ndarray
    #: The ids as read-only runs (:data:`STORED_DTYPE`) that, joined in order, are all of
    #: them: views of the earlier turn's runs (shared, not copied) and one run of the pieces
    #: after them.
    runs: tuple[np.ndarray, ...]
    #: How many ids the runs up to each of them hold (int64).
    run_ends: np.ndarray
    #: What it is charged against the memo's bound (runs shared with other entries count
    #: in each, an overestimate); summed once, as eviction reads it again.
    nbytes: int

    @classmethod
    def of(
        cls, text: str, piece_ends: np.ndarray, token_ends: np.ndarray, runs: Sequence[np.ndarray]
    ) -> RememberedPrompt:
        """Remember ``runs`` (read-only arrays) as they are, those not yet stored narrowed to
        :data:`STORED_DTYPE` (a turn's new pieces); more than :data:`MAX_RUNS` of them are
        joined into one first, so a long conversation copies its ids once every few dozen
        turns instead of every turn (~70 us to 0.4 ms per 100K ids)."""
        if len(runs) > MAX_RUNS:
            runs = (join_ids(runs),)
        runs = tuple(map(_stored, runs))
        piece_ends, token_ends = _stored(piece_ends), _stored(token_ends)
        run_ends = np.cumsum([len(run) for run in runs], dtype=np.int64)
        arrays = piece_ends.nbytes + token_ends.nbytes + run_ends.nbytes + sum(run.nbytes for run in runs)
        nbytes = ENTRY_OVERHEAD_BYTES + sys.getsizeof(text) + arrays
        return cls(text, piece_ends, token_ends, tuple(runs), run_ends, nbytes)

    def runs_up_to(self, count: int) -> list[np.ndarray]:
        """Read-only runs that, joined, are the first ``count`` ids."""
        if count <= 0:
            return []
        last = int(np.searchsorted(self.run_ends, count))  # the first run that reaches count
        begin = int(self.run_ends[last - 1]) if last else 0
        return [*self.runs[:last], self.runs[last][: count - begin]]

    @property
    def ids(self) -> np.ndarray:
        """All the ids, joined (a new array)."""
        return join_ids(self.runs)

    def replaces(self, other: RememberedPrompt) -> bool:
        """Whether ``other`` is the same prompt (kept once per key)."""
        return other.text == self.text


def _stored(array: np.ndarray) -> np.ndarray:
    """``array`` as a remembered prompt keeps it: read-only, of :data:`STORED_DTYPE` (a
    narrowed copy where it is not one already)."""
    if array.dtype != STORED_DTYPE:
        array = array.astype(STORED_DTYPE)
        array.flags.writeable = False
    return array


@dataclass(frozen=True, slots=True)
class PromptMemoStats:
    """A snapshot of the memo's size and counters."""

    entries: int
    bytes: int
    max_bytes: int
    #: Lookups that found a candidate whose text the new prompt starts with.
    reused: int
    lookups: int
    #: Renders from a remembered turn that differed from the whole render (render memo only).
    mismatches: int = 0


class PromptMemo(Generic[Entry]):
    """Entries (long prompts) by key, at most ``max_bytes`` of them (0 disables it)."""

    def __init__(self, max_bytes: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._by_key: dict[int, list[Entry]] = {}
        self._order = ReturnOrder()  # (of the keys: when each was used, which to evict)
        self._clock = clock
        self._bytes = 0
        self._reused = 0
        self._lookups = 0
        self._lock = threading.Lock()

    def candidates(self, keys: Iterable[int]) -> list[tuple[int, Entry]]:
        """The entries filed under these keys, each with its key, in key order, most recent
        first per key. Looking does not count as a use: the one the caller builds on is
        passed to :meth:`remember` (or :meth:`touch`)."""
        found: list[tuple[int, Entry]] = []
        keys = list(keys)
        now = self._clock()
        with self._lock:
            self._lookups += 1
            self._order.looked_up(keys, now)
            for key in keys:
                prompts = self._by_key.get(key)
                if prompts is not None:
                    found += ((key, prompt) for prompt in prompts)
        return found

    def touch(self, key: int) -> None:
        """The entries under ``key`` were used now."""
        now = self._clock()
        with self._lock:
            if key in self._by_key:
                self._order.used(key, now)

    def reused(self) -> None:
        """Count a lookup whose candidate the caller could use."""
        with self._lock:
            self._reused += 1

    def remember(self, key: int, prompt: Entry, *, supersedes: int | None = None) -> None:
        """File ``prompt`` under ``key`` (it replaces an entry of the same prompt), then evict.
        ``supersedes``: the key of the entry ``prompt`` was built from (the conversation's
        turn before), whose entries are then the first to be evicted."""
        cost = prompt.nbytes
        if cost > self.max_bytes:
            if supersedes is not None:
                self.touch(supersedes)
            return
        now = self._clock()
        with self._lock:
            prompts = self._by_key.pop(key, [])
            kept = [prompt]
            for old in prompts:
                if len(kept) < PER_KEY and not prompt.replaces(old):
                    kept.append(old)
                else:
                    self._bytes -= old.nbytes
            self._by_key[key] = kept
            self._order.used(key, now, after=supersedes)
            self._bytes += cost
            while self._bytes > self.max_bytes and self._by_key:
                victim = self._order.victim(now)
                self._order.evict(victim)
                self._bytes -= sum(old.nbytes for old in self._by_key.pop(victim))

    def clear(self) -> None:
        """Forget every prompt (the counters are kept)."""
        with self._lock:
            self._by_key.clear()
            self._order.clear()
            self._bytes = 0

    def stats(self) -> PromptMemoStats:
        with self._lock:
            return PromptMemoStats(
                entries=sum(len(prompts) for prompts in self._by_key.values()),
                bytes=self._bytes,
                max_bytes=self.max_bytes,
                reused=self._reused,
                lookups=self._lookups,
            )
