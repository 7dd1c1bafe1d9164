"""``kvroute sim-engine``: run one simulated vLLM replica until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.server import build_app

log = logging.getLogger("kvroute.sim_engine")


def _models(values: list[str] | None) -> tuple[str, ...]:
    if not values:
        return ("sim",)
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    return tuple(dict.fromkeys(names))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute sim-engine",
        description="A simulated vLLM (or, with --api sglang, SGLang) replica: OpenAI API, real prefix cache,"
        " the engine's metrics and KV events.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--model",
        action="append",
        help="served model name (repeatable or comma list; models after the first act as LoRA adapters)",
    )
    p.add_argument(
        "--api",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the engine API to speak: vLLM's, or SGLang's (/generate, /server_info, /get_load, /flush_cache,"
        " sglang:* metrics)",
    )
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default 16; --api sglang: --page-size)")
    p.add_argument("--page-size", type=int, default=None, help="SGLang's --page-size (default 1: token-granular)")
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="as SGLang's: OpenAI answers carry usage.prompt_tokens_details.cached_tokens (when > 0)",
    )
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
    p.add_argument(
        "--kv-events-delay-s",
        type=float,
        default=0.0,
        help="publish each step's events this many seconds late (answers can come first, as from vLLM)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="as vLLM's: /v1/* needs 'Authorization: Bearer KEY' (default: $VLLM_API_KEY; unset: open)",
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def config_from_args(args: argparse.Namespace) -> SimEngineConfig:
    return SimEngineConfig(
        host=args.host,
        port=args.port,
        models=_models(args.model),
        block_size=_block_size(args),
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
        kv_events_delay_s=args.kv_events_delay_s,
        seed=args.seed,
        api_key=args.api_key or None,
        api=args.api,
        enable_cache_report=args.enable_cache_report,
    )


def _block_size(args: argparse.Namespace) -> int:
    """vLLM's block size (default 16), or SGLang's page size (default 1, token-granular)."""
    if args.page_size is not None and args.block_size is not None and args.page_size != args.block_size:
        raise ValueError("--page-size and --block-size name the same thing: give one")
    given = args.page_size if args.page_size is not None else args.block_size
    if given is not None:
        return int(given)
    return 1 if args.api == "sglang" else 16


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
