"""The routing engine: on its own (real tokenizer, real index, ``Backend`` objects), and end
to end through ``kvroute serve`` to simulated engines with the ``openai`` SDK."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.fleet.engine_stats import EngineStats
from kvroute.router.routing import sliced_insert
from kvroute.router.routing.peer_exchange import Placement
from kvroute.router.routing.request_info import ENDPOINTS, parse_request
from kvroute.router.routing.routing_engine import RoutePlan, RoutingEngine
from kvroute.tokenizer_index import RequestTokenizer
from tests.servers import wait_until

CHAT = "/v1/chat/completions"
SYSTEM = " ".join(f"rule {n}: answer precisely and cite the manual section {n}." for n in range(120))


def fleet(count: int, capacity: int | None = None) -> list[Backend]:
    return [Backend(f"http://b{i}", capacity_tokens=capacity) for i in range(count)]


def chat(*turns: str, model: str = "sim", system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    """A chat body: the system prompt, then alternating user / assistant turns."""
    messages = [{"role": "system", "content": system}]
    for number, text in enumerate(turns):
        messages.append({"role": "user" if number % 2 == 0 else "assistant", "content": text})
    return {"model": model, "messages": messages, "max_tokens": 8, **extra}


def route(engine: RoutingEngine, body: dict[str, Any], backends: list[Backend], **headers: str) -> RoutePlan:
    return engine.route(CHAT, body, headers, backends)


def served(engine: RoutingEngine, body: dict[str, Any], backends: list[Backend], **headers: str) -> RoutePlan:
    """Route, then report back as an engine holding what the router predicted would."""
    plan = route(engine, body, backends, **headers)
    engine.observe(plan, plan.predicted_cached_tokens)
    return plan


# --- the engine on its own ----------------------------------------------------------------


@pytest.mark.parametrize("megabytes", [0, 6])
def test_the_conversation_memo_gets_the_memory_configured(megabytes: int) -> None:
    """``--conversation-memo-mb``: half for the rendered texts, half for the ids; 0 renders
    and tokenizes every long chat whole."""
    engine = RoutingEngine(Settings(policy="cache_aware", conversation_memo_mb=megabytes))
    turns = [f"question {number} " * 200 if number % 2 == 0 else f"answer {number}" for number in range(20)]
    for count in (17, 19):
        route(engine, chat(*turns[:count]), fleet(2))
    render_memo = engine._tokenizer_for("sim").render_memo_stats()
    prompt_memo = engine._tokenizer_for("sim").memo_stats()
    assert render_memo.max_bytes == prompt_memo.max_bytes == megabytes * 2**19
    assert render_memo.reused == prompt_memo.reused == (1 if megabytes else 0)
    states = engine.conversation_memo_states()  # (what /metrics exports)
    assert states["render"].continued == states["ids"].continued == render_memo.reused
    assert states["ids"].lookups == prompt_memo.lookups and states["render"].max_bytes == megabytes * 2**19


def test_a_conversation_stays_where_its_history_is_and_the_prediction_is_exact() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(4)
    tokenizer = RequestTokenizer.default()
    first = served(engine, chat("What is rule 3?"), backends)
    assert (first.reason, first.predicted_cached_tokens) == ("cold_spread", 0)
    body = chat("What is rule 3?", "Rule 3 says to cite.", "And rule 4?")
    second = served(engine, body, backends)
    previous = len(tokenizer.encode_chat(chat("What is rule 3?")["messages"]))
    assert second.backend == first.backend and second.reason == "prefix_match"
    assert second.request.prompt_tokens == len(tokenizer.encode_chat(body["messages"]))
    assert second.predicted_cached_tokens == previous // 16 * 16


def test_untokenizable_requests_route_by_load_as_fallback() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(3)
    backends[0].in_flight = backends[1].in_flight = 2
    plan = engine.route("/v1/embeddings", {"model": "sim", "input": "hello"}, {}, backends)
    assert (plan.backend, plan.reason, plan.policy) == ("http://b2", "fallback", "cache_aware")
    broken = engine.route(CHAT, {"model": "sim", "messages": "not a list"}, {}, backends)
    assert broken.reason == "fallback" and broken.request.prompt_tokens is None


def test_model_and_cache_salt_keep_equal_prompts_apart() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2)
    served(engine, chat("hello"), backends)
    assert route(engine, chat("hello"), backends).predicted_cached_tokens > 0
    assert route(engine, chat("hello", model="other"), backends).predicted_cached_tokens == 0
    assert route(engine, chat("hello", cache_salt="tenant-a"), backends).predicted_cached_tokens == 0


def test_completions_and_sglang_generate_are_tokenized() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2)
    ids = list(range(100, 200))
    plan = engine.route("/v1/completions", {"model": "sim", "prompt": ids}, {}, backends)
    assert plan.request.prompt_tokens == 100
    engine.observe(plan, 0)
    again = engine.route("/generate", {"model": "sim", "input_ids": ids + [7, 8]}, {}, backends)
    assert (again.backend, again.predicted_cached_tokens) == (plan.backend, 96)


def test_each_tokenizer_says_once_which_shortcuts_it_takes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvroute.routing"):
        engine = RoutingEngine(Settings(policy="cache_aware"))  # loads the tokenizer
        served(engine, chat("hello"), fleet(2))
        served(engine, chat("hello again"), fleet(2))
    lines = [
        record.getMessage()
        for record in caplog.records
        if "shortcut" in record.getMessage() or "pieces" in record.getMessage()
    ]
    assert lines == [
        "tokenizer kvroute's default: pieces on; chunks on; words ascii+unicode (compiled, new words by BPE); "
        "chat templates: default: incremental, short chats from skeletons, with tool calls"
    ]


def test_per_model_tokenizer_is_used(tmp_path: Any) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    # A deliberately different tokenizer: a tiny word-level vocabulary.
    tiny = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tiny.pre_tokenizer = pre_tokenizers.Whitespace()
    tiny.train_from_iterator(["alpha beta gamma"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tiny.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    settings = Settings(policy="cache_aware", models={"tiny": {"tokenizer": str(tmp_path)}})
    engine = RoutingEngine(settings)
    prompt = "alpha beta gamma alpha beta gamma"
    plain = engine.route("/v1/completions", {"model": "sim", "prompt": prompt}, {}, fleet(1))
    special = engine.route("/v1/completions", {"model": "tiny", "prompt": prompt}, {}, fleet(1))
    assert special.request.prompt_tokens == 6
    assert plain.request.prompt_tokens != 6


def test_the_engines_chat_template_settings_decide_the_prompt(tmp_path: Any) -> None:
    """The engines' ``--chat-template`` (a file or Jinja source) and
    ``--default-chat-template-kwargs``, fleet-wide and per model, are how the router renders:
    its prompt is the tokenizer's render under them."""
    template = "{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}{{ suffix }}\n{% endfor %}"
    (tmp_path / "plain.jinja").write_text(template)
    body = chat("hello")
    tokenizer = RequestTokenizer.default()

    def prompt_of(settings: Settings, model: str = "sim") -> int | None:
        return RoutingEngine(settings).route(CHAT, {**body, "model": model}, {}, fleet(1)).request.prompt_tokens

    plain_with = RequestTokenizer.default(chat_template=template, default_chat_template_kwargs={"suffix": "!"})
    expected = len(plain_with.encode_chat(body["messages"]))
    assert plain_with.render_chat(body["messages"]).startswith("system says rule 0")
    fleet_wide = Settings(
        policy="cache_aware",
        chat_template=str(tmp_path / "plain.jinja"),
        default_chat_template_kwargs='{"suffix": "!"}',
    )
    assert prompt_of(fleet_wide) == expected
    per_model = Settings(
        policy="cache_aware",
        models={"plain": {"chat_template": template, "default_chat_template_kwargs": {"suffix": "!"}}},
    )
    assert prompt_of(per_model, "plain") == expected
    assert prompt_of(per_model) == len(tokenizer.encode_chat(body["messages"]))
    with pytest.raises(FileNotFoundError, match="neither a file nor Jinja"):
        RoutingEngine(Settings(policy="cache_aware", chat_template=str(tmp_path / "missing.jinja")))
    with pytest.raises(ValueError, match="invalid chat template"):
        RoutingEngine(Settings(policy="cache_aware", chat_template="{% if %}"))


def test_a_request_template_is_rendered_only_where_the_engines_trust_it() -> None:
    """vLLM refuses a request's own ``chat_template`` unless started with
    ``--trust-request-chat-template``: so the router does not predict a prefix for it (the
    default template's render would be the wrong prompt) unless told the same."""
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    backends = fleet(2)
    for brought in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
        untrusted = RoutingEngine(Settings(policy="cache_aware"))
        plan = route(untrusted, chat("hello", **brought), backends)
        assert (plan.reason, plan.request.prompt_tokens) == ("fallback", None)
    trusted = RoutingEngine(Settings(policy="cache_aware", trust_request_chat_template=True))
    plan = served(trusted, chat("hello", chat_template=template), backends)
    messages = chat("hello")["messages"]
    assert plan.request.prompt_tokens == len(RequestTokenizer.default().encode_chat(messages, chat_template=template))
    again = route(trusted, chat("hello", "hi", "more", chat_template=template), backends)
    assert (again.backend, again.predicted_cached_tokens) == (plan.backend, plan.request.prompt_tokens // 16 * 16)


def test_block_size_comes_from_config_then_the_engines_then_16() -> None:
    ids = {"model": "sim", "prompt": list(range(1000, 1100))}
    engine = RoutingEngine(Settings(policy="cache_aware"))
    assert engine.route("/v1/completions", ids, {}, fleet(1)).prompt.block_size == 16
    engine.update_engine_stats("http://b0", EngineStats(kind="vllm", block_size=32))
    assert engine.route("/v1/completions", ids, {}, fleet(1)).prompt.block_size == 32
    configured = RoutingEngine(Settings(policy="cache_aware", block_size=64, models={"m": {"block_size": 8}}))
    configured.update_engine_stats("http://b0", EngineStats(kind="vllm", block_size=32))
    assert configured.route("/v1/completions", ids, {}, fleet(1)).prompt.block_size == 64
    per_model = {"model": "m", "prompt": ids["prompt"]}
    assert configured.route("/v1/completions", per_model, {}, fleet(1)).prompt.block_size == 8


def test_index_is_bounded_by_each_backends_capacity() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    small = [Backend("http://b0", capacity_tokens=160)]
    for number in range(5):
        served(engine, chat(f"question {number}"), small)
    assert engine.index_stats().blocks == {"http://b0": 10}
    assert engine.index_tokens("http://b0") == 160
    assert engine.index_stats().bytes > 0


def test_the_index_bound_follows_the_cache_model_and_each_candidates_size() -> None:
    """The bound is applied again only when something it is made of changed (most requests
    change nothing): a backend's configured size, or the model's scale of it."""
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2, capacity=4096)
    served(engine, chat("question"), backends)
    (index,) = engine._indexes.values()
    assert [index._holders[backend.url].capacity for backend in backends] == [256, 256]
    backends[1]._configured_capacity = 2048
    served(engine, chat("another question"), backends)
    assert [index._holders[backend.url].capacity for backend in backends] == [256, 128]
    engine.cache_model.shortfall(backends[0].url, 4096, held_tokens=2048, missing_tokens=1024)
    scaled = int(4096 * engine.cache_model.scale(backends[0].url)) // 16
    route(engine, chat("a third question"), backends)
    assert scaled < 256 and [index._holders[backend.url].capacity for backend in backends] == [scaled, 128]


def test_a_shortfall_keeps_the_computed_prompt_and_shrinks_the_modelled_cache() -> None:
    """The engine computed the whole prompt, so its next turn finds all of it; the missed
    blocks say the engine's cache is smaller than modelled, so the model shrinks."""
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2, capacity=4096)
    tokenizer = RequestTokenizer.default()
    served(engine, chat("first question"), backends)
    body = chat("first question", "an answer", "second question")
    plan = route(engine, body, backends)
    assert plan.confirmed_cached_tokens == plan.predicted_cached_tokens > 32
    engine.observe(plan, 32)  # the engine had evicted most of it
    assert (engine.feedback.drifts, engine.feedback.capacity_corrections) == (1, 1)
    assert engine.cache_model.scale(plan.backend) < 1.0
    again = route(engine, chat("first question", "an answer", "second question", "x", "y"), backends)
    assert again.backend == plan.backend
    assert again.predicted_cached_tokens == len(tokenizer.encode_chat(body["messages"])) // 16 * 16


def test_a_long_prompts_shortfall_touches_it_again_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """``observe(sliced=True)``: of a long prompt the engine held less of than modelled the
    last slice is touched again at once, the rest by ``insert_next``; the next turn then
    finds all of it, as after one insert."""
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    backends = fleet(2, capacity=4096)
    body = chat("first question", "an answer", "second question")
    following = chat("first question", "an answer", "second question", "x", "y")
    predicted = []
    for sliced in (False, True):
        engine = RoutingEngine(Settings(policy="cache_aware"))
        served(engine, chat("first question"), backends)
        plan = route(engine, body, backends)
        pending = engine.observe(plan, 32, sliced=sliced)
        assert len(pending) == sliced and engine.feedback.drifts == 1
        while pending and pending[0].insert_next():
            pass
        again = route(engine, following, backends)
        assert again.backend == plan.backend
        predicted.append(again.predicted_cached_tokens)
    assert predicted[0] == predicted[1] == plan.request.prompt_tokens // 16 * 16


def test_confirmed_predictions_grow_the_modelled_cache_back() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(1, capacity=4096)
    served(engine, chat("q"), backends)
    plan = route(engine, chat("q", "a", "q2"), backends)
    engine.observe(plan, 0)
    shrunk = engine.cache_model.scale(backends[0].url)
    history = ["q", "a", "q2"]
    for turn in range(3):
        history += [f"a{turn}", f"next {turn}"]
        served(engine, chat(*history), backends)
    assert shrunk < engine.cache_model.scale(backends[0].url) <= 1.0


def test_each_answer_updates_the_backends_eviction_rate_and_the_next_request_carries_it() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(1, capacity=4096)
    url = backends[0].url
    served(engine, chat("q"), backends)
    plan = route(engine, chat("q", "a", "q2"), backends)
    assert engine.cache_model.eviction_rate(url) is None  # no prediction checked yet
    engine.observe(plan, 0)  # evicted
    evicted = engine.cache_model.eviction_rate(url)
    assert evicted is not None and evicted > 0
    held = route(engine, chat("q", "a", "q2", "a2", "q3"), backends)
    assert held.request.eviction_rates == {url: evicted}
    engine.observe(held, held.confirmed_cached_tokens)  # held all of it
    assert engine.cache_model.eviction_rate(url) < evicted


def test_a_shortfall_with_unknown_capacity_corrects_nothing() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(1)
    served(engine, chat("q"), backends)
    plan = route(engine, chat("q", "a", "q2"), backends)
    engine.observe(plan, 0)
    assert (engine.feedback.drifts, engine.feedback.capacity_corrections) == (1, 0)
    assert (
        route(engine, chat("q", "a", "q2", "b", "q3"), backends).predicted_cached_tokens > plan.predicted_cached_tokens
    )


def test_siblings_behind_a_request_still_in_flight_are_no_evidence_of_drift() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2)
    leader = route(engine, chat("sibling 1"), backends)
    follower = route(engine, chat("sibling 2"), backends)
    assert follower.backend == leader.backend and follower.predicted_cached_tokens > 0
    assert follower.confirmed_cached_tokens == 0  # the leader is still computing the prefix
    engine.observe(follower, 0)
    engine.observe(leader, 0)
    assert engine.feedback.drifts == 0
    assert route(engine, chat("sibling 3"), backends).predicted_cached_tokens > 0


def test_a_peers_request_in_flight_is_no_evidence_of_drift() -> None:
    """A peer router placed the shared prefix and its request still computes it: this
    router's prediction counts none of it as confirmed, first from the placement itself,
    then from the peer's load report, until the peer's report no longer lists it."""
    now = [1000.0]
    peer = RoutingEngine(Settings(policy="cache_aware"), clock=lambda: now[0])
    engine = RoutingEngine(Settings(policy="cache_aware"), clock=lambda: now[0])
    peer.on_placement(engine.apply_placement)
    backends = fleet(1, capacity=4096)
    url = backends[0].url
    leader = route(peer, chat("sibling 1"), backends)
    follower = route(engine, chat("sibling 2"), backends)
    assert follower.predicted_cached_tokens > 0 and follower.confirmed_cached_tokens == 0
    engine.observe(follower, 0)  # the engine had not computed the prefix yet
    assert (engine.feedback.drifts, engine.cache_model.scale(url)) == (0, 1.0)

    now[0] += 1.0  # the placement alone no longer counts; the peer's report does
    assert route(engine, chat("sibling 3"), backends).confirmed_cached_tokens > 0
    engine.apply_peer_computing(url, peer.computing_blocks()[url])
    assert route(engine, chat("sibling 4"), backends).confirmed_cached_tokens == 0
    peer.observe(leader, 0)
    assert peer.computing_blocks() == {}
    engine.apply_peer_computing(url, ())
    assert route(engine, chat("sibling 5"), backends).confirmed_cached_tokens > 0


def test_a_plans_work_is_its_uncached_prompt_plus_its_output_budget() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(1)
    served(engine, chat("warm up"), backends)
    plan = route(engine, chat("warm up", "ok", "next"), backends)
    assert plan.predicted_cached_tokens > 0
    assert plan.work_tokens == plan.request.prompt_tokens - plan.predicted_cached_tokens + 8


def test_prepare_in_advance_gives_the_same_plan() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2)
    served(engine, chat("shared"), backends)
    body = chat("shared", "reply", "follow-up")
    prepared = engine.prepare(CHAT, body)
    assert prepared is not None
    plan = engine.route(CHAT, body, {}, backends, prepared=prepared)
    assert plan.request.prompt_tokens == prepared.tokens and plan.reason == "prefix_match"


def test_the_proxys_parse_stands_in_for_reading_the_body_again() -> None:
    """``parsed=`` (the proxy's one parse of the body) gives the plan the body alone gives."""
    cases = [(chat("shared", "reply", "next", max_tokens=40), {"x-session-id": "s7"}), (chat("shared", user=""), {})]
    for body, headers in cases:
        parsed = parse_request(orjson.dumps(body), ENDPOINTS[0], headers, "x-session-id")
        plans = []
        for given in (None, parsed):
            engine = RoutingEngine(Settings(policy="cache_aware"))
            backends = fleet(2)
            served(engine, chat("shared"), backends)
            plans.append(engine.route(CHAT, body, headers, backends, parsed=given))
        by_body, by_parse = (
            (
                plan.backend,
                plan.reason,
                plan.predicted_cached_tokens,
                plan.request.session_key,
                plan.request.expected_output_tokens,
                plan.request.prompt_tokens,
                plan.request.conversation.key,
            )
            for plan in plans
        )
        assert by_body == by_parse
    assert by_parse[3:5] == (None, 8)  # no session key, the default output budget of chat()


def test_block_hashes_become_python_ints_only_where_a_prompt_chain_is_walked() -> None:
    """A request with a session key never converts its block hashes to a list (its session
    names its conversation); one without converts them once, and its retry reuses them."""
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2)
    served(engine, chat("first"), backends, **{"x-session-id": "s1"})
    body = chat("first", "ok", "second")
    keyed = engine.prepare(CHAT, body)
    assert keyed is not None
    plan = engine.route(CHAT, body, {"x-session-id": "s1"}, backends, prepared=keyed)
    assert keyed._hash_list is None  # the lazy list stayed unbuilt
    assert plan.request.conversation.key == "session:s1"
    assert plan.request.conversation.leaf == int(keyed.hashes[-1]) == keyed.hash_at(-1)
    chained = engine.prepare(CHAT, body)
    assert chained is not None
    first = engine.route(CHAT, body, {}, backends, prepared=chained)
    converted = chained.hash_list
    assert converted == chained.hashes.tolist() and chained.hash_at(-1) == converted[-1]
    retry = engine.route(CHAT, body, {}, [b for b in backends if b.url != first.backend], prepared=chained)
    assert chained.hash_list is converted
    assert retry.backend != first.backend and retry.request.prompt_tokens == first.request.prompt_tokens


def test_a_long_prompt_routed_sliced_ends_in_the_index_as_one_insert_leaves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``route(sliced=True)``: of a prompt over INSERT_SLICE_BLOCKS blocks only the last slice
    goes in at once; ``learn_slice`` inserts the rest towards the head, and the index ends
    as one insert leaves it, least recently used blocks included (seen by what a later
    prompt evicts of it)."""
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    backends = fleet(1, capacity=160 * 16)
    body = chat("what does rule 7 say?")
    whole, sliced = (RoutingEngine(Settings(policy="cache_aware", block_size=16)) for _ in range(2))
    at_once = whole.route(CHAT, body, {}, backends)
    plan = sliced.route(CHAT, body, {}, backends, sliced=True)
    blocks = len(plan.prompt.hashes)
    assert blocks > 20 and at_once.pending_inserts == ()
    assert plan.pending_inserts != () and sliced.index_tokens("http://b0") == 4 * 16
    assert plan.prompt._hash_list == plan.prompt.hashes.tolist()  # converted when prepared
    slices = 2  # route's, and learn_slice's last (which says none are left)
    while sliced.learn_slice(plan):
        slices += 1
    assert slices == -(-blocks // 4) and plan.pending_inserts == ()
    assert not sliced.learn_slice(plan)
    assert sliced.index_tokens("http://b0") == whole.index_tokens("http://b0") == blocks * 16
    # Another prompt of about as many blocks evicts the oldest of the first: its tail.
    other = chat("x", system=" ".join(f"note {n}: keep the logs for {n} days." for n in range(160)))
    for engine in (whole, sliced):
        engine.observe(engine.route(CHAT, other, {}, backends), None)
    follow_up = chat("what does rule 7 say?", "it says to cite", "and rule 8?")
    kept = [engine.route(CHAT, follow_up, {}, backends).predicted_cached_tokens for engine in (whole, sliced)]
    assert 0 < kept[0] < blocks * 16 and kept[0] == kept[1]


def test_a_peers_long_placement_applied_in_slices_ends_as_one_insert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    backends = fleet(1)
    source = RoutingEngine(Settings(policy="cache_aware", block_size=16))
    placements: list[Placement] = []
    source.on_placement(placements.append)
    source.route(CHAT, chat("what does rule 7 say?"), {}, backends)
    whole, sliced = (RoutingEngine(Settings(policy="cache_aware", block_size=16)) for _ in range(2))
    assert whole.apply_placement(placements[0]) is None
    pending = sliced.apply_placement(placements[0], sliced=True)
    assert pending is not None and sliced.index_tokens("http://b0") == 4 * 16
    while pending.insert_next():
        pass
    blocks = len(placements[0].hashes)
    assert sliced.index_tokens("http://b0") == whole.index_tokens("http://b0") == blocks * 16
    follow_up = chat("what does rule 7 say?", "it says to cite", "and rule 8?")
    kept = [engine.route(CHAT, follow_up, {}, backends).predicted_cached_tokens for engine in (whole, sliced)]
    assert kept == [blocks * 16] * 2


def test_a_backend_that_leaves_between_slices_gets_no_more_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sliced_insert, "INSERT_SLICE_BLOCKS", 4)
    engine = RoutingEngine(Settings(policy="cache_aware", block_size=16))
    plan = engine.route(CHAT, chat("what does rule 7 say?"), {}, fleet(1), sliced=True)
    assert plan.pending_inserts != ()
    engine.forget_backend(plan.backend)
    assert not engine.learn_slice(plan) and plan.pending_inserts == ()
    assert plan.backend not in engine.index_stats().blocks


def test_a_turn_that_replaces_the_previous_partial_trace_block_continues_its_conversation() -> None:
    """Mooncake's traces hash prompts in 512-token blocks: a conversation's next turn keeps
    its predecessor's full blocks and replaces its partial last one. The ledger finds the
    conversation by an anchor before that block, so the turn counts as its second."""
    engine = RoutingEngine(Settings(policy="cache_aware", block_size=16))
    backends = fleet(2)
    shared = list(range(1000, 1512))  # every request's first 512 tokens
    history = shared + list(range(5000, 5000 + 2 * 512 + 300))  # two full trace blocks, a partial one
    first = engine.route("/v1/completions", {"model": "sim", "prompt": history}, {}, backends)
    assert first.request.conversation is not None and first.request.conversation.turns == 1
    engine.observe(first, 0)
    following = history[: 3 * 512] + list(range(9000, 9000 + 700))  # the partial block replaced
    second = engine.route("/v1/completions", {"model": "sim", "prompt": following}, {}, backends)
    assert second.request.conversation is first.request.conversation
    assert second.request.conversation.turns == 2 and second.backend == first.backend


def test_forgetting_a_backend_drops_its_index_and_conversations() -> None:
    engine = RoutingEngine(Settings(policy="cache_aware"))
    backends = fleet(2)
    plan = served(engine, chat("remember me"), backends)
    engine.forget_backend(plan.backend)
    assert plan.backend not in engine.index_stats().blocks
    rest = [b for b in backends if b.url != plan.backend]
    assert route(engine, chat("remember me", "ok", "again"), rest).predicted_cached_tokens == 0


def test_ab_split_is_stable_per_session_and_labels_the_plan() -> None:
    engine = RoutingEngine(Settings(ab={"cache_aware": 50, "round_robin": 50}))
    backends = fleet(2)
    labels = {}
    for number in range(40):
        for _ in range(3):
            plan = served(engine, chat(f"user {number}"), backends, **{"x-session-id": f"s{number}"})
            assert labels.setdefault(number, plan.policy) == plan.policy
    assert set(Counter(labels.values())) == {"cache_aware", "round_robin"}
    # Requests of both arms keep the shared index current, round robin's included.
    assert engine.index_stats().blocks and all(engine.index_stats().blocks.values())


def test_policy_header_forces_a_policy_only_when_allowed() -> None:
    backends = fleet(2)
    allowed = RoutingEngine(Settings(policy="cache_aware", allow_policy_header=True))
    forced = route(allowed, chat("x"), backends, **{"x-kvroute-policy": "round_robin"})
    assert (forced.policy, forced.reason) == ("round_robin", "round_robin")
    assert route(allowed, chat("x"), backends, **{"x-kvroute-policy": "bogus"}).policy == "cache_aware"
    closed = RoutingEngine(Settings(policy="cache_aware"))
    assert route(closed, chat("x"), backends, **{"x-kvroute-policy": "round_robin"}).policy == "cache_aware"


def test_load_only_policy_does_not_tokenize() -> None:
    engine = RoutingEngine(Settings(policy="round_robin"))
    assert not engine.tracks_prefixes
    plan = route(engine, chat("hi"), fleet(2))
    assert plan.request.prompt_tokens is None and plan.policy == "round_robin"


def test_sticky_uses_the_session_header_or_the_user_field() -> None:
    engine = RoutingEngine(Settings(policy="sticky", session_header="x-conversation"))
    backends = fleet(4)
    by_header = {route(engine, chat(f"q{n}"), backends, **{"x-conversation": "c1"}).backend for n in range(5)}
    by_user = {route(engine, chat(f"q{n}", user="alice"), backends).backend for n in range(5)}
    assert len(by_header) == 1 and len(by_user) == 1
    assert route(engine, chat("q"), backends, **{"x-conversation": "c1"}).reason == "sticky"


# --- end to end: kvroute serve in front of sim engines, the openai SDK as client ------------

Factory = Callable[..., Any]


def ask(client: openai.OpenAI, messages: list[dict[str, str]], **headers: str) -> tuple[str, httpx.Headers]:
    raw = client.chat.completions.with_raw_response.create(
        model="sim", messages=messages, max_tokens=4, extra_headers=headers or None
    )
    completion = raw.parse()
    return completion.choices[0].message.content or "", raw.headers


def test_each_user_of_a_shared_system_prompt_stays_on_one_replica(sim_engines: Factory, router_server: Factory) -> None:
    engines = sim_engines(4)
    router = router_server(engines, policy="cache_aware")
    client = router.client()
    histories = {user: [{"role": "system", "content": SYSTEM}] for user in range(8)}
    homes: dict[int, set[str]] = {user: set() for user in histories}
    reasons: Counter[str] = Counter()
    for turn in range(4):
        for user, history in histories.items():
            history.append({"role": "user", "content": f"user {user} turn {turn}: tell me about rule {user + turn}"})
            _, headers = ask(client, history)
            if turn:
                homes[user].add(headers["x-kvroute-backend"])
            reasons[headers["x-kvroute-reason"]] += 1
            history.append({"role": "assistant", "content": f"rule {user + turn} is about citing, user {user}"})
    assert all(len(backends) == 1 for backends in homes.values()), homes
    assert reasons["prefix_match"] >= 8 * 3


def test_cold_prefixes_spread_over_the_fleet(sim_engines: Factory, router_server: Factory) -> None:
    engines = sim_engines(4)
    router = router_server(engines, policy="cache_aware")
    client = router.client()
    chosen = Counter()
    for number in range(8):
        topic = " ".join(f"{number}-{word}" for word in range(60))
        _, headers = ask(client, [{"role": "user", "content": f"unrelated topic {topic}"}])
        assert headers["x-kvroute-reason"] == "cold_spread"
        chosen[headers["x-kvroute-backend"]] += 1
    assert chosen == {engine.url: 2 for engine in engines}


async def test_overload_diverts_and_affinity_returns(sim_engines: Factory, router_server: Factory) -> None:
    # Slow decoding keeps the burst in flight long enough to build a queue.
    engines = sim_engines(2, time_scale=20.0, decode_tokens_per_s=20.0)
    router = router_server(engines, policy="cache_aware", overload_factor=2.0)
    client = router.async_client()
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the long shared task"}]

    async def send(messages: list[dict[str, str]], tokens: int) -> httpx.Headers:
        raw = await client.chat.completions.with_raw_response.create(model="sim", messages=messages, max_tokens=tokens)
        return raw.headers

    home = (await send(base, 2))["x-kvroute-backend"]
    burst = [
        send([*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"part {n}"}], 40)
        for n in range(10)
    ]
    results = await asyncio.gather(*burst)
    reasons = Counter(h["x-kvroute-reason"] for h in results)
    backends = Counter(h["x-kvroute-backend"] for h in results)
    assert reasons["overload"] >= 1 and backends[home] >= 4, (reasons, backends)
    # The burst is over: the longest history is on `home` again and affinity decides.
    after = await send(
        [
            *base,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "part 0"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "next"},
        ],
        2,
    )
    assert (after["x-kvroute-backend"], after["x-kvroute-reason"]) == (home, "prefix_match")
    await client.close()


def test_sticky_keeps_sessions_and_survives_a_backend_removal(sim_engines: Factory, router_server: Factory) -> None:
    engines = sim_engines(3)
    router = router_server(engines, policy="sticky", admin_token="secret")
    client = router.client()
    homes = {}
    for session in range(12):
        seen = {
            ask(client, [{"role": "user", "content": f"s{session} q{n}"}], **{"x-session-id": f"s{session}"})[1][
                "x-kvroute-backend"
            ]
            for n in range(3)
        }
        assert len(seen) == 1
        homes[session] = seen.pop()
    gone = homes[0]
    httpx.request(
        "DELETE",
        router.url + "/admin/backends",
        params={"url": gone},
        headers={"Authorization": "Bearer secret"},
        timeout=30,
    ).raise_for_status()
    for session, home in homes.items():
        _, headers = ask(client, [{"role": "user", "content": f"s{session} again"}], **{"x-session-id": f"s{session}"})
        if home == gone:
            assert headers["x-kvroute-backend"] != gone
        else:
            assert headers["x-kvroute-backend"] == home  # untouched sessions never move


def test_ab_split_is_stable_and_labelled_in_headers_and_metrics(sim_engines: Factory, router_server: Factory) -> None:
    engines = sim_engines(2)
    router = router_server(engines, ab={"cache_aware": 50, "round_robin": 50})
    client = router.client()
    labels: dict[int, set[str]] = {}
    for session in range(16):
        for turn in range(2):
            _, headers = ask(
                client,
                [{"role": "user", "content": f"session {session} turn {turn}"}],
                **{"x-session-id": f"user-{session}"},
            )
            labels.setdefault(session, set()).add(headers["x-kvroute-policy"])
    assert all(len(policies) == 1 for policies in labels.values())
    assert set().union(*labels.values()) == {"cache_aware", "round_robin"}
    scrape = router.metrics()
    assert scrape.label_values("kvroute_requests_total", "policy") == {"cache_aware", "round_robin"}
    assert scrape.value("kvroute_routing_decisions_total") == 32


def test_work_in_flight_is_the_uncached_prompt_plus_the_output_budget(
    sim_engines: Factory, router_server: Factory
) -> None:
    """The load every policy weighs, counted on the backend from dispatch to finish and
    exported as ``kvroute_backend_in_flight_work_tokens``."""
    (sim,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=40.0)
    router = router_server([sim], policy="cache_aware")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "warm up"}]
    ask(router.client(), history)
    history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "now at length"}]
    body = {"model": "sim", "messages": history, "max_tokens": 500, "stream": True}
    with httpx.stream("POST", router.v1 + "/chat/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the stream (a hang-up)
        next(lines)  # the first chunk: the request is in flight, decoding
        uncached = int(response.headers["x-kvroute-prompt-tokens"]) - int(response.headers["x-kvroute-matched-tokens"])
        assert 0 < uncached < int(response.headers["x-kvroute-prompt-tokens"])
        work = router.metrics().value("kvroute_backend_in_flight_work_tokens", backend=sim.url)
        assert work == uncached + 500
    wait_until(lambda: router.metrics().value("kvroute_backend_in_flight_work_tokens", backend=sim.url) == 0)


def test_predicted_and_observed_tokens_equal_the_engines_own_counters(
    sim_engines: Factory, router_server: Factory
) -> None:
    engines = sim_engines(3)
    router = router_server(engines, policy="cache_aware")
    client = router.client()
    for user in range(4):
        history = [{"role": "system", "content": SYSTEM}]
        for turn in range(3):
            history.append({"role": "user", "content": f"user {user} asks question {turn} about rule {turn}"})
            ask(client, history)
            history.append({"role": "assistant", "content": f"answer {turn} for user {user}"})
    mine = router.metrics()
    hits = sum(engine.metrics().value("vllm:prefix_cache_hits_total") for engine in engines)
    queries = sum(engine.metrics().value("vllm:prefix_cache_queries_total") for engine in engines)
    assert mine.value("kvroute_observed_cached_tokens_total") == hits > 0
    assert mine.value("kvroute_prompt_tokens_total") == queries
    # Sequential requests, one tokenizer, caches that never fill: the prediction is exact.
    assert mine.value("kvroute_predicted_cached_tokens_total") == hits


def test_an_engine_smaller_than_configured_shrinks_the_routers_model(
    sim_engines: Factory, router_server: Factory
) -> None:
    """A sim engine of 2,048 tokens behind a router told 16,384: its shortfalls shrink the
    index towards what the engine really holds, and the next turn still finds the whole
    prompt the engine just computed."""
    engines = sim_engines(1, kv_capacity_tokens=2048)
    router = router_server([{"url": engines[0].url, "capacity_tokens": 16384}], policy="cache_aware")
    client = router.client()
    histories = [[{"role": "system", "content": f"conversation {n}: " + SYSTEM[:600]}] for n in range(8)]
    for turn in range(4):
        for history in histories:
            history.append({"role": "user", "content": f"turn {turn}: " + " ".join(["more words"] * 150)})
            _, headers = ask(client, history)
            history.append({"role": "assistant", "content": "ok"})
    assert router.metrics().value("kvroute_index_blocks") * 16 <= 0.5 * 16384
    previous = int(headers["x-kvroute-prompt-tokens"])
    histories[-1].append({"role": "user", "content": "one more"})
    _, headers = ask(client, histories[-1])
    assert int(headers["x-kvroute-matched-tokens"]) == (previous - 1) // 16 * 16
