"""What a per-token routing index costs: route + observe per request at block size 16 vs 1.

Precise mode in front of SGLang at page size 1 makes the router index every token (the
block size its KV events announce); this measures that price in process, cache_aware over
4 backends, token-id prompts half shared (no tokenizer time)::

    python -m kvroute.benchmarks.block_size_cost
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvroute.router.config import Settings
from kvroute.router.fleet.backends import Backend
from kvroute.router.routing.routing_engine import RoutingEngine


def run(block_size: int, prompt_len: int, requests: int = 200) -> float:
    """Median seconds x 1e6 of route + observe over ``requests`` prompts of ``prompt_len`` tokens."""
    engine = RoutingEngine(Settings(policy="cache_aware", block_size=block_size, backends=[]))
    backends = [Backend(f"http://b{i}:8000") for i in range(4)]
    for b in backends:
        b.healthy = True
    rng = np.random.default_rng(0)
    system = rng.integers(10, 8000, size=prompt_len // 2).tolist()
    times = []
    for _ in range(requests):
        tail = rng.integers(10, 8000, size=prompt_len // 2).tolist()
        body = {"model": "sim", "prompt": system + tail, "max_tokens": 4}
        start = time.perf_counter()
        plan = engine.route("/v1/completions", body, {}, backends)
        engine.observe(plan, plan.predicted_cached_tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    for prompt_len in (2000, 8000):
        rows = [(run(16, prompt_len), run(1, prompt_len)) for _ in range(3)]
        print(
            f"{prompt_len} tokens, median us per request over 3 rounds:",
            "block 16",
            [round(a) for a, _ in rows],
            "block 1",
            [round(b) for _, b in rows],
        )


if __name__ == "__main__":
    main()
