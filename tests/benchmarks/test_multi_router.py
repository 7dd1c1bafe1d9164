"""The several-routers benchmark's arrangements: one router, then per count N > 1 N
approximate routers, N exchanging routers and one router with N workers."""

from __future__ import annotations

from kvroute.benchmarks.multi_router import Arrangement, arrangements


def test_arrangements_per_router_count() -> None:
    assert [a.name for a in arrangements([1, 2])] == [
        "one router",
        "2 routers, approximate",
        "2 routers, exchange",
        "one router, --workers 2",
    ]
    assert Arrangement(4, "workers").name == "one router, --workers 4"
