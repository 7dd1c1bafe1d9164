"""Continuous batching over one shared compute budget, like a GPU replica.

One asyncio task runs engine steps. Each step admits waiting requests into the running
batch (up to ``max_num_seqs`` and the KV cache size), prefills running requests' uncached
prompt tokens (FCFS, at most ``max_num_batched_tokens`` per step, so long prompts are
chunked) and decodes one token for every running request already past its prefill. A
step costs ``prefilled / prefill_tokens_per_s + (1 / decode_tokens_per_s if decoding)``
engine seconds, divided by ``time_scale`` in wall time.

Steps shorter than ``min_step_wall_s`` are simulated back to back and their tokens handed
out together after one sleep, so a fast time scale costs few wake-ups. Per request there
is no task and no timer: a handler awaits one future that the step loop resolves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvroute.benchmarks.sim_engine.cache import CacheKey, PrefixCache
from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.kv_events import KVEventPublisher
from kvroute.benchmarks.sim_engine.metrics import EngineMetrics

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class SimRequest:
    """One generation request as the engine tracks it."""

    request_id: str
    prompt: np.ndarray  # prompt token ids
    hashes: np.ndarray  # chained hashes of the prompt's full blocks
    key: CacheKey
    output: np.ndarray  # the token ids it will generate, fixed up front
    arrival: float  # loop time
    streaming: bool = False  # woken per token batch, not only at the end
    cached_tokens: int = 0
    computed: int = 0  # prompt tokens whose KV exists (cached or prefilled)
    generated: int = 0  # tokens the engine has produced
    delivered: int = 0  # tokens handed to the HTTP handler
    kv_blocks: int = 0  # KV blocks this sequence references while it runs
    completed: bool = False  # the engine is done with it (tokens may still be in flight)
    finished: bool = False  # the handler has every token
    aborted: bool = False
    paused: bool = False  # a stalled request holds its slot but makes no progress
    first_token_at: float | None = None
    finished_at: float | None = None
    _waiter: asyncio.Future[None] | None = field(default=None, repr=False)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_tokens(self) -> int:
        return len(self.output)

    async def wait_for_tokens(self, seen: int) -> None:
        """Return once more than ``seen`` tokens are delivered, or the request has ended."""
        while self.delivered <= seen and not self.finished and not self.aborted:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    async def wait_until_finished(self) -> None:
        """Return once every token is delivered, or the request has ended otherwise."""
        while not self.finished and not self.aborted:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._waiter = None


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the scheduler loop died", exc_info=task.exception())


@dataclass(slots=True)
class SchedulerTotals:
    """Totals for ``GET /sim/stats``."""

    requests_served: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0


class Scheduler:
    """The step loop of one replica. Start with :meth:`start`, stop with :meth:`close`."""

    def __init__(
        self,
        config: SimEngineConfig,
        cache: PrefixCache,
        metrics: EngineMetrics,
        publisher: KVEventPublisher | None = None,
    ) -> None:
        self._config = config
        self._cache = cache
        self._metrics = metrics
        self._publisher = publisher
        self._block_size = config.block_size
        self._prefill_rate = config.prefill_tokens_per_s
        self._decode_step_s = 1.0 / config.decode_tokens_per_s
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._kv_blocks_in_use = 0
        self._prefilling = 0  # running requests whose prompt is not fully computed yet
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.totals = SchedulerTotals()

    # --- state ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        """Whether the step loop is running (false before start, after close or a crash)."""
        return self._task is not None and not self._task.done()

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks referenced by running requests (vLLM's kv_cache_usage_perc)."""
        return min(1.0, self._kv_blocks_in_use / self._cache.num_blocks)

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-scheduler")
            self._task.add_done_callback(_report_crash)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request in [*self._waiting, *self._running]:
            self.abort(request)

    # --- requests -------------------------------------------------------------------

    def submit(self, request: SimRequest) -> None:
        """Queue a request; it is scheduled at the next step."""
        self._waiting.append(request)
        self._metrics.waiting.set(len(self._waiting))
        self._wake.set()

    def abort(self, request: SimRequest) -> None:
        """Drop a request that is no longer wanted (client gone); frees its slot now."""
        if request.completed or request.aborted:
            return
        request.aborted = True
        if request in self._running:
            self._running.remove(request)
            self._kv_blocks_in_use -= request.kv_blocks
            if request.computed < request.prompt_len:
                self._prefilling -= 1
            # What it computed stays cached, as in vLLM.
            computed_blocks = request.computed // self._block_size
            self._cache.store(request.hashes, request.prompt, computed_blocks, request.key)
        else:
            with contextlib.suppress(ValueError):
                self._waiting.remove(request)
        self.totals.requests_aborted += 1
        self._publish_gauges()
        request._wake()
        self._wake.set()

    def pause(self, request: SimRequest) -> None:
        """Wedge a request (fault injection): it keeps its slot and KV but makes no progress."""
        request.paused = True

    def reset_prefix_cache(self) -> None:
        """Clear the cache (vLLM's dev endpoint) and publish ``AllBlocksCleared`` at once."""
        self._cache.clear()
        if self._publisher is not None:
            self._publisher.flush()

    # --- the step loop --------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        min_wall = self._config.min_step_wall_s
        scale = self._config.time_scale
        clock = loop.time()
        while True:
            # Never bank idle or overloaded time: the schedule restarts from now when behind.
            clock = max(clock, loop.time())
            # Requests that made progress (insertion-ordered set) and those that completed.
            produced: dict[SimRequest, None] = {}
            finished: list[SimRequest] = []
            wall = 0.0
            while wall < min_wall:
                # Decode steps that fit in what is left of this sleep's minimum.
                decode_steps = max(1, int((min_wall - wall) * scale / self._decode_step_s))
                step_s = self.step(produced, finished, decode_steps)
                if step_s <= 0.0:
                    break
                wall += step_s / scale
            self._cache.flush()
            if self._publisher is not None:
                self._publisher.flush()
            if wall == 0.0:
                # Nothing can progress (idle, or only stalled requests): sleep until a
                # submit or an abort changes that.
                self._wake.clear()
                await self._wake.wait()
                continue
            clock += wall
            delay = clock - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._deliver(produced, finished, loop.time())

    def step(self, produced: dict[SimRequest, None], finished: list[SimRequest], decode_steps: int = 1) -> float:
        """One engine iteration; returns its cost in engine seconds (0: nothing to do).

        When every running request is decoding, up to ``decode_steps`` iterations are taken
        at once (never past the next request's end, when the batch could change).
        """
        self._admit()
        if self._prefilling == 0 and decode_steps > 1 and self._running:
            return self._decode_only(produced, finished, decode_steps)
        budget = self._config.max_num_batched_tokens
        prefilled = 0
        decoding = False
        done: list[SimRequest] = []
        for request in self._running:
            if request.paused:
                continue
            remaining = request.prompt_len - request.computed
            if remaining > 0:
                if budget <= 0:
                    continue
                chunk = remaining if remaining < budget else budget
                budget -= chunk
                prefilled += chunk
                request.computed += chunk
                self._cache.store(request.hashes, request.prompt, request.computed // self._block_size, request.key)
                if request.computed < request.prompt_len:
                    continue
                self._prefilling -= 1
            else:
                decoding = True
            request.generated += 1
            self._grow_kv(request)
            produced[request] = None
            if request.generated >= request.max_tokens:
                done.append(request)
        for request in done:
            self._finish(request)
            finished.append(request)
        if prefilled == 0 and not decoding and not produced:
            return 0.0
        self.totals.steps += 1
        step_s = prefilled / self._prefill_rate
        if decoding:
            step_s += self._decode_step_s
        return step_s

    def _decode_only(self, produced: dict[SimRequest, None], finished: list[SimRequest], max_steps: int) -> float:
        active = [request for request in self._running if not request.paused]
        if not active:
            return 0.0
        steps = min(max_steps, min(request.max_tokens - request.generated for request in active))
        for request in active:
            request.generated += steps
            self._grow_kv(request)
            produced[request] = None
            if request.generated >= request.max_tokens:
                self._finish(request)
                finished.append(request)
        self.totals.steps += steps
        return steps * self._decode_step_s

    def _admit(self) -> None:
        """Move waiting requests into the batch while a slot and KV room are free."""
        max_seqs = self._config.max_num_seqs
        capacity = self._cache.num_blocks
        size = self._block_size
        admitted = False
        batch_prompt = batch_cached = 0
        while self._waiting and len(self._running) < max_seqs:
            request = self._waiting[0]
            need = -(-request.prompt_len // size)
            if self._running and self._kv_blocks_in_use + need > capacity:
                break
            self._waiting.popleft()
            self._lookup_prefix(request)
            batch_prompt += request.prompt_len
            batch_cached += request.cached_tokens
            self._grow_kv(request)
            self._running.append(request)
            self._prefilling += 1  # even a fully cached prompt computes its last token
            admitted = True
        if batch_prompt:
            # Requests admitted together prefill together: SGLang's "last prefill batch".
            self._metrics.prefill_hit_rate.set(batch_cached / batch_prompt)
        if admitted:
            self._publish_gauges()

    def _lookup_prefix(self, request: SimRequest) -> None:
        """vLLM's rule: whole cached blocks, but the last prompt token is always computed."""
        size = self._block_size
        hit_blocks = self._cache.cached_blocks(request.hashes)
        cacheable = (request.prompt_len - 1) // size
        cached = min(hit_blocks, cacheable) * size
        request.cached_tokens = cached
        request.computed = cached
        metrics = self._metrics
        metrics.prefix_queries.inc(request.prompt_len)
        metrics.prefix_hits.inc(cached)
        metrics.prompt_tokens.inc(request.prompt_len)
        metrics.prompt_tokens_cached.inc(cached)
        self.totals.prompt_tokens += request.prompt_len
        self.totals.cached_tokens += cached

    def _grow_kv(self, request: SimRequest) -> None:
        """Account the KV blocks a sequence references after it grew."""
        blocks = -(-(request.computed + request.generated) // self._block_size)
        self._kv_blocks_in_use += blocks - request.kv_blocks
        request.kv_blocks = blocks

    def _finish(self, request: SimRequest) -> None:
        """Leave the batch; the full blocks of prompt plus output stay cached, as in vLLM."""
        self._running.remove(request)
        request.completed = True
        size = self._block_size
        self._kv_blocks_in_use -= request.kv_blocks
        # The last sampled token never had its KV computed.
        sequence = np.concatenate((request.prompt, request.output[: request.generated - 1]))
        full_blocks = len(sequence) // size
        if full_blocks > len(request.hashes):
            # Rehashing the whole sequence in one vectorised call beats chaining block by block.
            self._cache.store(self._cache.hashes(sequence, request.key), sequence, full_blocks, request.key)
        else:
            self._cache.store(request.hashes, sequence, full_blocks, request.key)
        self.totals.requests_served += 1
        self.totals.generation_tokens += request.generated
        self._metrics.generation_tokens.inc(request.generated)
        self._metrics.request_success.inc()

    def _deliver(self, produced: dict[SimRequest, None], finished: list[SimRequest], now: float) -> None:
        """Hand the tokens of the steps just slept through to their handlers.

        Streaming handlers wake for every batch of tokens; the others only for the first
        token (fault injection waits for it) and at the end.
        """
        metrics = self._metrics
        for request in finished:
            if not request.aborted:
                request.finished = True
                request.finished_at = now
                metrics.e2e.observe(now - request.arrival)
        for request in produced:
            if request.aborted:
                continue
            first = request.first_token_at is None
            if first:
                request.first_token_at = now
                metrics.ttft.observe(now - request.arrival)
            request.delivered = request.generated
            if first or request.streaming or request.finished:
                request._wake()
        self._publish_gauges()

    def _publish_gauges(self) -> None:
        metrics = self._metrics
        metrics.running.set(len(self._running))
        metrics.waiting.set(len(self._waiting))
        metrics.kv_usage.set(self.kv_usage)
