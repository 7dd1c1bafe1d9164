"""SGLang's own endpoints on the simulated replica (``kvroute sim-engine --api sglang``).

The scheduler, prefix cache and OpenAI endpoints are the vLLM simulator's; what differs
is what SGLang's HTTP server says. Each row of the parity table in the README's "SGLang"
section names the SGLang source file (sgl-project/sglang,
``python/sglang/srt/``) a behaviour comes from, via ``shared/notes/sglang.md``:

* ``POST /generate`` (``entrypoints/http_server.py``, ``managers/io_struct.py``
  ``GenerateReqInput``): exactly one of ``text`` / ``input_ids`` (a list of either is a
  batch), ``sampling_params.max_new_tokens`` (default 128), ``stream``, ``rid``. Answer
  ``{text, output_ids, meta_info}`` (a list for a batch); ``meta_info`` has ``id``,
  ``finish_reason`` (null while running, then ``{"type": "length", "length": N}``),
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` (always, no flag) and
  ``e2e_latency`` when finished. Streams: SSE, every event a full object with CUMULATIVE
  text and ``meta_info``, then ``data: [DONE]``; batch events carry ``index``.
* ``GET /server_info`` (and older ``/get_server_info``): server args (``page_size``,
  ``enable_cache_report``, ``served_model_name``...) plus ``max_total_num_tokens``,
  ``max_req_input_len``, ``version``.
* ``GET /model_info`` (and ``/get_model_info``), ``GET /get_load`` (per DP rank
  ``{dp_rank, num_reqs, num_waiting_reqs, num_tokens}``), ``/flush_cache`` (GET or POST;
  400 and nothing done while requests run), ``/health_generate``.
* Cached tokens follow SGLang's radix cache: matched prefix, page-aligned, capped at
  ``input_len - 1`` (``mem_cache/radix_cache.py``); at ``--page-size 1`` token-granular.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from kvroute.benchmarks.sim_engine.protocol import DONE, APIError, parse_json_object
from kvroute.benchmarks.sim_engine.scheduler import SimRequest
from kvroute.benchmarks.sim_engine.server import (
    SHUTTING_DOWN,
    SSE_HEADERS,
    Generation,
    Handlers,
    SimEngine,
)
from kvroute.benchmarks.sim_engine.tokens import TokenizationError
from kvroute.benchmarks.sim_engine.validation import GenerationParams, Sampling

#: SGLang's ``SamplingParams.max_new_tokens`` default.
DEFAULT_MAX_NEW_TOKENS = 128
#: What ``/server_info`` answers as ``version`` (a simulated 0.5 series server).
SIM_VERSION = "0.5.5-kvroute-sim"
_FLUSHED = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
_NOT_FLUSHED = "Cache not flushed because there are pending requests. (When there are running or waiting requests, the operation will not be performed.)\n"


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One validated ``/generate`` body."""

    prompts: tuple[str | list[int], ...]
    batch: bool
    max_new_tokens: int
    stream: bool
    rids: tuple[str, ...]


def _error(status: int, message: str) -> web.Response:
    """SGLang's error body: ``{"error": {"message": ...}}`` with the HTTP status."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    """The fields of ``GenerateReqInput`` this simulator acts on; a 400 for the rest's misuse."""
    given = [name for name in ("text", "input_ids", "input_embeds") if body.get(name) is not None]
    if len(given) != 1:
        raise APIError(400, "Either text, input_ids or input_embeds should be provided.")
    if given[0] == "input_embeds":
        raise APIError(400, "input_embeds is not supported by the simulated engine")
    value = body[given[0]]
    if given[0] == "text":
        batch = isinstance(value, list)
        prompts = tuple(value) if batch else (value,)
        if not all(isinstance(prompt, str) for prompt in prompts):
            raise APIError(400, "text must be a string or a list of strings")
    else:
        batch = isinstance(value, list) and bool(value) and isinstance(value[0], list)
        prompts = tuple(value) if batch else (value,)
        if not all(isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) for prompt in prompts):
            raise APIError(400, "input_ids must be a list of token ids or a list of such lists")
    if not prompts:
        raise APIError(400, "The batch is empty.")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise APIError(400, "sampling_params must be an object")
    max_new = sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise APIError(400, "max_new_tokens must be at least 0, got " + repr(max_new))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be a boolean")
    rid = body.get("rid")
    if rid is None:
        rids = tuple(uuid.uuid4().hex for _ in prompts)
    elif isinstance(rid, str) and not batch:
        rids = (rid,)
    elif isinstance(rid, list) and len(rid) == len(prompts) and all(isinstance(r, str) for r in rid):
        rids = tuple(rid)
    else:
        raise APIError(400, "The rid should be a string for one request or a list of strings for a batch.")
    return GenerateRequest(prompts, batch, max_new, stream, rids)


def _params(request: GenerateRequest) -> GenerationParams:
    """The request as the shared engine core takes it (greedy defaults: SGLang validates sampling itself)."""
    sampling = Sampling(
        n=1,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        min_tokens=0,
        stop=(),
        logprobs=None,
        prompt_logprobs=None,
        logit_bias=(),
    )
    return GenerationParams(
        endpoint="completion",
        model=None,
        stream=request.stream,
        include_usage=False,
        max_tokens=request.max_new_tokens,
        max_tokens_param="max_new_tokens",
        cache_salt=None,
        sampling=sampling,
        prompts=request.prompts,
        add_generation_prompt=True,
        echo=False,
        suffix=None,
    )


class SGLangHandlers:
    """SGLang's native endpoints over the shared :class:`SimEngine`."""

    def __init__(self, engine: SimEngine, handlers: Handlers) -> None:
        self.engine = engine
        self.handlers = handlers

    async def generate(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        try:
            parsed = parse_generate(parse_json_object(await request.read()))
            prompts = self._encode(parsed.prompts)
            generation = engine.new_generation(_params(parsed), engine.config.models[0], prompts)
        except APIError as error:
            return _error(error.status, error.message)
        scheduler = engine.scheduler
        assert scheduler is not None
        sequences = generation.sequences
        with engine.watched(request):
            for sequence in sequences:
                scheduler.submit(sequence)
            try:
                if parsed.stream:
                    return await self._stream(request, parsed, generation)
                for sequence in sequences:
                    await sequence.wait_until_finished()
                    if sequence.aborted:
                        return _error(SHUTTING_DOWN.status, SHUTTING_DOWN.message)
                answers = [self._answer(parsed, sequence, index) for index, sequence in enumerate(sequences)]
                return web.Response(
                    body=orjson.dumps(answers if parsed.batch else answers[0]), content_type="application/json"
                )
            finally:
                for sequence in sequences:
                    scheduler.abort(sequence)

    def _encode(self, prompts: tuple[str | list[int], ...]) -> list[np.ndarray]:
        tokenizer = self.engine.tokenizer
        try:
            encoded = [tokenizer.encode_prompt(prompt) for prompt in prompts]
        except TokenizationError as exc:
            raise APIError(400, str(exc)) from None
        if any(len(ids) == 0 for ids in encoded):
            raise APIError(400, "The input_ids is empty.")
        return encoded

    def _answer(self, parsed: GenerateRequest, sequence: SimRequest, index: int) -> dict[str, Any]:
        """One prompt's object, its text and ids CUMULATIVE up to what was delivered."""
        count = sequence.delivered
        ids = sequence.output[:count].tolist()
        finished = sequence.finished and count == sequence.max_tokens
        meta: dict[str, Any] = {
            "id": parsed.rids[index],
            "finish_reason": {"type": "length", "length": count} if finished else None,
            "prompt_tokens": sequence.prompt_len,
            "completion_tokens": count,
            "cached_tokens": sequence.cached_tokens,
        }
        if finished and sequence.finished_at is not None:
            meta["e2e_latency"] = sequence.finished_at - sequence.arrival
        answer: dict[str, Any] = {"text": self.engine.vocabulary.text(ids), "output_ids": ids, "meta_info": meta}
        if parsed.batch:
            answer["index"] = index
        return answer

    async def _stream(
        self, request: web.Request, parsed: GenerateRequest, generation: Generation
    ) -> web.StreamResponse:
        sequences = generation.sequences
        await sequences[0].wait_for_tokens(0)
        if sequences[0].aborted:
            return _error(SHUTTING_DOWN.status, SHUTTING_DOWN.message)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        sent = [0] * len(sequences)
        while True:
            events = []
            for index, sequence in enumerate(sequences):
                if sequence.delivered > sent[index]:
                    events.append(b"data: " + orjson.dumps(self._answer(parsed, sequence, index)) + b"\n\n")
                    sent[index] = sequence.delivered
            if events:
                await response.write(b"".join(events))
            if any(sequence.aborted for sequence in sequences):
                raise asyncio.CancelledError  # cut without [DONE], as a dying server would
            waiting = next((i for i, s in enumerate(sequences) if not s.finished or sent[i] < s.delivered), None)
            if waiting is None:
                break
            await sequences[waiting].wait_for_tokens(sent[waiting])
        await response.write(DONE)
        await response.write_eof()
        return response

    async def server_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        model = config.models[0]
        return web.json_response(
            {
                "model_path": model,
                "tokenizer_path": config.tokenizer or model,
                "served_model_name": model,
                "page_size": config.block_size,
                "chat_template": None,
                "dp_size": 1,
                "tp_size": 1,
                "enable_cache_report": config.enable_cache_report,
                "enable_metrics": True,
                "kv_events_config": orjson.dumps(
                    {
                        "publisher": "zmq",
                        "endpoint": config.kv_events_endpoint,
                        "replay_endpoint": config.kv_events_replay_endpoint,
                        "topic": config.kv_events_topic,
                    }
                ).decode()
                if config.kv_events_endpoint
                else None,
                "max_total_num_tokens": config.num_blocks * config.block_size,
                "max_req_input_len": config.context_len - 1,
                "version": SIM_VERSION,
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        config = self.engine.config
        return web.json_response(
            {
                "model_path": config.models[0],
                "tokenizer_path": config.tokenizer or config.models[0],
                "is_generation": True,
            }
        )

    async def get_load(self, request: web.Request) -> web.Response:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        used = int(scheduler.kv_usage * self.engine.config.num_blocks * self.engine.config.block_size)
        return web.json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": scheduler.num_running + scheduler.num_waiting,
                    "num_waiting_reqs": scheduler.num_waiting,
                    "num_tokens": used,
                }
            ]
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        if scheduler.num_running or scheduler.num_waiting:
            return web.Response(status=400, text=_NOT_FLUSHED)
        scheduler.reset_prefix_cache()
        return web.Response(status=200, text=_FLUSHED)


def add_sglang_routes(app: web.Application, engine: SimEngine, handlers: Handlers) -> None:
    """SGLang's native paths (the vLLM-only /tokenize, /detokenize, /reset_prefix_cache are left out)."""
    sglang = SGLangHandlers(engine, handlers)
    app.router.add_post("/generate", sglang.generate)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, sglang.server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, sglang.model_info)
    app.router.add_get("/get_load", sglang.get_load)
    app.router.add_get("/flush_cache", sglang.flush_cache)
    app.router.add_post("/flush_cache", sglang.flush_cache)
    app.router.add_get("/health_generate", handlers.health)


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "SIM_VERSION", "add_sglang_routes", "parse_generate"]
