"""Engine APIs: one module per engine (:mod:`.vllm`, :mod:`.sglang`, :mod:`.generic`).

:data:`ENGINES` names them (the ``engine`` setting of a backend); :data:`ENDPOINTS` is
every path the router proxies (the union of theirs, first definition wins: the OpenAI
endpoints are one object shared by all). A backend whose engine is not known yet (``auto``
before its first probe) is treated as :data:`DEFAULT_ENGINE`.
"""

from __future__ import annotations

from kvroute.router.engines.base import Endpoint, EngineAPI, EngineFacts
from kvroute.router.engines.generic import GENERIC
from kvroute.router.engines.sglang import SGLANG
from kvroute.router.engines.vllm import VLLM

ENGINES: dict[str, EngineAPI] = {engine.name: engine for engine in (VLLM, SGLANG, GENERIC)}
#: What a backend configured ``auto`` counts as until it is detected.
DEFAULT_ENGINE = VLLM
ENGINE_SETTINGS: tuple[str, ...] = (*ENGINES, "auto")


def _union() -> tuple[Endpoint, ...]:
    seen: dict[str, Endpoint] = {}
    for engine in ENGINES.values():
        for endpoint in engine.endpoints:
            seen.setdefault(endpoint.path, endpoint)
    return tuple(seen.values())


ENDPOINTS: tuple[Endpoint, ...] = _union()
_BY_PATH = {endpoint.path: endpoint for endpoint in ENDPOINTS}


def endpoint_for(path: str) -> Endpoint | None:
    """The proxied endpoint at ``path`` (None: not proxied)."""
    return _BY_PATH.get(path)


def engine_named(name: str) -> EngineAPI:
    """The engine API called ``name`` (``vllm``, ``sglang``, ``generic``); KeyError otherwise."""
    return ENGINES[name]


__all__ = [
    "DEFAULT_ENGINE",
    "ENDPOINTS",
    "ENGINES",
    "ENGINE_SETTINGS",
    "Endpoint",
    "EngineAPI",
    "EngineFacts",
    "endpoint_for",
    "engine_named",
]
