"""The simulated engine's settings: one frozen dataclass, shared by the CLI and by tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVEventsFormat = Literal["map", "array"]
#: Which engine's API the replica speaks: vLLM's, or SGLang's (benchmarks/sim_engine/sglang_api.py).
EngineAPIName = Literal["vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Everything that shapes one simulated vLLM replica.

    Durations are modelled in "engine seconds" and divided by ``time_scale`` before the
    simulator sleeps, so ``time_scale=100`` runs a workload 100 times faster than a GPU
    with these speeds would, while every ratio (queueing, cache hits) stays the same.
    """

    host: str = "127.0.0.1"
    port: int = 8100
    models: tuple[str, ...] = ("sim",)
    block_size: int = 16
    kv_capacity_tokens: int = 65536
    max_model_len: int | None = None  # None: kv_capacity_tokens, as vLLM sizes it
    prefill_tokens_per_s: float = 20000.0
    decode_tokens_per_s: float = 50.0  # per running sequence
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # prefill chunk per scheduler step
    time_scale: float = 1.0
    tokenizer: str | None = None  # None: tokenizer_index's shipped default
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_format: KVEventsFormat = "map"
    kv_events_topic: str = "kv-events"
    kv_events_buffer_steps: int = 10_000
    #: Publish each step's events this many (wall-clock) seconds after the step, so that the
    #: answers can come first, as they often do from vLLM, whose publisher is a thread of its own.
    kv_events_delay_s: float = 0.0
    seed: int = 0
    engine_id: str = "0"
    # Shortest real sleep of the scheduler: faster steps are simulated back to back and
    # their results delivered together, so a large time_scale does not spin the CPU.
    min_step_wall_s: float = 0.002
    default_max_tokens: int = 16
    #: vLLM's ``--api-key``: ``/v1/*`` then needs ``Authorization: Bearer <key>`` (401 otherwise);
    #: ``/health``, ``/metrics`` and the rest stay open, as in vLLM.
    api_key: str | None = None
    #: ``sglang``: SGLang's native /generate, /server_info, /get_load, /flush_cache, its metric
    #: names and its OpenAI usage rules; ``block_size`` is then its ``--page-size``.
    api: EngineAPIName = "vllm"
    #: SGLang's ``--enable-cache-report``: OpenAI answers carry cached tokens (when > 0).
    enable_cache_report: bool = False

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model name is needed")
        for name, value in (
            ("block_size", self.block_size),
            ("kv_capacity_tokens", self.kv_capacity_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name, rate in (
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("decode_tokens_per_s", self.decode_tokens_per_s),
            ("time_scale", self.time_scale),
        ):
            if rate <= 0:
                raise ValueError(f"{name} must be > 0, got {rate}")
        if self.kv_events_delay_s < 0:
            raise ValueError(f"kv_events_delay_s must be >= 0, got {self.kv_events_delay_s}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if self.api not in ("vllm", "sglang"):
            raise ValueError(f"api must be vllm or sglang, got {self.api!r}")
        if self.kv_events_format not in ("map", "array"):
            raise ValueError(f"kv_events_format must be map or array, got {self.kv_events_format!r}")

    @property
    def num_blocks(self) -> int:
        """KV cache size in blocks (vLLM's ``num_gpu_blocks``)."""
        return self.kv_capacity_tokens // self.block_size

    @property
    def context_len(self) -> int:
        """The longest prompt plus completion a request may ask for."""
        return self.max_model_len or self.kv_capacity_tokens
