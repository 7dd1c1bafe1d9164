"""PrefixIndex against the naive reference model (tests/reference_index.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvroute.tokenizer_index import PrefixIndex, bucket_table, prefix_index
from kvroute.tokenizer_index.hashing import block_hashes
from kvroute.tokenizer_index.prefix_index import IndexStats
from tests.tokenizer_index.reference_index import ReferenceIndex

BLOCK = 2
BACKENDS = st.sampled_from(["a", "b", "c", "d"])
# A three-letter alphabet and two-token blocks: sequences share prefixes all the time.
TOKENS = st.lists(st.integers(0, 2), max_size=24)
SALTS = st.sampled_from([None, "lora-1"])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    """Collects on_evict calls as plain lists."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def __call__(self, backend: str, hashes: np.ndarray | list[int]) -> None:
        self.calls.append((backend, [int(value) for value in hashes]))


class Pair:
    """The real index and the reference, driven together."""

    def __init__(self, capacity: int | None = None, ttl_s: float | None = None) -> None:
        self.clock = FakeClock()
        self.real_evictions, self.model_evictions = Recorder(), Recorder()
        self.real = PrefixIndex(BLOCK, capacity, ttl_s, self.real_evictions, clock=self.clock)
        self.model = ReferenceIndex(BLOCK, capacity, ttl_s, self.model_evictions, clock=self.clock)

    def hashes(self, tokens: list[int], salt: str | None = None) -> np.ndarray:
        return block_hashes(tokens, BLOCK, salt)

    def check(self) -> None:
        assert self.real_evictions.calls == self.model_evictions.calls
        names = self.model.backends()
        assert sorted(self.real.backends()) == sorted(names)
        stats = self.real.stats()
        assert stats.blocks == {name: self.model.blocks(name) for name in names}
        assert stats.unique_blocks == self.model.unique_blocks()
        for name in names:
            assert self.real.blocks(name) == self.model.blocks(name)


class IndexMachine(RuleBasedStateMachine):
    """Random operation sequences; every answer must equal the reference's."""

    capacity: int | None = None
    ttl_s: float | None = None

    @initialize()
    def start(self) -> None:
        self.pair = Pair(self.capacity, self.ttl_s)

    @rule(backend=BACKENDS, tokens=TOKENS, salt=SALTS)
    def insert(self, backend: str, tokens: list[int], salt: str | None) -> None:
        self.pair.real.insert(backend, tokens, salt=salt)
        self.pair.model.insert(backend, tokens, salt)

    @rule(backend=BACKENDS, tokens=TOKENS, salt=SALTS, remove_first=st.booleans())
    def match_then_insert(self, backend: str, tokens: list[int], salt: str | None, remove_first: bool) -> None:
        """The router's pattern: match a prompt, then insert the same hashes (the index
        reuses the match's lookups unless the table changed in between)."""
        hashes = self.pair.hashes(tokens, salt)
        assert self.pair.real.match_hashes(hashes) == self.pair.model.match_hashes(hashes.tolist())
        if remove_first:
            self.pair.real.remove_blocks(backend, hashes[:1])
            self.pair.model.remove_blocks(backend, hashes[:1].tolist())
        self.pair.real.insert_hashes(backend, hashes)
        self.pair.model.insert_hashes(backend, hashes.tolist())

    @rule(backend=BACKENDS, tokens=TOKENS, start=st.integers(0, 12), length=st.integers(0, 12))
    def insert_chunk(self, backend: str, tokens: list[int], start: int, length: int) -> None:
        """A run of blocks that need not start at the head (a KV event's BlockStored)."""
        chunk = self.pair.hashes(tokens)[start : start + length]
        self.pair.real.insert_hashes(backend, chunk)
        self.pair.model.insert_hashes(backend, chunk.tolist())

    @rule(tokens=TOKENS, salt=SALTS)
    def match(self, tokens: list[int], salt: str | None) -> None:
        assert self.pair.real.match(tokens, salt=salt) == self.pair.model.match(tokens, salt)

    @rule(backend=BACKENDS, tokens=TOKENS, picks=st.lists(st.integers(0, 11), max_size=6))
    def remove_blocks(self, backend: str, tokens: list[int], picks: list[int]) -> None:
        hashes = self.pair.hashes(tokens)
        chosen = [int(hashes[i]) for i in picks if i < len(hashes)]
        self.pair.real.remove_blocks(backend, np.array(chosen, dtype=np.uint64))
        self.pair.model.remove_blocks(backend, chosen)

    @rule(backend=BACKENDS, tokens=TOKENS, keep=st.integers(0, 12))
    def trim(self, backend: str, tokens: list[int], keep: int) -> None:
        hashes = self.pair.hashes(tokens)
        self.pair.real.trim(backend, hashes, keep)
        self.pair.model.trim(backend, hashes.tolist(), keep)

    @rule(backend=BACKENDS, blocks=st.integers(0, 40))
    def reserve(self, backend: str, blocks: int) -> None:
        """Room made ahead of an insert in slices changes no answer."""
        self.pair.real.reserve(backend, blocks)

    @rule(backend=BACKENDS, blocks=st.one_of(st.none(), st.integers(0, 12)))
    def set_capacity(self, backend: str, blocks: int | None) -> None:
        self.pair.real.set_capacity(backend, blocks)
        self.pair.model.set_capacity(backend, blocks)

    @rule(backend=BACKENDS)
    def clear(self, backend: str) -> None:
        self.pair.real.clear(backend)
        self.pair.model.clear(backend)

    @rule(backend=BACKENDS)
    def remove_backend(self, backend: str) -> None:
        self.pair.real.remove_backend(backend)
        self.pair.model.remove_backend(backend)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def advance_clock(self, seconds: float) -> None:
        self.pair.clock.now += seconds

    @invariant()
    def same_state(self) -> None:
        self.pair.check()


class BoundedIndexMachine(IndexMachine):
    capacity = 6


class ExpiringIndexMachine(IndexMachine):
    capacity = 8
    ttl_s = 2.0


class TinyTablesMachine(BoundedIndexMachine):
    """Tables of one bucket and a log of four ticks: every few operations grow a table,
    relocate the backends' block slots, or compact a log (with TTL stamps)."""

    ttl_s = 2.0
    _saved: dict[str, int]

    @initialize()
    def start(self) -> None:
        self._saved = {}
        for name, value in (("_INITIAL_BLOCK_BUCKETS", 1), ("_INITIAL_HOLDER_BUCKETS", 1), ("_INITIAL_LOG", 4)):
            self._saved[name] = getattr(prefix_index, name)
            setattr(prefix_index, name, value)
        super().start()

    def teardown(self) -> None:
        for name, value in getattr(self, "_saved", {}).items():
            setattr(prefix_index, name, value)


_MACHINE_SETTINGS = settings(
    max_examples=35, stateful_step_count=35, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestUnbounded = IndexMachine.TestCase
TestUnbounded.settings = _MACHINE_SETTINGS
TestBounded = BoundedIndexMachine.TestCase
TestBounded.settings = _MACHINE_SETTINGS
TestExpiring = ExpiringIndexMachine.TestCase
TestExpiring.settings = _MACHINE_SETTINGS
TestTinyTables = TinyTablesMachine.TestCase
TestTinyTables.settings = _MACHINE_SETTINGS


# --- targeted cases ----------------------------------------------------------------------


def test_match_reports_each_backends_run_in_one_walk() -> None:
    index = PrefixIndex(block_size=4)
    shared = list(range(16))
    index.insert("a", shared + [100] * 8)
    index.insert("b", shared[:8])
    assert index.match(shared + [100] * 8 + [7, 7, 7]) == {"a": 24, "b": 8}
    assert index.match([9] * 16) == {}
    assert index.match(shared[:3]) == {}  # no full block


def test_blocks_of_several_backends_at_once() -> None:
    index = PrefixIndex(block_size=4)
    index.insert("a", list(range(12)))
    index.insert("b", list(range(4)))
    assert index.blocks_of(["b", "a", "unknown"]) == [index.blocks("b"), index.blocks("a"), 0] == [1, 3, 0]


def test_salt_separates_equal_tokens() -> None:
    index = PrefixIndex(block_size=4)
    tokens = list(range(12))
    index.insert("a", tokens, salt="model-x")
    assert index.match(tokens) == {}
    assert index.match(tokens, salt="model-y") == {}
    assert index.match(tokens, salt="model-x") == {"a": 12}


def test_eviction_drops_tails_before_heads_and_never_a_parent_first() -> None:
    evicted: list[list[int]] = []
    index = PrefixIndex(block_size=1, capacity_blocks=4, on_evict=lambda _b, h: evicted.append(h.tolist()))
    first = [1, 2, 3, 4]
    index.insert("a", first)
    second = [1, 2, 9]  # shares a two-block parent with the first sequence
    index.insert("a", second)
    # 5 distinct blocks for capacity 4: the first sequence's tail goes, the shared parent stays.
    assert evicted == [block_hashes(first, 1)[3:].tolist()]
    assert index.match(first) == {"a": 3}
    assert index.match(second) == {"a": 3}


def test_sequence_longer_than_capacity_keeps_its_head() -> None:
    index = PrefixIndex(block_size=2, capacity_blocks=3)
    tokens = list(range(20))
    index.insert("a", tokens)
    assert index.blocks("a") == 3
    assert index.match(tokens) == {"a": 6}


def test_remove_blocks_leaves_unreachable_descendants() -> None:
    index = PrefixIndex(block_size=2)
    tokens = list(range(10))
    hashes = block_hashes(tokens, 2)
    index.insert("a", tokens)
    index.remove_blocks("a", hashes[2:3])
    assert index.match(tokens) == {"a": 4}
    assert index.blocks("a") == 4
    index.insert("a", tokens[:6])  # the missing block comes back: its descendants count again
    assert index.match(tokens) == {"a": 10}


def test_trim_keeps_the_head_of_the_sequence() -> None:
    index = PrefixIndex(block_size=2)
    tokens = list(range(12))
    index.insert("a", tokens)
    index.insert("b", tokens)
    index.trim("a", block_hashes(tokens, 2), 2)
    assert index.match(tokens) == {"a": 4, "b": 12}
    assert index.blocks("a") == 2


def test_ttl_expires_untouched_blocks() -> None:
    clock = FakeClock()
    index = PrefixIndex(block_size=2, ttl_s=10.0, clock=clock)
    old, fresh = [1, 1, 1, 1], [2, 2, 2, 2]
    index.insert("a", old)
    clock.now += 6
    index.insert("a", fresh)
    clock.now += 6
    assert index.match(old) == {}
    assert index.match(fresh) == {"a": 4}
    assert index.blocks("a") == 2


def test_remove_backend_frees_everything_and_its_bit_is_reused() -> None:
    index = PrefixIndex(block_size=4)
    tokens = list(range(64))
    index.insert("a", tokens)
    index.insert("b", tokens[:32])
    index.remove_backend("a")
    assert index.backends() == ["b"]
    assert index.stats().unique_blocks == 8
    index.insert("c", tokens)
    assert index.match(tokens) == {"b": 32, "c": 64}
    index.remove_backend("b")
    index.remove_backend("c")
    assert index.stats() == IndexStats(blocks={}, unique_blocks=0, bytes=index.stats().bytes)
    assert index.stats().unique_blocks == 0


def test_clear_keeps_the_backend_and_its_capacity() -> None:
    index = PrefixIndex(block_size=1)
    index.set_capacity("a", 2)
    index.insert("a", [1, 2, 3])
    index.clear("a")
    assert index.backends() == ["a"] and index.blocks("a") == 0
    index.insert("a", [4, 5, 6])
    assert index.blocks("a") == 2


def test_more_than_64_backends() -> None:
    index = PrefixIndex(block_size=1)
    model = ReferenceIndex(block_size=1)
    rng = np.random.default_rng(7)
    names = [f"http://10.0.{i // 256}.{i % 256}:8000" for i in range(150)]
    prefix = list(range(5))
    for position, name in enumerate(names):
        tokens = prefix[: position % 6] + rng.integers(10, 20, size=4).tolist()
        index.insert(name, tokens)
        model.insert(name, tokens)
    for name in names[10:140:3]:
        index.remove_backend(name)
        model.remove_backend(name)
    for name in names[:20]:
        index.insert(name + "/new", prefix)
        model.insert(name + "/new", prefix)
    # Enough blocks to rebuild the block table with three owner words per block.
    many = rng.integers(100, 1_000_000, size=5_000).tolist()
    index.insert(names[0], many)
    model.insert(names[0], many)
    assert index.match(many) == model.match(many)
    for probe in (prefix, prefix[:3], [*prefix, 11, 12], [15, 15]):
        assert index.match(probe) == model.match(probe)
    assert index.stats().blocks == {name: model.blocks(name) for name in model.backends()}


def test_many_blocks_through_table_growth_and_churn() -> None:
    """Enough blocks to rebuild both tables several times, under capacity churn."""
    pair = Pair(capacity=3000)
    rng = np.random.default_rng(3)
    roots = [rng.integers(0, 1000, size=64).tolist() for _ in range(8)]
    sequences = []
    for step in range(300):
        tokens = (
            roots[step % 8][: int(rng.integers(0, 64))] + rng.integers(0, 1000, size=int(rng.integers(1, 200))).tolist()
        )
        sequences.append(tokens)
        backend = f"b{int(rng.integers(0, 5))}"
        hashes = pair.hashes(tokens)
        pair.real.insert_hashes(backend, hashes)
        pair.model.insert_hashes(backend, hashes.tolist())
        if step % 25 == 0:
            victim = sequences[int(rng.integers(0, len(sequences)))]
            pair.real.trim(backend, pair.hashes(victim), 10)
            pair.model.trim(backend, pair.hashes(victim).tolist(), 10)
    for tokens in sequences[::7]:
        assert pair.real.match(tokens) == pair.model.match(tokens)
    pair.check()


def test_reserved_room_takes_the_inserts_without_growing() -> None:
    """After ``reserve`` the tables take that many blocks without growing (the index's
    bytes stay put); a backend at its capacity gets no room beyond it, an unknown one none."""
    index = PrefixIndex(block_size=16)
    index.insert_hashes("a", np.arange(1, 101, dtype=np.uint64))
    index.reserve("a", 20_000)
    reserved = index.stats().bytes
    for start in range(101, 20_101, 2_000):
        index.insert_hashes("a", np.arange(start, start + 2_000, dtype=np.uint64))
    assert index.blocks("a") == 20_100 and index.stats().bytes == reserved
    index.set_capacity("a", 20_100)
    index.reserve("a", 50_000)
    index.reserve("unknown", 50_000)
    assert index.stats().bytes == reserved and index.backends() == ["a"]


def test_the_same_block_twice_in_one_insert() -> None:
    pair = Pair(capacity=3)
    hashes = [11, 12, 11, 13, 14]  # 11 occurs twice: its head occurrence decides its age
    pair.real.insert_hashes("a", np.array(hashes, dtype=np.uint64))
    pair.model.insert_hashes("a", hashes)
    pair.check()
    assert pair.real.match_hashes([11, 12, 11]) == pair.model.match_hashes([11, 12, 11])


def test_plain_int_lists_and_hash_zero() -> None:
    index = PrefixIndex(block_size=1)
    index.insert_hashes("a", [0, 5, 2**64 - 1])
    assert index.match_hashes([0, 5, 2**64 - 1]) == {"a": 3}
    assert index.blocks("a") == 3


def test_stats_bytes_per_block() -> None:
    index = PrefixIndex(block_size=16)
    rng = np.random.default_rng(0)
    for backend in range(4):
        index.insert(f"b{backend}", rng.integers(0, 50_000, size=160_000))
    stats = index.stats()
    assert stats.backend_blocks == 40_000
    assert stats.bytes == stats.bytes_per_block * 40_000
    assert 16 < stats.bytes_per_block < 100


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"capacity_blocks": -1}, {"ttl_s": 0}])
def test_rejects_bad_settings(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(**bad)  # type: ignore[arg-type]


def test_crowded_tables_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables let fill to 95 % spill keys over long runs of buckets: answers stay exact."""
    monkeypatch.setattr(bucket_table, "MAX_LOAD", 0.95)
    pair = Pair(capacity=700)
    rng = np.random.default_rng(11)
    for step in range(120):
        hashes = rng.integers(2, 2**63, size=int(rng.integers(1, 90)), dtype=np.uint64)
        backend = f"b{step % 3}"
        pair.real.insert_hashes(backend, hashes)
        pair.model.insert_hashes(backend, hashes.tolist())
        assert pair.real.match_hashes(hashes) == pair.model.match_hashes(hashes.tolist())
    pair.check()


def _state(index: PrefixIndex) -> list[object]:
    """Every array and count of an index, in a comparable form."""
    blocks = index._blocks
    state: list[object] = [blocks.table.flat.tolist(), blocks.table.spills.tolist(), blocks.table.count]
    state += [blocks.owners.tolist(), blocks.version]
    for name, holder in sorted(index._holders.items()):
        state += [name, holder.table.flat.tolist(), holder.table.spills.tolist(), holder.table.count, holder.count]
        state += [holder.ticks.tolist(), holder.log[: holder.tail].tolist(), holder.head, holder.tail]
    return state


@pytest.mark.parametrize("seed", range(4))
def test_insert_in_one_call_leaves_what_the_step_by_step_insert_leaves(seed: int) -> None:
    """The fused insert kernel against the insert it replaces where the tables have room:
    the same random matches and inserts (repeated blocks, hash 0, shared prefixes, blocks
    other backends hold) leave every array of both indexes equal, and evict the same
    blocks in the same order (the fused kernel evicts down to the capacity itself)."""
    evicted: dict[str, list[tuple[str, list[int]]]] = {"fused": [], "stepwise": []}
    fused = PrefixIndex(
        block_size=1, capacity_blocks=100, on_evict=lambda b, h: evicted["fused"].append((b, h.tolist()))
    )
    stepwise = PrefixIndex(
        block_size=1, capacity_blocks=100, on_evict=lambda b, h: evicted["stepwise"].append((b, h.tolist()))
    )
    stepwise._insert_in_one_call = lambda *args: False  # type: ignore[method-assign]
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 2**64, size=40, dtype=np.uint64) for _ in range(6)]
    fused_calls = 0
    for step in range(400):
        head = prefixes[int(rng.integers(0, len(prefixes)))][: int(rng.integers(0, 40))]
        tail = rng.integers(0, 6, size=int(rng.integers(0, 30)), dtype=np.uint64)  # 0s and repeats
        hashes = np.concatenate((head, tail))
        backend = f"b{int(rng.integers(0, 3))}"
        if rng.random() < 0.7:  # the router's pattern: the insert reuses the match's lookups
            assert fused.match_hashes(hashes) == stepwise.match_hashes(hashes)
        room = fused._blocks.table.room()
        fused.insert_hashes(backend, hashes)
        stepwise.insert_hashes(backend, hashes)
        fused_calls += len(hashes) <= room
        assert _state(fused) == _state(stepwise), f"step {step}"
        assert evicted["fused"] == evicted["stepwise"], f"step {step}"
    assert fused_calls > 300
    assert sum(len(hashes) for _, hashes in evicted["fused"]) > 1000
