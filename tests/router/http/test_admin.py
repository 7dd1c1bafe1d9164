"""The admin API: off without a token, bearer-checked, and list / add / remove / drain backends."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.servers import RouterServer, SimServer, wait_until

TOKEN = "admin-secret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MESSAGES = [{"role": "user", "content": "hello there"}]


def admin(router: RouterServer, method: str, path: str = "/admin/backends", **kwargs: Any) -> httpx.Response:
    kwargs.setdefault("headers", AUTH)
    return httpx.request(method, router.url + path, timeout=30, **kwargs)


def test_admin_paths_do_not_exist_without_a_token(sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1))
    for method in ("GET", "POST", "DELETE"):
        response = admin(router, method, json={"url": "http://x:1"})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "not_found"
    assert admin(router, "POST", "/admin/backends/drain", json={"url": "http://x:1"}).status_code == 404


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
    ],
    ids=["none", "wrong", "no-scheme", "basic", "longer"],
)
def test_admin_needs_the_bearer_token(headers: dict[str, str], sim_engines: Any, router_server: Any) -> None:
    router = router_server(sim_engines(1), admin_token=TOKEN)
    response = admin(router, "GET", headers=headers)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert admin(router, "DELETE", headers=headers, json={"url": "http://x:1"}).status_code == 401
    assert admin(router, "GET", "/admin/peers", headers=headers).status_code == 401


def test_peers_without_an_exchange_say_so(sim_engines: Any, router_server: Any) -> None:
    """``GET /admin/peers`` (shown with peers in tests/router/routing/test_peer_auth.py and
    test_peer_discovery.py): a router that exchanges with no one answers nulls, not a 404."""
    router = router_server(sim_engines(1), admin_token=TOKEN)
    assert admin(router, "GET", "/admin/peers").json() == {"exchange": None, "discovery": None}


def test_list_add_and_remove(sim_engines: Any, router_server: Any) -> None:
    first, second = sim_engines(2)
    router = router_server([first], admin_token=TOKEN)
    listed = admin(router, "GET").json()["backends"]
    assert [(b["url"], b["healthy"], b["models"]) for b in listed] == [(first.url, True, ["sim"])]

    added = admin(router, "POST", json={"url": second.url + "/", "capacity_tokens": 4096})
    assert added.status_code == 201
    assert added.json()["url"] == second.url and added.json()["capacity_tokens"] == 4096
    assert admin(router, "POST", json={"url": second.url}).status_code == 409
    assert admin(router, "POST", json={"url": "ftp://nope"}).status_code == 400
    assert admin(router, "POST", content=b"{broken").status_code == 400

    client = router.client()
    seen = {
        client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2).headers[
            "x-kvroute-backend"
        ]
        for _ in range(4)
    }
    assert seen == {first.url, second.url}

    removed = admin(router, "DELETE", json={"url": first.url})
    assert removed.status_code == 200
    assert admin(router, "DELETE", params={"url": first.url}).status_code == 404
    assert [b["url"] for b in admin(router, "GET").json()["backends"]] == [second.url]
    assert first.url not in httpx.get(router.url + "/metrics", timeout=30).text  # no leaked series
    assert {
        client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2).headers[
            "x-kvroute-backend"
        ]
        for _ in range(3)
    } == {second.url}


def test_backends_list_the_tokens_the_prefix_index_holds_of_them(sim_engines: Any, router_server: Any) -> None:
    """``index_tokens`` is what the routing engine's index holds (a multiple of the block
    size, as ``kvroute_index_blocks`` counts it), not a field nobody sets."""
    engines = sim_engines(2)
    router = router_server(engines, policy="cache_aware", admin_token=TOKEN)
    client = router.client()
    for user in range(4):
        history = [{"role": "user", "content": f"user {user}: " + " ".join(["a long question"] * 40)}]
        client.chat.completions.create(model="sim", messages=history, max_tokens=2)
    listed = admin(router, "GET").json()["backends"]
    held = {backend["url"]: backend["index_tokens"] for backend in listed}
    scrape = router.metrics()
    assert held == {engine.url: scrape.value("kvroute_index_blocks", backend=engine.url) * 16 for engine in engines}
    assert sum(held.values()) > 0


def test_adding_an_unreachable_backend_keeps_it_unhealthy(router_server: Any) -> None:
    router = router_server([], admin_token=TOKEN)
    added = admin(router, "POST", json={"url": "http://127.0.0.1:9"})
    assert added.status_code == 201
    assert added.json()["healthy"] is False


def test_a_data_parallel_engine_is_added_rank_by_rank(sim_engines: Any, router_server: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([], admin_token=TOKEN, data_parallel_size=2)
    whole = admin(router, "POST", json={"url": sim.url})  # two ranks by the router-wide setting
    assert whole.status_code == 400 and "one by one" in whole.json()["error"]["message"]
    for rank in (0, 1):
        added = admin(router, "POST", json={"url": sim.url, "data_parallel_size": 2, "data_parallel_rank": rank})
        assert added.status_code == 201 and added.json()["url"] == f"{sim.url}#dp{rank}"
    again = admin(router, "POST", json={"url": sim.url, "data_parallel_rank": 1})
    assert again.status_code == 409
    removed = admin(router, "DELETE", params={"url": f"{sim.url}#dp1"})
    assert removed.status_code == 200 and [b.url for b in router.state.pool] == [f"{sim.url}#dp0"]


def test_drain_finishes_running_streams_then_removes_the_backend(sim_engines: Any, router_server: Any) -> None:
    slow: SimServer
    (slow,) = sim_engines(1, time_scale=1.0, decode_tokens_per_s=60.0)
    (other,) = sim_engines(1)
    router = router_server([slow], admin_token=TOKEN)
    client = router.client()
    stream = client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=60, stream=True)
    first_chunk = next(iter(stream))
    assert first_chunk.choices

    assert admin(router, "POST", json={"url": other.url}).status_code == 201
    drained = admin(router, "POST", "/admin/backends/drain", json={"url": slow.url})
    assert drained.status_code == 202
    assert drained.json()["draining"] is True and drained.json()["in_flight"] == 1
    # New requests avoid the draining backend while its stream goes on.
    answer = client.chat.completions.with_raw_response.create(model="sim", messages=MESSAGES, max_tokens=2)
    assert answer.headers["x-kvroute-backend"] == other.url

    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "length"
    wait_until(lambda: slow.url not in router.state.pool)
    assert [b["url"] for b in admin(router, "GET").json()["backends"]] == [other.url]


def test_drain_of_an_idle_backend_removes_it_at_once(sim_engines: Any, router_server: Any) -> None:
    first, second = sim_engines(2)
    router = router_server([first, second], admin_token=TOKEN)
    assert admin(router, "POST", "/admin/backends/drain", json={"url": first.url}).status_code == 202
    assert [b["url"] for b in admin(router, "GET").json()["backends"]] == [second.url]
    assert admin(router, "POST", "/admin/backends/drain", json={"url": first.url}).status_code == 404
    assert admin(router, "POST", "/admin/backends/drain", json={}).status_code == 400


def test_allowed_networks_restrict_added_backends(sim_engines: Any, router_server: Any) -> None:
    (sim,) = sim_engines(1)
    router = router_server([], admin_token=TOKEN, admin_allowed_networks=["10.0.0.0/8"])
    refused = admin(router, "POST", json={"url": sim.url})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "backend_not_allowed"
    allowed = router_server([], admin_token=TOKEN, admin_allowed_networks=["127.0.0.0/8", "::1/128"])
    assert admin(allowed, "POST", json={"url": sim.url}).status_code == 201


def test_concurrent_admin_calls_and_traffic(sim_engines: Any, router_server: Any) -> None:
    sims = sim_engines(3)
    router = router_server([sims[0]], admin_token=TOKEN)
    errors: list[BaseException] = []

    def traffic() -> None:
        client = router.client()
        try:
            for _ in range(20):
                client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=2)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=traffic)
    worker.start()
    for sim in sims[1:]:
        assert admin(router, "POST", json={"url": sim.url}).status_code == 201
    for sim in sims[1:]:
        assert admin(router, "POST", "/admin/backends/drain", json={"url": sim.url}).status_code == 202
    worker.join(timeout=60)
    assert not errors
    wait_until(lambda: [b.url for b in router.state.pool] == [sims[0].url])
    assert all(b.in_flight == 0 for b in router.state.pool)
