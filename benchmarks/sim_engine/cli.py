"""``kvroute sim-engine``: run one simulated vLLM replica until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from benchmarks.sim_engine.config import SimEngineConfig
from benchmarks.sim_engine.server import build_app

log = logging.getLogger("kvroute.sim_engine")


def _models(values: list[str] | None) -> tuple[str, ...]:
    if not values:
        return ("sim",)
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    return tuple(dict.fromkeys(names))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute sim-engine",
        description="A simulated vLLM replica: OpenAI API, real prefix cache, vLLM metrics and KV events.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--model",
        action="append",
        help="served model name (repeatable or comma list; models after the first act as LoRA adapters)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-capacity-tokens", type=int, default=65536)
    p.add_argument("--max-model-len", type=int, default=None, help="default: --kv-capacity-tokens")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    p.add_argument("--decode-tokens-per-s", type=float, default=50.0, help="per running sequence")
    p.add_argument("--max-num-seqs", type=int, default=256, help="running batch limit; the rest waits")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill chunk per step")
    p.add_argument("--time-scale", type=float, default=1.0, help="run N times faster than real time")
    p.add_argument("--tokenizer", default=None, help="local HF tokenizer dir (default: kvroute's)")
    p.add_argument("--kv-events-endpoint", default=None, help="ZMQ PUB endpoint, e.g. tcp://*:5557")
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER endpoint, e.g. tcp://*:5558")
    p.add_argument("--kv-events-format", choices=("map", "array"), default="map")
    p.add_argument("--kv-events-topic", default="kv-events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--api-key", default=os.environ.get("VLLM_API_KEY"),
        help="as vLLM's: /v1/* needs 'Authorization: Bearer KEY' (default: $VLLM_API_KEY; unset: open)",
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def config_from_args(args: argparse.Namespace) -> SimEngineConfig:
    return SimEngineConfig(
        host=args.host,
        port=args.port,
        models=_models(args.model),
        block_size=args.block_size,
        kv_capacity_tokens=args.kv_capacity_tokens,
        max_model_len=args.max_model_len,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        time_scale=args.time_scale,
        tokenizer=args.tokenizer,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_format=args.kv_events_format,
        kv_events_topic=args.kv_events_topic,
        seed=args.seed,
        api_key=args.api_key or None,
    )


async def serve(config: SimEngineConfig) -> None:
    """Serve until SIGINT or SIGTERM, then close connections and sockets."""
    app = build_app(config)
    # handler_cancellation: a client that hangs up aborts its request at once.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    log.warning("sim-engine serving %s on http://%s:%d", ",".join(config.models), config.host, config.port)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvroute sim-engine: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(config))
    except (OSError, ValueError) as exc:
        # A missing tokenizer directory, a port in use, a bad ZeroMQ endpoint.
        print(f"kvroute sim-engine: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0
