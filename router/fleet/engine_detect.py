"""Which engine API a backend speaks, and what it says about itself: one probe per backend.

``engine: auto`` backends are told apart at their first passing health check:

1. ``GET /server_info`` (older SGLang: ``/get_server_info``) answering a JSON object with
   ``max_total_num_tokens`` or ``page_size``: SGLang, with its page size, KV capacity and
   ``enable_cache_report`` (``entrypoints/http_server.py``);
2. else ``GET /metrics`` naming ``vllm:`` (or ``sglang:``) series;
3. else ``GET /version`` answering ``{"version": ...}``: vLLM;
4. else a generic OpenAI server (load only).

A backend configured ``sglang`` still reads ``/server_info`` once, for those facts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import aiohttp
import orjson

from kvroute.router.engines import ENGINES, EngineAPI, EngineFacts
from kvroute.router.engines.generic import GENERIC
from kvroute.router.engines.sglang import SGLANG, facts_from_server_info
from kvroute.router.engines.vllm import VLLM
from kvroute.router.fleet.backends import Backend, BackendPool

log = logging.getLogger("kvroute.engines")

_SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError)


def needs_probe(backend: Backend) -> bool:
    """Whether a passing health check should (still) ask the backend what it is."""
    return backend.engine_facts.detected_by is None and backend.engine_setting in ("auto", "sglang")


async def learn_engine(
    session: aiohttp.ClientSession, pool: BackendPool, backend: Backend, timeout: aiohttp.ClientTimeout
) -> None:
    """Probe ``backend`` and record its engine (``auto``) and facts in ``pool``; logs the outcome once."""
    engine, facts = await detect(session, backend, timeout)
    if backend.engine_setting != "auto":
        engine = ENGINES[backend.engine_setting]
        if engine is not SGLANG:
            return
        facts = replace(facts, detected_by=facts.detected_by or "configured")
    pool.set_engine(backend, engine, facts)
    log.info(
        "backend %s: engine %s (%s by %s; page size %s, KV capacity %s tokens, cache report %s)",
        backend.url,
        engine.name,
        backend.engine_source,
        facts.detected_by,
        facts.page_size,
        facts.capacity_tokens,
        facts.cache_report,
    )


async def detect(
    session: aiohttp.ClientSession, backend: Backend, timeout: aiohttp.ClientTimeout
) -> tuple[EngineAPI, EngineFacts]:
    """The engine behind ``backend`` and its facts (see the module docstring)."""

    async def get(path: str) -> bytes | None:
        try:
            async with session.get(
                backend.access.base_url + path,
                headers=backend.access.probe_headers,
                ssl=backend.access.aiohttp_ssl,
                timeout=timeout,
            ) as response:
                return await response.read() if response.status == 200 else None
        except _ERRORS:
            return None

    for path in _SERVER_INFO_PATHS:
        info = _json_object(await get(path))
        if info is not None and ("max_total_num_tokens" in info or "page_size" in info):
            return SGLANG, replace(facts_from_server_info(info), detected_by=path)
    metrics = await get("/metrics")
    if metrics is not None:
        if b"\nvllm:" in metrics or metrics.startswith(b"vllm:") or b" vllm:" in metrics:
            return VLLM, EngineFacts(detected_by="/metrics")
        if b"sglang:" in metrics:
            return SGLANG, EngineFacts(detected_by="/metrics")
    version = _json_object(await get("/version"))
    if version is not None and isinstance(version.get("version"), str):
        return VLLM, EngineFacts(version=version["version"], detected_by="/version")
    return GENERIC, EngineFacts(detected_by="none of /server_info, /metrics, /version")


def _json_object(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
