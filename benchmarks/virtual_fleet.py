"""A workload replayed in virtual time: kvroute's routing engine in front of the sim's scheduler.

``kvroute bench --engine virtual`` runs this instead of sim processes and a router process:
the same :class:`~kvroute.router.routing.routing_engine.RoutingEngine` a router runs (its
policies, index, ledger and feedback) chooses a backend for every request, and each replica
is the sim engine's own :class:`~kvroute.benchmarks.sim_engine.scheduler.Scheduler` and
:class:`~kvroute.benchmarks.sim_engine.cache.PrefixCache`, stepped on a virtual clock. No
sockets, no wall clock, no CPU contention: a run is deterministic, takes seconds, and TTFT
is in modelled engine seconds. It is the tool for comparing placement decisions; the
wall-clock bench (sims over HTTP) remains the measure of the whole router.

What the virtual fleet leaves out: HTTP and the router's CPU time (routing takes no
virtual time), the engine statistics a router scrapes (``engine_waiting``), retries and
faults. Clients follow
:func:`~kvroute.benchmarks.replay.replay`'s timing: a request goes out at its arrival time,
never before its session's previous answer plus its think time, and waits while the client
has its bound of requests in flight (a workload's ``max_concurrency``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvroute.benchmarks.fleet import EngineCounters, RouterCounters, SimSpec, SpecFleet
from kvroute.benchmarks.replay import ReplayResult, RequestRecord
from kvroute.benchmarks.sim_engine.cache import CacheKey, PrefixCache
from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.generation import OutputVocabulary
from kvroute.benchmarks.sim_engine.metrics import EngineMetrics
from kvroute.benchmarks.sim_engine.scheduler import Scheduler, SimRequest
from kvroute.benchmarks.sim_engine.tokens import SimTokenizer
from kvroute.benchmarks.workloads import Workload, WorkloadRequest
from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.policies import LOAD_ONLY_POLICIES
from kvroute.router.routing.routing_engine import RoutePlan, RoutingEngine
from kvroute.tokenizer_index.hashing import request_salt

CHAT_ENDPOINT = "/v1/chat/completions"
#: Decode-only steps taken at once when no event is due (the batch's next end stops them).
_MAX_DECODE_STEPS = 1 << 20


@dataclass(slots=True)
class VirtualRun:
    """One replay's records and the counters ``kvroute bench`` reads from engines and router."""

    result: ReplayResult
    engines: dict[str, EngineCounters]
    router: RouterCounters


@dataclass(slots=True, eq=False)
class _InFlight:
    index: int
    backend: Backend
    plan: RoutePlan
    request: SimRequest


@dataclass(slots=True, eq=False)
class _Replica:
    """One sim replica: its scheduler, and the step in progress (its end time and effects)."""

    backend: Backend
    cache: PrefixCache
    scheduler: Scheduler
    busy_until: float | None = None
    produced: dict[SimRequest, None] = field(default_factory=dict)
    finished: list[SimRequest] = field(default_factory=list)


class VirtualFleet(SpecFleet):
    """The fleet ``kvroute bench --engine virtual`` runs: the sims of ``spec``, in virtual time.

    It has the shape of the other fleets (:class:`~kvroute.benchmarks.fleet.SimFleet`) for
    the bench's bookkeeping; :meth:`replay` runs one router policy over a workload on fresh
    replicas.
    """

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec

    @property
    def urls(self) -> list[str]:
        return [f"http://virtual-{number}" for number in range(self.spec.replicas)]

    async def fresh(self) -> None:
        """Nothing to empty: every replay starts new replicas."""

    def stop(self) -> None:
        """Nothing runs between replays."""

    def replay(
        self,
        workload: Workload,
        settings: Settings,
        *,
        max_in_flight: int | None = None,
        placement: Mapping[str, int] | None = None,
    ) -> VirtualRun:
        """``workload`` routed by a router with ``settings``, on fresh replicas, by a client
        with at most ``max_in_flight`` requests in flight (None: no bound).

        With ``placement`` (session id -> replica number) every request of a session goes to
        that replica whatever the policy chose (reason ``pinned``): a fixed placement to
        measure the policies against (:mod:`~kvroute.benchmarks.placement_search`). The
        policy must then be load-only, so that no index learns from choices it did not make.
        """
        if placement is not None and settings.policy not in LOAD_ONLY_POLICIES:
            raise ValueError(f"a fixed placement replays under a load-only policy, not {settings.policy!r}")
        simulation = _Simulation(self.spec, self.urls, settings, placement)
        return simulation.replay(workload.requests, max_in_flight)


class _Simulation:
    """``spec.replicas`` sim schedulers behind one routing engine, all on one virtual clock."""

    def __init__(
        self, spec: SimSpec, urls: Sequence[str], settings: Settings, placement: Mapping[str, int] | None = None
    ) -> None:
        self._now = 0.0
        self._placement = placement
        self._config = SimEngineConfig(
            models=(spec.model,),
            block_size=spec.block_size,
            kv_capacity_tokens=spec.kv_capacity_tokens,
            prefill_tokens_per_s=spec.prefill_tokens_per_s,
            decode_tokens_per_s=spec.decode_tokens_per_s,
            tokenizer=spec.tokenizer,
        )
        self._tokenizer = SimTokenizer.load(spec.tokenizer)
        self._vocabulary = OutputVocabulary.from_decoder(
            self._tokenizer.decode, self._tokenizer.vocab_size, self._tokenizer.special_ids, self._config.seed
        )
        self.routing = RoutingEngine(settings, clock=self.now)
        self._replicas: dict[str, _Replica] = {}
        for url in urls:
            # As ``kvroute bench`` starts its routers: ``--default-capacity-tokens``.
            backend = Backend(url, default_capacity_tokens=spec.kv_capacity_tokens)
            backend.healthy = True
            cache = PrefixCache(self._config.block_size, self._config.num_blocks)
            scheduler = Scheduler(self._config, cache, EngineMetrics(self._config))
            self._replicas[backend.url] = _Replica(backend, cache, scheduler)
        self._backends = [replica.backend for replica in self._replicas.values()]
        self._events: list[tuple[float, int, str, int | str]] = []
        self._order = itertools.count()
        # The router's own counters: prompt tokens it tokenized, and those it predicted cached.
        self._routed_prompt_tokens = 0
        self._predicted_tokens = 0

    def now(self) -> float:
        """The virtual clock (modelled engine seconds since the replay began)."""
        return self._now

    def replay(self, requests: Sequence[WorkloadRequest], max_in_flight: int | None = None) -> VirtualRun:
        """Route and serve every request; returns when the last one has finished. A request
        due while ``max_in_flight`` are in flight waits for a slot, in the order they fell due."""
        records = [RequestRecord(request.session_id, 0.0) for request in requests]
        following = _next_in_session(requests)
        in_flight: dict[SimRequest, _InFlight] = {}
        waiting: deque[int] = deque()
        for index in _session_starts(requests):
            self._at(requests[index].arrival_s, "send", index)
        while self._events:
            self._now, _, kind, subject = heapq.heappop(self._events)
            if kind == "send":
                assert isinstance(subject, int)
                waiting.append(subject)
                self._send_waiting(waiting, requests, records, in_flight, max_in_flight)
                continue
            assert isinstance(subject, str)
            replica = self._replicas[subject]
            replica.busy_until = None
            for request in replica.produced:
                record = records[in_flight[request].index]
                if record.ttft_s is None:
                    record.ttft_s = self._now - record.sent_s
            for request in replica.finished:
                done = in_flight.pop(request)
                self._answered(done, records[done.index])
                after = following.get(done.index)
                if after is not None:
                    upcoming = requests[after]
                    self._at(max(upcoming.arrival_s, self._now + upcoming.think_s), "send", after)
            replica.produced = {}
            replica.finished = []
            self._kick(replica)
            self._send_waiting(waiting, requests, records, in_flight, max_in_flight)
        engines = {
            url: EngineCounters(
                hit_tokens=replica.scheduler.totals.cached_tokens,
                queried_tokens=replica.scheduler.totals.prompt_tokens,
                requests=replica.scheduler.totals.requests_served,
                prompt_tokens=replica.scheduler.totals.prompt_tokens,
            )
            for url, replica in self._replicas.items()
        }
        router = RouterCounters(self._routed_prompt_tokens, self._predicted_tokens)
        return VirtualRun(ReplayResult(records, self._now), engines, router)

    def _send_waiting(
        self,
        waiting: deque[int],
        requests: Sequence[WorkloadRequest],
        records: list[RequestRecord],
        in_flight: dict[SimRequest, _InFlight],
        max_in_flight: int | None,
    ) -> None:
        """Send the requests that fell due, oldest first, while the client has slots."""
        while waiting and (max_in_flight is None or len(in_flight) < max_in_flight):
            index = waiting.popleft()
            sent = self._send(index, requests[index], records[index])
            in_flight[sent.request] = sent
            self._kick(self._replicas[sent.backend.url])

    def _at(self, when: float, kind: str, subject: int | str) -> None:
        heapq.heappush(self._events, (when, next(self._order), kind, subject))

    def _send(self, index: int, request: WorkloadRequest, record: RequestRecord) -> _InFlight:
        """Route one request as the proxy would and queue it at the chosen replica."""
        body = request.body
        headers = {"x-session-id": request.session_id} if request.session_id is not None else {}
        prepared = self.routing.prepare(request.endpoint, body)
        plan = self.routing.route(request.endpoint, body, headers, self._backends, prepared=prepared)
        if self._placement is not None:
            plan = self._pinned(plan, request)
        replica = self._replicas[plan.backend]
        backend = replica.backend
        backend.in_flight += 1
        backend.in_flight_work_tokens += plan.work_tokens
        prompt = self._prompt_ids(request)
        key = CacheKey(salt=request_salt(body.get("model")))
        budget = max(1, min(request.max_tokens, self._config.context_len - len(prompt)))
        sim_request = SimRequest(
            request_id=str(index),
            prompt=prompt,
            hashes=replica.cache.hashes(prompt, key),
            key=key,
            output=self._vocabulary.completion(prompt, budget),
            arrival=self._now,
            streaming=True,
        )
        replica.scheduler.submit(sim_request)
        record.sent_s = self._now
        record.status = 200
        record.backend = plan.backend
        if prepared is not None:
            record.predicted_cached_tokens = plan.predicted_cached_tokens
            self._routed_prompt_tokens += prepared.tokens
            self._predicted_tokens += plan.predicted_cached_tokens
        return _InFlight(index, backend, plan, sim_request)

    def _pinned(self, plan: RoutePlan, request: WorkloadRequest) -> RoutePlan:
        """``plan`` sent to the replica the fixed placement gives the request's session."""
        assert self._placement is not None
        if request.session_id is None:
            raise ValueError("a fixed placement needs every request to carry a session id")
        backend = self._backends[self._placement[request.session_id]].url
        return replace(plan, decision=replace(plan.decision, backend=backend, reason="pinned"))

    def _prompt_ids(self, request: WorkloadRequest) -> np.ndarray:
        body = request.body
        if request.endpoint == CHAT_ENDPOINT:
            return self._tokenizer.encode_chat_body(body, add_generation_prompt=body.get("add_generation_prompt", True))
        return self._tokenizer.encode_prompt(body["prompt"])

    def _answered(self, done: _InFlight, record: RequestRecord) -> None:
        """The response's end: the proxy's bookkeeping and the routing engine's feedback."""
        request = done.request
        record.latency_s = self._now - record.sent_s
        if record.ttft_s is None:
            record.ttft_s = record.latency_s
        record.prompt_tokens = request.prompt_len
        record.cached_tokens = request.cached_tokens
        done.backend.in_flight -= 1
        done.backend.in_flight_work_tokens -= done.plan.work_tokens
        self.routing.observe(done.plan, request.cached_tokens)

    def _kick(self, replica: _Replica) -> None:
        """Start the replica's next step if it is idle and has work."""
        if replica.busy_until is not None:
            return
        # Steps of a batch that only decodes run together up to the next event, when a new
        # request could join the batch: the same schedule as one step at a time.
        decode_steps = _MAX_DECODE_STEPS
        if self._events:
            horizon = self._events[0][0] - self._now
            decode_steps = max(1, min(decode_steps, int(horizon * self._config.decode_tokens_per_s)))
        duration = replica.scheduler.step(replica.produced, replica.finished, decode_steps)
        replica.cache.flush()
        if duration <= 0.0:
            return
        replica.busy_until = self._now + duration
        self._at(replica.busy_until, "step", replica.backend.url)


def _session_starts(requests: Sequence[WorkloadRequest]) -> list[int]:
    """Every session's first request and every request without a session."""
    seen: set[str] = set()
    starts = []
    for index, request in enumerate(requests):
        if request.session_id is None:
            starts.append(index)
        elif request.session_id not in seen:
            seen.add(request.session_id)
            starts.append(index)
    return starts


def _next_in_session(requests: Sequence[WorkloadRequest]) -> dict[int, int]:
    """Request index -> the index of its session's next request."""
    last: dict[str, int] = {}
    following: dict[int, int] = {}
    for index, request in enumerate(requests):
        if request.session_id is None:
            continue
        previous = last.get(request.session_id)
        if previous is not None:
            following[previous] = index
        last[request.session_id] = index
    return following
