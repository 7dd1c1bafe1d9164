"""Backends and the pool: eligibility, health thresholds, drain, engine stats, health checks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvroute.router.engines import EngineFacts
from kvroute.router.engines.sglang import SGLANG
from kvroute.router.fleet.backends import Backend, BackendPool
from kvroute.router.forwarding.metrics import RouterMetrics
from kvroute.router.routing.decisions import AttemptOutcome
from kvroute.router.routing.policies.base import BackendView
from tests.servers import wait_until


def card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "owned_by": "test"}


def healthy_backend(pool: BackendPool, url: str, *models: str) -> Backend:
    backend = Backend(url)
    pool.set_healthy(backend, True)
    if models:
        pool.set_models(backend, [card(m) for m in models])
    pool.add(backend)
    return backend


def test_backend_implements_the_policy_view() -> None:
    backend: BackendView = Backend("http://a:1/")
    assert backend.url == "http://a:1"
    assert (backend.in_flight, backend.in_flight_work_tokens) == (0, 0)
    assert backend.capacity_tokens is None
    assert backend.engine_waiting is None and backend.engine_running is None


def test_candidates_for_a_path_prefer_engines_serving_it_until_an_engine_changes() -> None:
    pool = BackendPool()
    vllm = healthy_backend(pool, "http://a:1")
    sglang = healthy_backend(pool, "http://b:1")
    assert pool.candidates(None, "/generate") == [vllm, sglang]  # none serves it: any may try
    pool.set_engine(sglang, SGLANG, EngineFacts(detected_by="/server_info"))
    assert pool.candidates(None, "/generate") == [sglang]
    assert pool.candidates(None, "/v1/chat/completions") == [vllm, sglang]


def test_candidates_follow_health_drain_and_models() -> None:
    pool = BackendPool()
    a = healthy_backend(pool, "http://a:1", "m1")
    b = healthy_backend(pool, "http://b:1", "m1", "m2")
    unknown_models = healthy_backend(pool, "http://c:1")
    assert pool.candidates("m1") == [a, b, unknown_models]
    assert pool.candidates("m2") == [b, unknown_models]
    assert pool.candidates(None) == [a, b, unknown_models]
    pool.set_models(unknown_models, [card("m3")])
    assert pool.candidates("m2") == [b]
    assert pool.candidates("nope") == []
    pool.set_healthy(b, False)
    assert pool.candidates("m2") == []
    assert pool.any_serves("m2") and not pool.any_serves("nope")
    pool.drain(a.url)  # idle: leaves at once
    assert a.url not in pool
    assert pool.candidates("m1") == []


def test_health_thresholds_active_and_passive() -> None:
    pool = BackendPool(unhealthy_after=3, healthy_after=2)
    backend = healthy_backend(pool, "http://a:1")
    pool.record_failure(backend)
    pool.record_failure(backend)
    pool.record_success(backend, active=False)  # a good answer resets the streak
    pool.record_failure(backend)
    pool.record_failure(backend)
    assert backend.healthy
    pool.record_failure(backend)
    assert not backend.healthy
    assert pool.candidates(None) == []
    pool.record_success(backend, active=False)  # passive success never revives
    pool.record_success(backend, active=True)
    assert not backend.healthy
    pool.record_failure(backend)  # breaks the success streak
    pool.record_success(backend, active=True)
    assert not backend.healthy
    pool.record_success(backend, active=True)
    assert backend.healthy
    assert pool.candidates(None) == [backend]


def test_drain_removes_the_backend_once_its_last_request_finishes() -> None:
    pool = BackendPool()
    removed: list[str] = []
    pool.on_removed(lambda backend: removed.append(backend.url))
    backend = healthy_backend(pool, "http://a:1")
    pool.acquire(backend, 100)
    pool.acquire(backend, 50)
    pool.drain(backend.url)
    assert backend.url in pool and backend.draining
    assert pool.candidates(None) == []
    pool.release(backend, 100)
    assert backend.url in pool
    pool.release(backend, 50)
    assert backend.url not in pool
    assert removed == [backend.url]
    assert (backend.in_flight, backend.in_flight_work_tokens) == (0, 0)


def test_policies_weigh_peers_load_beside_this_routers_own() -> None:
    pool = BackendPool()
    changes: list[bool] = []
    pool.on_load_changed(changes.append)
    backend = healthy_backend(pool, "http://a:1")
    pool.acquire(backend, 100)
    pool.set_peer_load(backend.url, 3, 900)
    assert (backend.in_flight, backend.in_flight_work_tokens) == (4, 1000)
    assert (backend.own_in_flight, backend.own_in_flight_work_tokens) == (1, 100)
    pool.set_peer_load(backend.url, 1, 200)  # the peers' sum replaces the last one
    pool.release(backend, 100)
    assert (backend.in_flight, backend.in_flight_work_tokens) == (1, 200)
    assert len(changes) == 2  # only this router's own requests are reported on
    assert changes == [False, True]  # started, finished
    state = backend.state()
    assert (state.in_flight, state.peer_in_flight, state.peer_in_flight_work_tokens) == (0, 1, 200)
    pool.set_peer_load("http://not-ours:1", 5, 5)  # a peer's backend that is not ours: ignored
    # Peers' requests do not hold a draining backend in the pool: they are theirs to finish.
    pool.drain(backend.url)
    assert backend.url not in pool


def test_engine_stats_and_capacity_precedence() -> None:
    scraped_only = Backend("http://a:1", default_capacity_tokens=1000)
    assert scraped_only.capacity_tokens == 1000
    scraped_only.update_engine_stats(running=3, waiting=7, kv_usage=0.5, capacity_tokens=4096)
    assert scraped_only.capacity_tokens == 4096
    assert (scraped_only.engine_running, scraped_only.engine_waiting) == (3, 7)
    scraped_only.update_engine_stats(waiting=0)  # others keep their last value
    assert (scraped_only.engine_running, scraped_only.engine_waiting) == (3, 0)
    configured = Backend("http://b:1", capacity_tokens=2048)
    configured.update_engine_stats(capacity_tokens=4096)
    assert configured.capacity_tokens == 2048


def test_model_cards_union_lists_each_model_once() -> None:
    pool = BackendPool()
    healthy_backend(pool, "http://a:1", "m1", "m2")
    healthy_backend(pool, "http://b:1", "m2", "m3")
    sick = healthy_backend(pool, "http://c:1", "m4")
    pool.set_healthy(sick, False)
    assert sorted(c["id"] for c in pool.model_cards()) == ["m1", "m2", "m3"]


def test_removed_backends_leave_no_metric_series() -> None:
    pool = BackendPool()
    metrics = RouterMetrics(lambda: pool)
    pool.on_removed(lambda backend: metrics.forget_backend(backend.url))
    a = healthy_backend(pool, "http://a:1")
    b = healthy_backend(pool, "http://b:1")
    for url in (a.url, b.url):
        answered = AttemptOutcome("r1", url, "round_robin", "chat", "200", 0.1, 0.01, 100, 50, 40)
        metrics.record_request(answered)
        metrics.record_request(replace(answered, status="502", ttft_s=None, prompt_tokens=None, cached_tokens=None))
        metrics.index_blocks.labels(url).set(5)
    pool.remove(a.url)
    text = metrics.render().decode()
    assert a.url not in text
    assert b.url in text
    assert 'kvroute_backend_in_flight_requests{backend="http://b:1"} 0.0' in text


# --- health checks against real engines ---------------------------------------------------
def test_health_checks_mark_a_dead_engine_unhealthy_and_a_revived_one_healthy(
    sim_engines: Any, router_server: Any, server_loop: Any
) -> None:
    first, second = sim_engines(2)
    router = router_server([first, second], unhealthy_after=2, healthy_after=2)
    state = router.state
    backend = state.pool.get(first.url)
    assert backend is not None and backend.healthy and backend.models == frozenset({"sim"})
    first.stop()
    server_loop.run(state.health.check_all())
    assert backend.healthy  # one failure is not enough
    server_loop.run(state.health.check_all())
    assert not backend.healthy
    assert router.metrics().value("kvroute_backend_healthy", backend=first.url) == 0.0
    sim_engines(1, port=urlsplit(first.url).port)
    # The router probes an unhealthy backend itself, fast (tests/router/fleet/test_fast_recovery.py), and
    # brings it back after healthy_after passing checks.
    wait_until(lambda: backend.healthy, timeout=10)
    assert router.metrics().value("kvroute_backend_healthy", backend=first.url) == 1.0


def test_models_are_refreshed_by_health_checks(sim_engines: Any, router_server: Any, server_loop: Any) -> None:
    (engine,) = sim_engines(1, models=("alpha",))
    router = router_server([engine])
    backend = router.state.pool.get(engine.url)
    assert backend is not None and backend.models == frozenset({"alpha"})
    port = urlsplit(engine.url).port
    engine.stop()
    sim_engines(1, models=("beta", "gamma"), port=port)
    server_loop.run(router.state.health.check_all())
    assert backend.models == frozenset({"beta", "gamma"})


def test_a_backend_down_at_start_joins_unhealthy(router_server: Any, unused_tcp_port: int) -> None:
    router = router_server([f"http://127.0.0.1:{unused_tcp_port}"])
    (backend,) = list(router.state.pool)
    assert not backend.healthy
    assert backend.models is None


@pytest.fixture
def unused_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_engine_stats_are_scraped_into_the_backends(sim_engines: Any, router_server: Any) -> None:
    (engine,) = sim_engines(1, kv_capacity_tokens=8192, block_size=16)
    router = router_server([engine], engine_scrape_interval_s=0.2)
    backend = router.state.pool.get(engine.url)
    assert backend is not None
    wait_until(lambda: backend.engine_running is not None)
    assert backend.engine_waiting == 0
    assert backend.capacity_tokens == 8192  # from vllm:cache_config_info


def test_file_discovery_adds_and_drains_backends(sim_engines: Any, router_server: Any, tmp_path: Any) -> None:
    first, second = sim_engines(2)
    listing = tmp_path / "backends.txt"
    listing.write_text(first.url + "\n")
    router = router_server([], discovery="file", backends_file=str(listing))
    pool = router.state.pool
    wait_until(lambda: [b.url for b in pool] == [first.url])
    assert pool.get(first.url).healthy
    listing.write_text(f"# the fleet\n{second.url}\n")
    wait_until(lambda: [b.url for b in pool] == [second.url])
