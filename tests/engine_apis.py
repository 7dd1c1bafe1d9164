"""Running a test against both simulated engine APIs: their options and their metric names."""

from __future__ import annotations

from typing import Any

from kvroute.router.engines import ENGINES

#: The APIs the simulator speaks; a parametrized ``api`` fixture takes these.
APIS = ("vllm", "sglang")


def sim_options(api: str, **options: Any) -> dict[str, Any]:
    """``SimEngineConfig`` fields of a sim speaking ``api``: SGLang's as it runs by default
    (page size 1), with ``--enable-cache-report`` so its OpenAI answers report hits."""
    options.setdefault("api", api)
    if api == "sglang":
        options.setdefault("block_size", 1)
        options.setdefault("enable_cache_report", True)
    return options


def series(api: str, field: str) -> str:
    """The engine's own sample name for an ``EngineStats`` field, from its engine module
    (e.g. ``running``: ``vllm:num_requests_running`` / ``sglang:num_running_reqs``)."""
    return next(name for name, feeds in ENGINES[api].series.items() if feeds == field)
