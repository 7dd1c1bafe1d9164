"""Precise mode: the index built from KV events, against hand-built events and sim engines.

The first half applies decoded events straight to a ``PreciseIndex`` (what a subscriber
does with each batch). The second half runs real simulated engines publishing vLLM-format
events over ZeroMQ and real subscribers, and compares the router-side index with the
engine's own cache: after eviction pressure, after a late join, after dropped messages,
after an engine restart, and between two independent routers.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import openai
import pytest

from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.fleet.engine_stats import EngineStats
from kvroute.router.routing import sliced_insert
from kvroute.router.routing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsState,
    KVEventSubscriber,
)
from kvroute.router.routing.precise_index import PreciseIndex, precise_salt
from kvroute.router.routing.routing_engine import RoutingEngine
from kvroute.tokenizer_index.hashing import block_hashes
from tests.servers import ServerLoop, SimServer, wait_until

pytestmark = pytest.mark.timeout(90)

BACKEND = "http://127.0.0.1:9"
OTHER = "http://127.0.0.1:10"
BS = 4


def tokens(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 3000, size=length).tolist()


def stored(
    engine_hashes: Sequence[int],
    token_ids: Sequence[int],
    parent: int | None = None,
    *,
    block_size: int = BS,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    medium: str | None = "GPU",
) -> BlockStored:
    return BlockStored(
        block_hashes=list(engine_hashes),
        parent_block_hash=parent,
        token_ids=list(token_ids),
        block_size=block_size,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
    )


def precise_index(*backends: str, **options: Any) -> PreciseIndex:
    index = PreciseIndex(**options)
    for backend in backends:
        index.add_backend(backend)  # tracked, without a subscription: events are applied by hand
        index.set_state(backend, KVEventsState.PRECISE)
    return index


def matched(
    index: PreciseIndex, prompt: Sequence[int], approximate: dict[str, int] | None = None, **key: Any
) -> dict[str, int]:
    return index.match(index.prepare(prompt, **key), approximate or {})


# --------------------------------------------------------------------------- applying events


def test_stored_blocks_match_by_the_routers_own_hash() -> None:
    index = precise_index(BACKEND)
    prompt = tokens(1, 3 * BS + 2)
    index.apply_events(BACKEND, [stored([101, 102, 103], prompt[: 3 * BS])])
    assert matched(index, prompt) == {BACKEND: 3 * BS}
    assert matched(index, prompt[: 2 * BS + 1]) == {BACKEND: 2 * BS}
    assert matched(index, tokens(2, 3 * BS)) == {}
    assert index.blocks(BACKEND) == 3
    assert index.engine_block_size == BS


def test_parent_links_continue_the_chain() -> None:
    index = precise_index(BACKEND)
    prompt = tokens(3, 5 * BS)
    index.apply_events(BACKEND, [stored([1, 2], prompt[: 2 * BS])])
    index.apply_events(BACKEND, [stored([3, 4, 5], prompt[2 * BS :], parent=2)])
    assert matched(index, prompt) == {BACKEND: 5 * BS}
    # A sibling sharing the first two blocks only.
    sibling = prompt[: 2 * BS] + tokens(4, 3 * BS)
    assert matched(index, sibling) == {BACKEND: 2 * BS}
    # The router hash of the engine's chain equals the router's hash of the whole prompt.
    assert index.prepare(prompt).hashes[BS].tolist() == block_hashes(prompt, BS).tolist()


def test_removed_blocks_stop_matching_and_copies_are_counted() -> None:
    index = precise_index(BACKEND)
    prompt = tokens(5, 3 * BS)
    index.apply_events(BACKEND, [stored([1, 2, 3], prompt)])
    index.apply_events(BACKEND, [stored([3], prompt[2 * BS :], parent=2)])  # a second copy of block 3
    index.apply_events(BACKEND, [BlockRemoved(block_hashes=[3])])
    assert matched(index, prompt) == {BACKEND: 3 * BS}  # one copy is left
    index.apply_events(BACKEND, [BlockRemoved(block_hashes=[3])])
    assert matched(index, prompt) == {BACKEND: 2 * BS}
    index.apply_events(BACKEND, [BlockRemoved(block_hashes=[2, 1, 999])])  # 999: never stored
    assert matched(index, prompt) == {}
    assert index.blocks(BACKEND) == index.engine_blocks(BACKEND) == 0


def test_all_blocks_cleared_and_backends_are_separate() -> None:
    index = precise_index(BACKEND, OTHER)
    prompt = tokens(6, 2 * BS)
    index.apply_events(BACKEND, [stored([1, 2], prompt)])
    index.apply_events(OTHER, [stored([7], prompt[:BS])])
    assert matched(index, prompt) == {BACKEND: 2 * BS, OTHER: BS}
    index.apply_events(BACKEND, [AllBlocksCleared()])
    assert matched(index, prompt) == {OTHER: BS}
    # Engine hashes are per backend: the same number on another engine is another block.
    index.apply_events(BACKEND, [stored([7], prompt[:BS])])
    index.apply_events(OTHER, [BlockRemoved(block_hashes=[7])])
    assert matched(index, prompt) == {BACKEND: BS}


def test_cache_salt_and_lora_separate_blocks_like_the_engine() -> None:
    index = precise_index(BACKEND)
    prompt = tokens(7, 2 * BS)
    index.apply_events(BACKEND, [stored([1, 2], prompt, extra_keys=[["tenant-a"], None])])
    index.apply_events(
        BACKEND,
        [stored([3, 4], prompt, lora_name="my-lora", extra_keys=[["my-lora", "tenant-a"], ["my-lora"]])],
    )
    assert matched(index, prompt) == {}
    assert matched(index, prompt, cache_salt="tenant-b") == {}
    assert matched(index, prompt, cache_salt="tenant-a") == {BACKEND: 2 * BS}
    assert matched(index, prompt, model="base-model", cache_salt="tenant-a") == {BACKEND: 2 * BS}
    assert matched(index, prompt, model="my-lora", cache_salt="tenant-a") == {BACKEND: 2 * BS}
    assert matched(index, prompt, model="my-lora") == {}
    # Only the LoRA blocks go when they are evicted.
    index.apply_events(BACKEND, [BlockRemoved(block_hashes=[3])])
    assert matched(index, prompt, model="my-lora", cache_salt="tenant-a") == {}
    assert matched(index, prompt, cache_salt="tenant-a") == {BACKEND: 2 * BS}
    assert precise_salt(None, None) is None and precise_salt(None, "") is None


def test_blocks_no_request_can_name_are_tracked_but_not_indexed() -> None:
    index = precise_index(BACKEND)
    prompt = tokens(8, 3 * BS)
    image = [["image-digest", 0]]
    index.apply_events(BACKEND, [stored([1, 2], prompt[: 2 * BS], extra_keys=[None, image])])
    index.apply_events(BACKEND, [stored([3], prompt[2 * BS :], parent=2)])  # child of an image block
    index.apply_events(BACKEND, [stored([9], prompt[2 * BS :], parent=12345)])  # parent never seen
    index.apply_events(BACKEND, [stored([10], prompt[:BS], medium="CPU")])  # another tier
    assert index.engine_blocks(BACKEND) == 4
    assert index.blocks(BACKEND) == 0
    assert matched(index, prompt) == {}
    index.apply_events(BACKEND, [BlockRemoved(block_hashes=[3, 2, 1, 9])])
    assert index.engine_blocks(BACKEND) == 0


def test_the_engines_block_size_is_used_per_backend() -> None:
    index = precise_index(BACKEND, OTHER)
    prompt = tokens(9, 64)
    index.apply_events(BACKEND, [stored([1, 2], prompt[:32], block_size=16)])
    index.apply_events(OTHER, [stored([1], prompt[:32], block_size=32)])
    prepared = index.prepare(prompt)
    assert sorted(prepared.hashes) == [16, 32]
    assert index.match(prepared, {}) == {BACKEND: 32, OTHER: 32}
    # An engine that restarts with another block size starts over under the new size.
    index.apply_events(OTHER, [stored([5, 6, 7, 8], prompt, block_size=16)])
    assert index.match(index.prepare(prompt), {}) == {BACKEND: 32, OTHER: 64}
    assert index.stats().block_sizes == {BACKEND: 16, OTHER: 16}


def test_malformed_stores_are_ignored() -> None:
    index = precise_index(BACKEND)
    index.apply_events(BACKEND, [stored([1, 2], tokens(10, BS))])  # tokens for one block only
    index.apply_events(BACKEND, [stored([1], tokens(10, BS), block_size=0)])
    index.apply_events(BACKEND, [stored([1], [-1] * BS), stored([2], [2**70] * BS)])  # not token ids
    assert index.engine_blocks(BACKEND) == 0
    prompt = tokens(11, BS)
    index.apply_events(BACKEND, [stored([3], prompt)])  # and the index still works
    assert matched(index, prompt) == {BACKEND: BS}


def test_the_stream_state_decides_which_index_answers() -> None:
    index = precise_index(BACKEND)
    index.set_state(BACKEND, KVEventsState.APPROXIMATE)
    prompt = tokens(11, 4 * BS)
    index.apply_events(BACKEND, [stored([1], prompt[:BS])])
    approximate = {BACKEND: 3 * BS, OTHER: 2 * BS}
    # Not precise yet: the approximate index answers for both.
    assert matched(index, prompt, approximate) == approximate
    index.set_state(BACKEND, KVEventsState.PRECISE)
    assert matched(index, prompt, approximate) == {BACKEND: BS, OTHER: 2 * BS}
    index.set_state(BACKEND, KVEventsState.RECOVERING)
    assert matched(index, prompt, approximate) == {BACKEND: BS, OTHER: 2 * BS}
    # History lost: events where they know more, the approximate index where it does.
    index.set_state(BACKEND, KVEventsState.PARTIAL)
    assert matched(index, prompt, approximate) == {BACKEND: 3 * BS, OTHER: 2 * BS}
    assert matched(index, prompt, {OTHER: 2 * BS}) == {BACKEND: BS, OTHER: 2 * BS}
    index.set_state(BACKEND, KVEventsState.APPROXIMATE)
    assert matched(index, prompt, {OTHER: 2 * BS}) == {OTHER: 2 * BS}


def test_state_changes_are_reported_once() -> None:
    seen: list[tuple[str, KVEventsState]] = []
    index = PreciseIndex(on_state=lambda backend, state: seen.append((backend, state)))
    index.add_backend(BACKEND)
    index.set_state(BACKEND, KVEventsState.PRECISE)
    index.set_state(BACKEND, KVEventsState.PRECISE)
    index.set_state(BACKEND, KVEventsState.APPROXIMATE)
    index.set_state(OTHER, KVEventsState.PRECISE)  # not tracked: ignored
    assert seen == [
        (BACKEND, KVEventsState.APPROXIMATE),  # exported from the start
        (BACKEND, KVEventsState.PRECISE),
        (BACKEND, KVEventsState.APPROXIMATE),
    ]
    assert index.states() == {BACKEND: KVEventsState.APPROXIMATE}
    index.remove_backend(BACKEND)
    index.set_state(BACKEND, KVEventsState.PRECISE)  # a late word from a stopped subscriber
    assert index.states() == {} and len(seen) == 3


def test_speculative_blocks_bridge_the_gap_until_events_arrive() -> None:
    now = [1000.0]
    index = precise_index(BACKEND, OTHER, speculative_ttl_s=2.0, clock=lambda: now[0])
    index.apply_events(BACKEND, [stored([1], tokens(12, BS))])  # learns the block size
    index.apply_events(OTHER, [stored([1], tokens(13, BS))])
    prompt = tokens(14, 3 * BS)
    prepared = index.prepare(prompt)
    index.speculate(BACKEND, prepared)
    sibling = prompt[: 2 * BS] + tokens(15, BS)
    assert matched(index, sibling) == {BACKEND: 2 * BS}
    # The engine confirms two blocks, then evicts the second: the guess beyond it goes too.
    index.apply_events(BACKEND, [stored([21, 22], prompt[: 2 * BS])])
    index.apply_events(BACKEND, [BlockRemoved(block_hashes=[22])])
    assert matched(index, prompt) == {BACKEND: BS}
    # Unconfirmed guesses expire; confirmed blocks stay.
    index.speculate(OTHER, prepared)
    assert matched(index, prompt)[OTHER] == 3 * BS
    now[0] += 2.5
    assert matched(index, prompt) == {BACKEND: BS}
    assert index.stats().speculative_blocks == {BACKEND: 0, OTHER: 0}


def test_the_speculative_ttl_counts_from_the_engines_answer() -> None:
    """A request that waited in the engine's queue longer than ``speculative_ttl_s`` has
    lost its guesses when it is answered, and the engine may publish its stored blocks
    after the answer: the answer holds them again for a TTL, so the next turn, sent at
    once, finds its history (a vLLM e2e run on a loaded CPU predicted only the system
    prompt). An error answer computed nothing and holds nothing; blocks the events
    confirmed are not held twice."""
    now = [1000.0]
    precise = precise_index("http://b0", speculative_ttl_s=2.0, clock=lambda: now[0])
    routing = RoutingEngine(Settings(policy="cache_aware"), precise=precise)
    backends = [Backend("http://b0")]
    precise.apply_events("http://b0", [stored([1], tokens(50, 32), block_size=32)])  # its block size
    prompt = tokens(51, 96)

    def next_turn() -> int:
        body = {"model": "sim", "prompt": prompt + tokens(52, 40), "max_tokens": 4}
        return routing.route("/v1/completions", body, {}, backends).predicted_cached_tokens

    for answered, held in ((True, 96), (False, 0)):
        plan = routing.route("/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 4}, {}, backends)
        now[0] += 3.0  # queued past the TTL: the guesses expired
        assert precise.stats().speculative_blocks == {"http://b0": 0}
        assert routing.observe(plan, 0, answered=answered) == ()
        assert precise.stats().answers_before_events == {"http://b0": 1}
        assert next_turn() == held
        now[0] += 2.5  # no events came: the answer's hold expires too
        assert next_turn() == 0
        now[0] += 2.5
    # Events confirmed the prompt before the answer: nothing more to hold.
    plan = routing.route("/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 4}, {}, backends)
    now[0] += 3.0
    precise.apply_events("http://b0", [stored([2, 3, 4], prompt, block_size=32)])
    routing.observe(plan, 0)
    assert precise.stats().speculative_blocks == {"http://b0": 0}
    assert precise.stats().answers_before_events == {"http://b0": 1}
    assert next_turn() == 96
    # A stream that is not usable has no events to wait for: nothing held, nothing counted.
    precise.set_state("http://b0", KVEventsState.APPROXIMATE)
    plan = routing.route("/v1/completions", {"model": "sim", "prompt": tokens(53, 96), "max_tokens": 4}, {}, backends)
    now[0] += 3.0
    routing.observe(plan, 0)
    assert precise.stats().speculative_blocks == {"http://b0": 0}
    assert precise.stats().answers_before_events == {"http://b0": 1}


def test_how_long_events_lag_behind_answers_is_timed() -> None:
    """For an answer that came before its events, the time until the event that stores the
    prompt's last block (``on_event_lag``): what tells an operator whether
    ``speculative_ttl_s`` covers the engine's lag. An answer after its events is not timed."""
    now = [1000.0]
    lags: list[tuple[str, float]] = []
    precise = precise_index(
        "http://b0", speculative_ttl_s=2.0, clock=lambda: now[0], on_event_lag=lambda *lag: lags.append(lag)
    )
    routing = RoutingEngine(Settings(policy="cache_aware"), precise=precise)
    backends = [Backend("http://b0")]
    precise.apply_events("http://b0", [stored([1], tokens(60, 32), block_size=32)])  # its block size
    prompt = tokens(61, 96)
    body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
    routing.observe(routing.route("/v1/completions", body, {}, backends), 0)
    now[0] += 0.25
    precise.apply_events("http://b0", [stored([2, 3], prompt[:64], block_size=32)])
    assert lags == []  # not the last block yet
    now[0] += 0.25
    precise.apply_events("http://b0", [stored([4], prompt[64:], parent=3, block_size=32)])
    assert lags == [("http://b0", 0.5)]
    routing.observe(routing.route("/v1/completions", body, {}, backends), 64)
    precise.apply_events("http://b0", [stored([4], prompt[64:], parent=3, block_size=32)])  # a copy
    assert lags == [("http://b0", 0.5)]


def test_a_long_prompts_speculative_blocks_go_in_slices_and_end_as_one_insert(monkeypatch: pytest.MonkeyPatch) -> None:
    """``route(sliced=True)`` in precise mode: the speculative layer gets the last slice at
    once and the rest through ``learn_slice``, after the approximate index's slices; both
    end as one insert leaves them."""
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    prompt = tokens(16, 20 * BS)
    body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
    engines = []
    for _ in range(2):
        precise = precise_index(BACKEND)
        precise.apply_events(BACKEND, [stored([1], tokens(12, BS))])  # learns the block size
        engines.append((precise, RoutingEngine(Settings(policy="cache_aware", block_size=BS), precise=precise)))
    (whole_precise, whole), (sliced_precise, sliced) = engines
    at_once = whole.route("/v1/completions", body, {}, [Backend(BACKEND)])
    plan = sliced.route("/v1/completions", body, {}, [Backend(BACKEND)], sliced=True)
    assert at_once.pending_inserts == () and len(plan.pending_inserts) == 2
    assert sliced_precise.stats().speculative_blocks == {BACKEND: 4}
    slices = 3  # route's two, and learn_slice's last (which says none are left)
    while sliced.learn_slice(plan):
        slices += 1
    assert slices == 2 * 5 and plan.pending_inserts == ()  # 20 blocks in 5 slices, twice
    assert sliced_precise.stats().speculative_blocks == whole_precise.stats().speculative_blocks == {BACKEND: 20}
    assert matched(sliced_precise, prompt) == matched(whole_precise, prompt) == {BACKEND: 20 * BS}


def test_endpoints_are_configured_or_derived() -> None:
    index = PreciseIndex(events_port=5557, replay_port=5567)
    assert index.endpoints("http://10.0.0.7:8000") == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5567")
    assert index.endpoints("http://[fd00::1]:8000")[0] == "tcp://[fd00::1]:5557"  # type: ignore[index]
    assert index.endpoints("http://a:1", "tcp://b:6000") == ("tcp://b:6000", "tcp://b:5567")
    assert index.endpoints("http://a:1", "tcp://b:6000", "tcp://c:7000") == ("tcp://b:6000", "tcp://c:7000")
    assert PreciseIndex().endpoints("http://a:1") is None
    assert PreciseIndex().endpoints("http://a:1", "tcp://b:1") == ("tcp://b:1", None)
    # Rank r of a data-parallel engine publishes r ports above the engine's ports.
    assert index.endpoints("http://10.0.0.7:8000#dp1") == ("tcp://10.0.0.7:5558", "tcp://10.0.0.7:5568")


def test_the_routing_engine_predicts_from_events_with_the_engines_block_size() -> None:
    """Through ``RoutingEngine``: a backend with a live stream is matched from its events,
    under the engine's block size (32 here, the router's default being 16), and the
    prediction is capped as vLLM caps ``cached_tokens`` (never the block holding the last
    prompt token); a backend without a stream is matched from the approximate index."""
    precise = precise_index("http://b0")
    precise.add_backend("http://b1")
    routing = RoutingEngine(Settings(policy="cache_aware"), precise=precise)
    backends = [Backend("http://b0"), Backend("http://b1")]
    prompt = tokens(30, 64)
    precise.apply_events("http://b0", [stored([1, 2], prompt, block_size=32)])
    assert precise.engine_block_size == 32
    body = {"model": "sim", "prompt": prompt, "max_tokens": 4}
    plan = routing.route("/v1/completions", body, {}, backends)
    assert plan.backend == "http://b0"
    assert plan.predicted_cached_tokens == 32  # 64 tokens held, the last block recomputed
    assert plan.prompt is not None and plan.prompt.block_size == 32
    longer = {"model": "sim", "prompt": prompt + tokens(31, 10), "max_tokens": 4}
    assert routing.route("/v1/completions", longer, {}, backends).predicted_cached_tokens == 64
    stats = routing.index_stats()
    assert stats.blocks["http://b0"] == 2 and stats.bytes > 0


def test_the_engines_metrics_tell_the_block_size_before_its_first_event() -> None:
    """Before an engine has stored anything, its block size from its metrics (vLLM's
    ``cache_config_info``) lets the router hold the first requests' blocks speculatively:
    a burst of prompts sharing a prefix predicts it from the second on, as vLLM, which
    shares blocks of running requests, will report (the e2e tier's first turns did not)."""
    precise = precise_index("http://b0")
    routing = RoutingEngine(Settings(policy="cache_aware"), precise=precise)
    backends = [Backend("http://b0")]
    shared = tokens(40, 96)
    first = {"model": "sim", "prompt": shared + tokens(41, 8), "max_tokens": 4}
    second = {"model": "sim", "prompt": shared + tokens(42, 8), "max_tokens": 4}
    assert routing.route("/v1/completions", first, {}, backends).predicted_cached_tokens == 0
    assert routing.route("/v1/completions", second, {}, backends).predicted_cached_tokens == 0  # no block size yet
    routing.update_engine_stats("http://b0", EngineStats(kind="vllm", block_size=32))
    assert precise.engine_block_size == 32
    routing.route("/v1/completions", first, {}, backends)
    assert routing.route("/v1/completions", second, {}, backends).predicted_cached_tokens == 96
    # The first stored event confirms it; one of another size would start the backend over.
    precise.apply_events("http://b0", [stored([1], tokens(43, 32), block_size=32)])
    assert precise.engine_block_size == 32


def test_on_a_precise_backend_the_engines_report_checks_the_routers_own_model() -> None:
    """Events make the prediction exact, so an eviction can only show against the router's
    own model of the cache (the approximate index beside them). Its eviction rate weighs
    the capacity term on a precise backend as on any other (it used to count in full there,
    which kept 2 x 8K-token sims at 0.741-0.747 in lockstep against 0.784-0.788 approximate)."""
    precise = precise_index("http://b0")
    routing = RoutingEngine(Settings(policy="cache_aware"), precise=precise)
    backends = [Backend("http://b0", capacity_tokens=4096)]
    precise.apply_events("http://b0", [stored([1], tokens(29, 32), block_size=32)])  # its block size
    prompt = tokens(30, 96)
    first = routing.route("/v1/completions", {"model": "sim", "prompt": prompt, "max_tokens": 4}, {}, backends)
    assert (first.predicted_cached_tokens, first.modelled_cached_tokens) == (0, 0)
    routing.observe(first, 0)
    # The engine stored the prompt's three blocks and has evicted them since.
    precise.apply_events("http://b0", [stored([2, 3, 4], prompt, block_size=32), BlockRemoved(block_hashes=[2, 3, 4])])
    body = {"model": "sim", "prompt": prompt + tokens(31, 40), "max_tokens": 4}
    second = routing.route("/v1/completions", body, {}, backends)
    assert second.predicted_cached_tokens == 0  # exact: nothing is left
    assert second.modelled_cached_tokens == 96  # the router's model still holds all of it
    assert routing.cache_model.eviction_rate("http://b0") is None
    routing.observe(second, 0)
    rate = routing.cache_model.eviction_rate("http://b0")
    assert rate is not None and rate > 0
    assert routing.feedback.drifts == 1  # and the model corrected its capacity
    third = routing.route("/v1/completions", {"model": "sim", "prompt": tokens(32, 64)}, {}, backends)
    assert third.request.eviction_rates == {"http://b0": rate}


# --------------------------------------------------------------------------- with sim engines


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class EventedSim:
    """A sim engine publishing KV events (bound on its own ports), and where to subscribe."""

    server: SimServer
    events_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def published(self) -> int:
        """Batches the engine has published so far."""
        return int(self.server.loop.call(lambda: self.server.engine.publisher.next_sequence))  # type: ignore[union-attr]

    def blocks(self) -> int:
        """Blocks in the engine's own cache."""
        return int(self.server.loop.call(lambda: self.server.engine.cache.blocks))  # type: ignore[union-attr]

    def cached_tokens(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens of ``prompt`` the engine's own cache holds (whole blocks)."""
        return self.cached_tokens_of([prompt], cache_salt)[0]

    def cached_tokens_of(self, prompts: Sequence[Sequence[int]], cache_salt: str | None = None) -> list[int]:
        """:meth:`cached_tokens` of many prompts, read in one go on the engine's loop."""

        def read() -> list[int]:
            engine = self.server.engine
            cache = engine.cache
            assert cache is not None
            key = engine.cache_key(engine.config.models[0], cache_salt)
            return [cache.cached_blocks(cache.hashes(np.asarray(prompt), key)) * cache.block_size for prompt in prompts]

        return list(self.server.loop.call(read))

    @functools.cached_property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, timeout=60)

    def complete(self, prompt: Sequence[int], **extra: Any) -> None:
        self.client.completions.create(model="sim", prompt=list(prompt), max_tokens=2, **extra)


@pytest.fixture
def evented_sims(sim_engines: Callable[..., list[SimServer]]) -> Callable[..., list[EventedSim]]:
    """Factory: ``evented_sims(n, **SimEngineConfig fields)``; fixed ``events_port``,
    ``replay_port`` and ``port`` bring a stopped engine back at the same addresses."""

    def start(
        n: int = 1, events_port: int | None = None, replay_port: int | None = None, **options: Any
    ) -> list[EventedSim]:
        sims = []
        for _ in range(n):
            port, replay = events_port or free_port(), replay_port or free_port()
            (server,) = sim_engines(
                1,
                kv_events_endpoint=f"tcp://*:{port}",
                kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}",
                **options,
            )
            sims.append(EventedSim(server, port, replay))
        return sims

    return start


class RunningIndex:
    """A ``PreciseIndex`` running on the servers' event loop, as inside a router."""

    def __init__(self, loop: ServerLoop, index: PreciseIndex) -> None:
        self.loop = loop
        self.index = index

    def call(self, function: Callable[[], Any]) -> Any:
        return self.loop.call(function)

    def subscriber(self, sim: EventedSim) -> KVEventSubscriber:
        subscriber = self.index.subscriber(sim.url)
        assert subscriber is not None
        return subscriber

    def match(self, prompt: Sequence[int], **key: Any) -> dict[str, int]:
        return self.matches([prompt], **key)[0]

    def matches(self, prompts: Sequence[Sequence[int]], **key: Any) -> list[dict[str, int]]:
        """Matched tokens per backend of each prompt, read in one go on the index's loop."""
        index = self.index
        return list(self.call(lambda: [index.match(index.prepare(prompt, **key), {}) for prompt in prompts]))

    def blocks(self, sim: EventedSim) -> int:
        return int(self.call(lambda: self.index.blocks(sim.url)))

    def state(self, sim: EventedSim) -> KVEventsState:
        return self.call(lambda: self.index.state(sim.url))

    def catch_up(self, sim: EventedSim) -> None:
        """Wait until every batch the engine published has been applied."""
        subscriber = self.subscriber(sim)
        wait_until(lambda: self.call(lambda: subscriber.expected_seq or 0) == sim.published(), timeout=30)

    def go_live(self, sim: EventedSim) -> None:
        """Wait until the subscription carries messages. ZeroMQ drops what is published
        before a subscription lands, so the engine is poked until a batch arrives."""
        subscriber = self.subscriber(sim)
        for attempt in range(200):
            if self.call(lambda: subscriber.stats.messages) > 0:
                return
            sim.complete(tokens(900_000 + attempt, 40))  # full blocks at any block size up to 40
            time.sleep(0.05)
        raise AssertionError("no KV event reached the subscriber")


@pytest.fixture
def running_index(server_loop: ServerLoop) -> Iterator[Callable[..., RunningIndex]]:
    """Factory: ``running_index(sims, replay=True, **PreciseIndex options)``, started."""
    started: list[RunningIndex] = []

    def start(sims: Sequence[EventedSim], replay: bool = True, **options: Any) -> RunningIndex:
        async def build() -> PreciseIndex:
            index = PreciseIndex(**options)
            for sim in sims:
                index.add_backend(sim.url, sim.events, sim.replay if replay else None)
            await index.start()
            return index

        running = RunningIndex(server_loop, server_loop.run(build()))
        started.append(running)
        return running

    yield start
    for running in started:
        server_loop.run(running.index.stop())


def workload(seed: int, count: int, block_size: int, longest: int = 200) -> list[list[int]]:
    """Prompts sharing prefixes (three system prompts, growing conversations) and strays."""
    rng = np.random.default_rng(seed)
    systems = [tokens(seed * 100 + i, 3 * block_size) for i in range(3)]
    prompts: list[list[int]] = []
    for i in range(count):
        tail = tokens(seed * 1000 + i, int(rng.integers(1, 4 * block_size)))
        base = prompts[int(rng.integers(len(prompts)))] if prompts and rng.random() < 0.4 else None
        if base is None or len(base) + len(tail) > longest:
            base = systems[int(rng.integers(len(systems)))]
        prompts.append(base + tail)
    return prompts


def assert_index_equals_engine(running: RunningIndex, sim: EventedSim, prompts: Sequence[Sequence[int]]) -> None:
    running.catch_up(sim)
    assert running.blocks(sim) == sim.blocks()
    predicted = [matched.get(sim.url, 0) for matched in running.matches(prompts)]
    assert predicted == sim.cached_tokens_of(prompts)
    assert any(predicted)


@pytest.mark.parametrize("event_format", ["map", "array"])
@pytest.mark.parametrize(("api", "block_size"), [("vllm", 8), ("sglang", 8), ("sglang", 1)])
def test_index_equals_the_engines_cache_under_eviction_pressure(
    evented_sims: Callable[..., list[EventedSim]],
    running_index: Callable[..., RunningIndex],
    event_format: str,
    api: str,
    block_size: int,
) -> None:
    # SGLang's events: one per page (at page size 1, per token) under its own SHA-256 hashes.
    (sim,) = evented_sims(1, block_size=block_size, kv_capacity_tokens=8 * 40, kv_events_format=event_format, api=api)
    running = running_index([sim])
    running.go_live(sim)
    prompts = workload(1, 150, 8)
    assert sum(len(prompt) // 8 for prompt in prompts) > 10 * 40  # far more than the cache holds
    for prompt in prompts:
        sim.complete(prompt)
    assert_index_equals_engine(running, sim, prompts)
    assert running.state(sim) is KVEventsState.PRECISE
    assert running.call(lambda: running.subscriber(sim).stats.gaps) == 0


def test_a_late_subscriber_replays_the_engines_history(
    evented_sims: Callable[..., list[EventedSim]], running_index: Callable[..., RunningIndex]
) -> None:
    (sim,) = evented_sims(1, block_size=8, kv_capacity_tokens=8 * 64)
    prompts = workload(2, 30, 8)
    for prompt in prompts:  # nobody listens yet: every one of these batches is lost
        sim.complete(prompt)
    running = running_index([sim])
    running.go_live(sim)
    assert_index_equals_engine(running, sim, prompts)
    assert running.state(sim) is KVEventsState.PRECISE
    assert running.call(lambda: running.subscriber(sim).stats.replayed_messages) > len(prompts) // 2


class DroppingSubscriber(KVEventSubscriber):
    """A subscriber that loses chosen messages, as a congested network would."""

    drop: frozenset[int] = frozenset()

    async def handle_message(self, frames: Sequence[bytes]) -> None:
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            self.drop = self.drop - {seq}
            return
        await super().handle_message(frames)


def _drop_next(running: RunningIndex, sim: EventedSim, offsets: set[int]) -> DroppingSubscriber:
    subscriber = running.subscriber(sim)
    assert isinstance(subscriber, DroppingSubscriber)

    def arm() -> None:
        start = subscriber.expected_seq or 0
        subscriber.drop = frozenset(start + offset for offset in offsets)

    running.call(arm)
    return subscriber


def test_dropped_messages_are_recovered_by_replay(
    evented_sims: Callable[..., list[EventedSim]],
    running_index: Callable[..., RunningIndex],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (sim,) = evented_sims(1, block_size=8, kv_capacity_tokens=8 * 48)
    monkeypatch.setattr("kvroute.router.routing.precise_index.KVEventSubscriber", DroppingSubscriber)
    running = running_index([sim])
    running.go_live(sim)
    subscriber = _drop_next(running, sim, {1, 2, 7})
    prompts = workload(3, 40, 8)
    for prompt in prompts:
        sim.complete(prompt)
    assert_index_equals_engine(running, sim, prompts)
    stats = running.call(lambda: subscriber.stats)
    assert stats.gaps == 2 and stats.replayed_messages >= 3 and stats.unrecoverable_gaps == 0
    assert running.state(sim) is KVEventsState.PRECISE


def _partial_stream(
    evented_sims: Callable[..., list[EventedSim]],
    running_index: Callable[..., RunningIndex],
    monkeypatch: pytest.MonkeyPatch,
    *,
    lost: int,
    seed: int,
) -> tuple[EventedSim, RunningIndex, DroppingSubscriber, list[list[int]]]:
    """A sim's stream without a replay socket that loses its ``lost``-th next batch while 12
    prompts of ``workload(seed)`` are served: partial from then on."""
    (sim,) = evented_sims(1, block_size=8, kv_capacity_tokens=8 * 48)
    monkeypatch.setattr("kvroute.router.routing.precise_index.KVEventSubscriber", DroppingSubscriber)
    running = running_index([sim], replay=False)
    running.go_live(sim)
    subscriber = _drop_next(running, sim, {lost})
    prompts = workload(seed, 12, 8)
    for prompt in prompts:
        sim.complete(prompt)
    running.catch_up(sim)
    assert running.state(sim) is KVEventsState.PARTIAL
    return sim, running, subscriber, prompts


def test_gaps_without_a_replay_socket_clear_and_go_partial(
    evented_sims: Callable[..., list[EventedSim]],
    running_index: Callable[..., RunningIndex],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim, running, subscriber, prompts = _partial_stream(evented_sims, running_index, monkeypatch, lost=3, seed=4)
    assert running.call(lambda: subscriber.stats.unrecoverable_gaps) == 1
    # Cleared at the gap: whatever it still holds, the engine holds too.
    for prompt in prompts:
        assert running.match(prompt).get(sim.url, 0) <= sim.cached_tokens(prompt)


def test_an_emptied_cache_completes_a_partial_stream(
    evented_sims: Callable[..., list[EventedSim]],
    running_index: Callable[..., RunningIndex],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim, running, _, _ = _partial_stream(evented_sims, running_index, monkeypatch, lost=2, seed=8)
    # The engine drops everything it held, as after POST /reset_prefix_cache: every block it
    # holds from then on was announced in a batch the router applied.
    httpx.post(sim.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    after = workload(9, 30, 8)
    for prompt in after:
        sim.complete(prompt)
    running.catch_up(sim)
    assert running.state(sim) is KVEventsState.PRECISE
    assert_index_equals_engine(running, sim, after)


def test_an_engine_restart_clears_its_blocks(
    evented_sims: Callable[..., list[EventedSim]], running_index: Callable[..., RunningIndex]
) -> None:
    (sim,) = evented_sims(1, block_size=8, kv_capacity_tokens=8 * 64)
    running = running_index([sim])
    running.go_live(sim)
    before = workload(5, 20, 8)
    for prompt in before:
        sim.complete(prompt)
    running.catch_up(sim)
    assert running.blocks(sim) > 0

    sim.server.stop()
    wait_until(lambda: running.state(sim) is KVEventsState.APPROXIMATE, timeout=30)
    # The engine comes back at the same addresses, with an empty cache and sequence from 0.
    (restarted,) = evented_sims(
        1,
        port=urlsplit(sim.url).port,
        events_port=sim.events_port,
        replay_port=sim.replay_port,
        block_size=8,
        kv_capacity_tokens=8 * 64,
    )
    assert restarted.url == sim.url
    after = workload(6, 5, 8)
    for attempt in range(200):
        restarted.complete(after[attempt % len(after)])
        if running.state(restarted) is KVEventsState.PRECISE:
            break
        time.sleep(0.05)
    assert_index_equals_engine(running, restarted, before + after)
    assert running.call(lambda: running.subscriber(restarted).stats.restarts) == 1


def test_reset_prefix_cache_clears_the_index(
    evented_sims: Callable[..., list[EventedSim]], running_index: Callable[..., RunningIndex]
) -> None:
    (sim,) = evented_sims(1, block_size=8)
    running = running_index([sim])
    running.go_live(sim)
    for prompt in workload(7, 10, 8):
        sim.complete(prompt)
    running.catch_up(sim)
    assert running.blocks(sim) > 0
    httpx.post(sim.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    running.catch_up(sim)
    assert running.blocks(sim) == sim.blocks() == 0


def test_salted_requests_match_only_salted_blocks_of_a_real_engine(
    evented_sims: Callable[..., list[EventedSim]], running_index: Callable[..., RunningIndex]
) -> None:
    (sim,) = evented_sims(1, block_size=8)
    running = running_index([sim])
    running.go_live(sim)
    prompt = tokens(16, 40)
    sim.complete(prompt, extra_body={"cache_salt": "tenant-a"})
    running.catch_up(sim)
    assert running.match(prompt, cache_salt="tenant-a").get(sim.url) == sim.cached_tokens(prompt, "tenant-a") == 40
    assert running.match(prompt).get(sim.url, 0) == sim.cached_tokens(prompt) == 0


def test_the_stream_falls_back_when_silent_while_requests_go_there(
    evented_sims: Callable[..., list[EventedSim]], running_index: Callable[..., RunningIndex]
) -> None:
    (sim,) = evented_sims(1, block_size=8)
    running = running_index([sim], silence_s=0.5)
    running.go_live(sim)
    running.catch_up(sim)
    time.sleep(1.0)  # idle: an unchanged cache is not a silent stream
    assert running.state(sim) is KVEventsState.PRECISE
    running.call(lambda: running.index.speculate(sim.url, running.index.prepare(tokens(17, 16))))
    wait_until(lambda: running.state(sim) is KVEventsState.APPROXIMATE, timeout=30)
    sim.complete(tokens(18, 24))  # events flow again
    wait_until(lambda: running.state(sim) is KVEventsState.PRECISE, timeout=30)


def test_two_routers_on_the_same_engines_agree(
    evented_sims: Callable[..., list[EventedSim]], running_index: Callable[..., RunningIndex]
) -> None:
    sims = evented_sims(2, block_size=8, kv_capacity_tokens=8 * 40)
    first = running_index(sims)
    for sim in sims:
        first.go_live(sim)
    prompts = workload(8, 40, 8)
    for i, prompt in enumerate(prompts[:20]):
        sims[i % 2].complete(prompt)
    # The second router starts late, replays the history, then both follow the live streams.
    second = running_index(sims)
    for sim in sims:
        second.go_live(sim)
    for i, prompt in enumerate(prompts[20:]):
        sims[i % 2].complete(prompt)
    for sim in sims:
        first.catch_up(sim)
        second.catch_up(sim)
        assert first.blocks(sim) == second.blocks(sim) == sim.blocks()
    assert first.matches(prompts) == second.matches(prompts)


# --------------------------------------------------------------------------- through routers


def test_the_next_turn_finds_its_history_when_the_engine_answers_before_its_events(
    evented_sims: Callable[..., list[EventedSim]], router_server: Callable[..., Any]
) -> None:
    """An engine that publishes its events after its answers (vLLM often does; the sim with
    ``kv_events_delay_s``), and a turn that takes longer than ``speculative_ttl_s``: the
    router holds the answered prompt's blocks again from the answer, so the conversation's
    next turn, sent at once, is predicted its whole history, as the engine then reports."""
    (sim,) = evented_sims(1, kv_events_delay_s=3.0, time_scale=1.0)
    router = router_server(
        policy="cache_aware",
        kv_events=True,
        speculative_ttl_s=0.3,
        backends=[{"url": sim.url, "kv_events_endpoint": sim.events, "kv_events_replay_endpoint": sim.replay}],
    )
    RunningIndex(router.loop, router.state.precise).go_live(sim)  # type: ignore[arg-type]
    client = router.client()
    first = tokens(70, 200)
    started = time.monotonic()
    client.completions.create(model="sim", prompt=first, max_tokens=20)  # 20 tokens at 50/s: 0.4 s
    assert time.monotonic() - started > 0.3  # the routing's speculative blocks have expired
    raw = client.completions.with_raw_response.create(model="sim", prompt=first + tokens(71, 40), max_tokens=2)
    assert raw.parse().usage.prompt_tokens_details.cached_tokens == 192  # type: ignore[union-attr]
    assert int(raw.headers["x-kvroute-matched-tokens"]) == 192
    early = router.metrics().value("kvroute_kv_events_total", backend=sim.url, event="answers_before_events")
    assert early >= 1
    # The events come ~3 s after the turn's prefill, ~2.6 s after its answer: timed.
    wait_until(lambda: router.metrics().value("kvroute_kv_events_lag_seconds_count", backend=sim.url) >= 1, timeout=15)
    scrape = router.metrics()
    count = scrape.value("kvroute_kv_events_lag_seconds_count", backend=sim.url)
    assert 1.0 < scrape.value("kvroute_kv_events_lag_seconds_sum", backend=sim.url) / count < 10.0
    assert scrape.value("kvroute_kv_events_lag_seconds_bucket", backend=sim.url, le="1.0") == 0


def test_two_routers_serving_the_same_engines_converge_and_decide_alike(
    evented_sims: Callable[..., list[EventedSim]], router_server: Callable[..., Any]
) -> None:
    """Two routers (as ``kvroute serve --kv-events``) in front of the same two engines, each
    sent half of the traffic: both export the same ``kvroute_index_blocks`` per backend,
    equal to the engines' own caches, and route the same request to the same backend."""
    sims = evented_sims(2, kv_capacity_tokens=16 * 48)
    settings = {
        "policy": "cache_aware",
        "kv_events": True,
        "speculative_ttl_s": 0.5,
        "backends": [
            {"url": sim.url, "kv_events_endpoint": sim.events, "kv_events_replay_endpoint": sim.replay} for sim in sims
        ],
    }
    routers = [router_server(**settings), router_server(**settings)]
    for router in routers:
        precise = router.state.precise
        assert precise is not None
        running = RunningIndex(router.loop, precise)
        for sim in sims:
            running.go_live(sim)
    prompts = workload(9, 60, 16, longest=400)
    clients = [router.client() for router in routers]
    for i, prompt in enumerate(prompts):
        clients[i % 2].completions.create(model="sim", prompt=prompt, max_tokens=2)
    time.sleep(1.0)  # past speculative_ttl_s: only what the engines announced is left
    for router in routers:
        running = RunningIndex(router.loop, router.state.precise)  # type: ignore[arg-type]
        for sim in sims:
            running.catch_up(sim)
    scrapes = [router.metrics() for router in routers]
    for sim in sims:
        engine_blocks = sim.blocks()
        assert engine_blocks > 0
        for scrape in scrapes:
            assert scrape.value("kvroute_index_blocks", backend=sim.url) == engine_blocks
            assert scrape.value("kvroute_kv_events_state", backend=sim.url) == KVEventsState.PRECISE
            # The stream's counters: every batch the engine published was applied, none lost.
            assert scrape.value("kvroute_kv_events_total", backend=sim.url, event="messages") == sim.published()
            assert scrape.value("kvroute_kv_events_total", backend=sim.url, event="unrecoverable_gaps") == 0
            assert "answers_before_events" in scrape.label_values("kvroute_kv_events_total", "event")
            assert scrape.value("kvroute_kv_events_total", backend=sim.url, event="answers_before_events") <= 60
    # The same request, asked of each router: the same backend, the same prediction. The
    # requests are prompts an engine holds whole, so answering them stores nothing new and
    # the engines (and both indexes) stay as they are between the two routers' answers.
    held = [p for p in prompts if any(sim.cached_tokens(p) == len(p) // 16 * 16 for sim in sims)]
    assert len(held) >= 5
    for prompt in held[-12:]:
        answers = []
        for client in clients:
            raw = client.completions.with_raw_response.create(model="sim", prompt=prompt, max_tokens=1)
            answers.append((raw.headers["x-kvroute-backend"], int(raw.headers["x-kvroute-matched-tokens"])))
        assert answers[0] == answers[1]
        backend, matched = answers[0]
        assert matched == (len(prompt) - 1) // 16 * 16  # the whole prompt but its last token
        assert next(sim for sim in sims if sim.url == backend).cached_tokens(prompt) >= matched
