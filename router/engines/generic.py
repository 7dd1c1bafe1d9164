"""Any other OpenAI-compatible server: routed by load only.

It serves the OpenAI endpoints; whatever its answers say about cached tokens is not
taken as feedback (their meaning is unknown), and it exports no metrics the router
reads, so its load is what this router has in flight there. Adding it took this one
module: the proxy, routing, scraper and OpenAPI document ask the engine, not the path.
"""

from __future__ import annotations

from kvroute.router.engines.base import EngineAPI, EngineFacts
from kvroute.router.engines.openai import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from kvroute.router.engines.usage import Usage


def _no_feedback(usage: Usage | None, facts: EngineFacts) -> int | None:
    return None


def _own_block_size(page_size: int | None) -> int | None:
    return None


GENERIC = EngineAPI(
    name="generic",
    endpoints=(CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES),
    series={},
    cache_info=None,
    reset_cache=None,
    feedback=False,
    observed=_no_feedback,
    index_block_size=_own_block_size,
    describe="an OpenAI-compatible server: load only, no cache feedback",
)
