"""The simulated vLLM (or, with ``api="sglang"``, SGLang) replica as an aiohttp application.

``build_app(SimEngineConfig(...))`` returns a ``web.Application`` speaking vLLM's
OpenAI-compatible API (chat and text completions, streaming, models, tokenize,
embeddings, metrics), plus ``/sim/fault`` and ``/sim/stats`` for the reliability suite.
The engine behind it (:class:`SimEngine`) is reachable as ``app[SIM_ENGINE]``.

Client disconnects abort the request: one watchdog task notices closed connections of
in-flight handlers and cancels them (aiohttp no longer cancels handlers by itself), and
every handler's ``finally`` returns its slot to the scheduler.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from kvroute.benchmarks.sim_engine.cache import CacheKey, PrefixCache
from kvroute.benchmarks.sim_engine.config import SimEngineConfig
from kvroute.benchmarks.sim_engine.faults import FAULT_MODES, FaultInjector, FaultMode
from kvroute.benchmarks.sim_engine.generation import Embedder, OutputVocabulary
from kvroute.benchmarks.sim_engine.kv_events import KVEventPublisher
from kvroute.benchmarks.sim_engine.metrics import EngineMetrics
from kvroute.benchmarks.sim_engine.protocol import (
    DONE,
    APIError,
    GenerationApi,
    StreamFormatter,
    full_response,
    new_id,
    parse_json_object,
    sglang_usage,
    usage,
)
from kvroute.benchmarks.sim_engine.scheduler import Scheduler, SimRequest
from kvroute.benchmarks.sim_engine.sglang_events import SGLangEventHashes
from kvroute.benchmarks.sim_engine.sglang_metrics import SGLangMetrics
from kvroute.benchmarks.sim_engine.tokens import SimTokenizer, TokenizationError
from kvroute.benchmarks.sim_engine.validation import (
    GenerationParams,
    check_requested_budget,
    check_suffix,
    empty_prompt_error,
    output_budget,
    parse_detokenize,
    parse_embeddings,
    parse_generation,
    parse_tokenize,
)
from kvroute.tokenizer_index.hashing import request_salt

__all__ = ["SIM_ENGINE", "SimEngine", "SimEngineConfig", "build_app"]

log = logging.getLogger(__name__)

JSON = "application/json"
DISCONNECT_POLL_S = 0.2
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SHUTTING_DOWN = APIError(503, "the engine is shutting down")


class SimEngine:
    """One replica: tokenizer, prefix cache, scheduler, KV events, faults, metrics."""

    def __init__(self, config: SimEngineConfig, tokenizer: SimTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or SimTokenizer.load(config.tokenizer)
        self.vocabulary = OutputVocabulary.from_decoder(
            self.tokenizer.decode, self.tokenizer.vocab_size, self.tokenizer.special_ids, config.seed
        )
        self.metrics: EngineMetrics | SGLangMetrics = (
            SGLangMetrics(config) if config.api == "sglang" else EngineMetrics(config)
        )
        self.faults = FaultInjector()
        self.publisher: KVEventPublisher | None = None
        self.cache: PrefixCache | None = None
        self.scheduler: Scheduler | None = None
        self.hanging = 0
        self._handlers: dict[asyncio.Task[Any], web.Request] = {}
        self._watchdog: asyncio.Task[None] | None = None

    @functools.cached_property
    def embedder(self) -> Embedder:
        """Built on first use: most replicas never serve an embedding."""
        return Embedder(self.tokenizer.vocab_size, self.config.seed)

    async def start(self) -> None:
        """Bind the event sockets and start the scheduler (needs the running loop)."""
        config = self.config
        if config.kv_events_endpoint is not None:
            self.publisher = KVEventPublisher(
                config.kv_events_endpoint,
                replay_endpoint=config.kv_events_replay_endpoint,
                event_format=config.kv_events_format,
                topic=config.kv_events_topic,
                buffer_steps=config.kv_events_buffer_steps,
                delay_s=config.kv_events_delay_s,
            )
            self.publisher.start()
        sglang_events = SGLangEventHashes() if config.api == "sglang" else None
        self.cache = PrefixCache(config.block_size, config.num_blocks, self.publisher, sglang_events)
        self.scheduler = Scheduler(config, self.cache, self.metrics, self.publisher)
        self.scheduler.start()
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_disconnects())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        for task in list(self._handlers):
            task.cancel()
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.publisher is not None:
            await self.publisher.close()

    # --- requests ---------------------------------------------------------------------

    def cache_key(self, model: str, cache_salt: str | None) -> CacheKey:
        """Models after the first are served as LoRA adapters of the first, as in vLLM."""
        lora_index = self.config.models.index(model)
        lora_name = model if lora_index > 0 else None
        return CacheKey(
            salt=request_salt(model, cache_salt),
            lora_id=lora_index if lora_index > 0 else None,
            lora_name=lora_name,
            cache_salt=cache_salt,
        )

    def check_model(self, model: str) -> None:
        if model not in self.config.models:
            raise APIError(
                404, f"The model `{model}` does not exist. Valid aliases: {self.config.models[0]}.", param="model"
            )

    def served_model(self, model: str | None) -> str:
        """The model a generation request names; vLLM serves one that names none with its first."""
        if model is None:
            return self.config.models[0]
        self.check_model(model)
        return model

    def new_generation(self, params: GenerationParams, model: str, prompts: list[np.ndarray]) -> Generation:
        """The sequences of one request, as vLLM fans it out: per prompt, ``n`` samples.

        Each prompt gets its output budget and its sampling checks in turn (the first that
        fails answers the request); a sample's tokens depend on its index, so the choices
        of ``n > 1`` differ.
        """
        assert self.cache is not None
        config = self.config
        sampling = params.sampling
        key = self.cache_key(model, params.cache_salt)
        arrival = asyncio.get_running_loop().time()
        response_id = new_id(params.endpoint)
        sequences: list[SimRequest] = []
        for prompt in prompts:
            budget = output_budget(params, len(prompt), config.context_len, config.default_max_tokens)
            sampling.verify(budget, self.tokenizer.vocab_size)
            hashes = self.cache.hashes(prompt, key)
            for sample in range(sampling.n):
                sequences.append(
                    SimRequest(
                        request_id=response_id if not sequences else f"{response_id}-{len(sequences)}",
                        prompt=prompt,
                        hashes=hashes,
                        key=key,
                        output=self.vocabulary.completion(prompt, budget, sample),
                        arrival=arrival,
                        streaming=params.stream,
                    )
                )
        report = sglang_usage(config.enable_cache_report) if config.api == "sglang" else usage
        return Generation(params, model, response_id, sequences, sum(len(prompt) for prompt in prompts), report)

    # --- disconnects ------------------------------------------------------------------

    @contextlib.contextmanager
    def watched(self, request: web.Request) -> Iterator[None]:
        """Cancel the current handler if its client goes away while inside this block."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = request
        try:
            yield
        finally:
            self._handlers.pop(task, None)

    async def _watch_disconnects(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for task, request in list(self._handlers.items()):
                transport = request.transport
                if transport is None or transport.is_closing():
                    self._handlers.pop(task, None)
                    task.cancel()


SIM_ENGINE = web.AppKey("sim_engine", SimEngine)


@dataclass(frozen=True, slots=True)
class Generation:
    """One chat or completion request: its sequences in choice order (prompt-major, then sample)."""

    params: GenerationParams
    model: str
    response_id: str
    sequences: list[SimRequest]
    prompt_tokens: int  # each prompt counted once, however many samples it has
    #: The usage object as this engine writes it (vLLM's, or SGLang's cache-report rule).
    report: Callable[[int, int, int], dict[str, Any]] = usage

    def usage(self, completion_tokens: int, cached_from: SimRequest) -> dict[str, Any]:
        # vLLM reports the cached tokens of one prompt: the last one's in a full answer,
        # the first one's in a stream.
        return self.report(self.prompt_tokens, completion_tokens, cached_from.cached_tokens)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON)


def _error(error: APIError) -> web.Response:
    return web.Response(body=error.body(), status=error.status, content_type=JSON)


async def _read_object(request: web.Request) -> dict[str, Any]:
    return parse_json_object(await request.read())


class Handlers:
    """The HTTP endpoints; each translates :class:`APIError` into vLLM's error body."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    # --- generation -------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, endpoint: GenerationApi) -> web.StreamResponse:
        engine = self.engine
        try:
            body = await _read_object(request)
            params = parse_generation(body, endpoint)
            model = engine.served_model(params.model)
            check_requested_budget(params, engine.config.context_len)
            generation = engine.new_generation(params, model, self._prompt_tokens(body, params))
        except APIError as error:
            return _error(error)
        fault = engine.faults.take()
        if fault == "error_500":
            return _error(APIError(500, "simulated internal error (fault injection)"))
        if fault == "error_503":
            return _error(APIError(503, "simulated overload (fault injection)"))
        sequences = generation.sequences
        with engine.watched(request):
            if fault == "hang_before_first_byte":
                await self._hang()
            scheduler = engine.scheduler
            assert scheduler is not None
            for sequence in sequences:
                scheduler.submit(sequence)
            try:
                if params.stream:
                    return await self._stream(request, generation, fault)
                return await self._respond(request, generation, fault)
            finally:
                for sequence in sequences:
                    scheduler.abort(sequence)

    def _prompt_tokens(self, body: dict[str, Any], params: GenerationParams) -> list[np.ndarray]:
        """The token ids of each prompt: the rendered chat, or every prompt of a completion batch."""
        tokenizer = self.engine.tokenizer
        try:
            if params.endpoint == "chat":
                prompts = [tokenizer.encode_chat_body(body, add_generation_prompt=params.add_generation_prompt)]
            else:
                check_suffix(params)
                if not all(params.prompts):
                    raise empty_prompt_error()
                prompts = [tokenizer.encode_prompt(prompt) for prompt in params.prompts]
        except TokenizationError as exc:
            raise APIError(400, str(exc)) from None
        if any(len(ids) == 0 for ids in prompts):
            raise empty_prompt_error()
        return prompts

    async def _respond(self, request: web.Request, generation: Generation, fault: FaultMode) -> web.StreamResponse:
        sequences = generation.sequences
        if fault in ("stall_mid_stream", "close_mid_stream"):
            await sequences[0].wait_for_tokens(0)
            response = web.StreamResponse(headers={"Content-Type": JSON})
            body = self._final_body(generation, complete=True)
            response.content_length = len(body)
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
            return await self._break_off(request, response, generation, fault)
        for sequence in sequences:
            await sequence.wait_until_finished()
            if sequence.aborted:
                return _error(SHUTTING_DOWN)
        return web.Response(body=self._final_body(generation, complete=False), content_type=JSON)

    def _final_body(self, generation: Generation, complete: bool) -> bytes:
        """The whole answer: every choice's text so far (``complete``: as it will be in the end)."""
        vocabulary = self.engine.vocabulary
        sequences = generation.sequences
        counts = [sequence.max_tokens if complete else sequence.generated for sequence in sequences]
        texts = [vocabulary.text(sequence.output[:count].tolist()) for sequence, count in zip(sequences, counts)]
        last_prompt = sequences[len(sequences) - generation.params.sampling.n]
        usage_body = generation.usage(sum(counts), cached_from=last_prompt)
        return full_response(generation.params.endpoint, generation.response_id, generation.model, texts, usage_body)

    async def _stream(self, request: web.Request, generation: Generation, fault: FaultMode) -> web.StreamResponse:
        vocabulary = self.engine.vocabulary
        sequences = generation.sequences
        first = sequences[0]
        formatter = StreamFormatter(generation.params.endpoint, generation.response_id, generation.model)
        # Headers go out with the first token, as from vLLM: until then a router may
        # still retry elsewhere, and the first byte is the first token.
        await first.wait_for_tokens(0)
        if first.aborted:
            return _error(SHUTTING_DOWN)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        sent = [0] * len(sequences)
        # Every choice's opening (chat: the assistant role) precedes the first tokens.
        chunks = [formatter.opening(index) for index in range(len(sequences))]
        while True:
            for index, sequence in enumerate(sequences):
                count = sequence.delivered
                if count > sent[index]:
                    pieces = [vocabulary.piece_json(token) for token in sequence.output[sent[index] : count].tolist()]
                    chunks.append(formatter.tokens(pieces, count == sequence.max_tokens, index))
                    sent[index] = count
            await response.write(b"".join(chunks))
            chunks.clear()
            if fault in ("stall_mid_stream", "close_mid_stream"):
                return await self._break_off(request, response, generation, fault)
            waiting = next(
                (
                    index
                    for index, sequence in enumerate(sequences)
                    if not sequence.finished or sent[index] < sequence.delivered
                ),
                None,
            )
            if waiting is None or any(sequence.aborted for sequence in sequences):
                break
            await sequences[waiting].wait_for_tokens(sent[waiting])
        if any(sequence.aborted for sequence in sequences):
            # Only a shutdown aborts a request whose handler is still running: cut the
            # stream without [DONE], as a dying engine would.
            raise asyncio.CancelledError
        if generation.params.include_usage:
            await response.write(formatter.usage(generation.usage(sum(sent), cached_from=first)))
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _break_off(
        self, request: web.Request, response: web.StreamResponse, generation: Generation, fault: FaultMode
    ) -> web.StreamResponse:
        """Mid-response faults: wedge holding the slots, or drop the connection."""
        if fault == "stall_mid_stream":
            scheduler = self.engine.scheduler
            assert scheduler is not None
            for sequence in generation.sequences:
                scheduler.pause(sequence)
            await self._hang()
        transport = request.transport
        if transport is not None:
            transport.close()
        raise asyncio.CancelledError

    async def _hang(self) -> None:
        """Wait until the client gives up (the disconnect watchdog cancels us)."""
        self.engine.hanging += 1
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self.engine.hanging -= 1

    # --- everything else --------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        config = self.engine.config
        created = int(time.time())
        base = config.models[0]
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kvroute-sim",
                "root": base,
                "parent": None if name == base else base,
                "max_model_len": config.context_len,
                "permission": [],
            }
            for name in config.models
        ]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        scheduler = self.engine.scheduler
        return web.Response(status=200 if scheduler is not None and scheduler.alive else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.engine.metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        engine = self.engine
        tokenizer = engine.tokenizer
        try:
            body = await _read_object(request)
            params = parse_tokenize(body)
            engine.served_model(params.model)
            try:
                if params.text is None:
                    ids = tokenizer.encode_chat_body(body, add_generation_prompt=params.add_generation_prompt)
                else:
                    ids = tokenizer.encode_prompt(params.text)
            except TokenizationError as exc:
                raise APIError(400, str(exc)) from None
        except APIError as error:
            return _error(error)
        return _json(
            {
                "count": len(ids),
                "max_model_len": engine.config.context_len,
                "tokens": ids.tolist(),
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        engine = self.engine
        try:
            params = parse_detokenize(await _read_object(request))
            engine.served_model(params.model)
        except APIError as error:
            return _error(error)
        vocab_size = engine.tokenizer.vocab_size
        known = [token for token in params.tokens if token < vocab_size]
        return _json({"prompt": engine.tokenizer.decode(known)})

    async def embeddings(self, request: web.Request) -> web.Response:
        engine = self.engine
        tokenizer = engine.tokenizer
        try:
            params = parse_embeddings(await _read_object(request))
            model = engine.served_model(params.model)
            try:
                inputs = [tokenizer.encode_prompt(item) for item in params.inputs]
            except TokenizationError as exc:
                raise APIError(400, str(exc), param="input") from None
        except APIError as error:
            return _error(error)
        data = []
        total = 0
        for index, tokens in enumerate(inputs):
            total += len(tokens)
            vector = engine.embedder.embed(tokens)
            embedding: Any = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if params.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        return _json(
            {
                "id": "embd-" + new_id("completion")[5:],
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": {"prompt_tokens": total, "total_tokens": total},
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        scheduler.reset_prefix_cache()
        return web.Response(status=200)

    async def set_fault(self, request: web.Request) -> web.Response:
        try:
            body = await _read_object(request)
            mode = body.get("mode")
            count = body.get("count")
            if mode not in FAULT_MODES:
                raise APIError(400, f"'mode' must be one of {list(FAULT_MODES)}", param="mode")
            if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
                raise APIError(400, "'count' must be a non-negative integer or null", param="count")
        except APIError as error:
            return _error(error)
        self.engine.faults.set(mode, count)
        return await self.get_fault(request)

    async def get_fault(self, request: web.Request) -> web.Response:
        state = self.engine.faults.state
        return _json({"mode": state.mode, "count": state.remaining, "applied": state.applied})

    async def stats(self, request: web.Request) -> web.Response:
        engine = self.engine
        scheduler = engine.scheduler
        cache = engine.cache
        assert scheduler is not None and cache is not None
        totals = scheduler.totals
        publisher = engine.publisher
        return _json(
            {
                "running": scheduler.num_running,
                "waiting": scheduler.num_waiting,
                "hanging": engine.hanging,
                "requests_served": totals.requests_served,
                "requests_aborted": totals.requests_aborted,
                "prompt_tokens": totals.prompt_tokens,
                "cached_tokens": totals.cached_tokens,
                "generation_tokens": totals.generation_tokens,
                "steps": totals.steps,
                "blocks": cache.blocks,
                "num_blocks": cache.num_blocks,
                "block_size": cache.block_size,
                "kv_cache_usage": scheduler.kv_usage,
                "kv_events_next_seq": publisher.next_sequence if publisher is not None else None,
                "fault": engine.faults.state.mode,
            }
        )


@web.middleware
async def _errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown paths and methods, and anything unexpected, still answer in vLLM's error form."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(APIError(exc.status, exc.reason))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        log.exception("unexpected error in %s %s", request.method, request.path)
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))


def _api_key_middleware(api_key: str) -> Any:
    """vLLM's ``--api-key`` check: every path under ``/v1`` needs the bearer token, compared
    in constant time; a missing or wrong one gets vLLM's own 401 body."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith("/v1"):
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


def build_app(config: SimEngineConfig, tokenizer: SimTokenizer | None = None) -> web.Application:
    """The replica as an ``aiohttp`` application; sockets and tasks start with the app."""
    engine = SimEngine(config, tokenizer)
    handlers = Handlers(engine)
    middlewares = [_errors_middleware]
    if config.api_key is not None:
        middlewares.insert(0, _api_key_middleware(config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    app[SIM_ENGINE] = engine
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/embeddings", handlers.embeddings)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    if config.api == "sglang":
        from kvroute.benchmarks.sim_engine.sglang_api import add_sglang_routes  # it builds on this module

        add_sglang_routes(app, engine, handlers)
    else:
        app.router.add_post("/tokenize", handlers.tokenize)
        app.router.add_post("/detokenize", handlers.detokenize)
        app.router.add_post("/reset_prefix_cache", handlers.reset_prefix_cache)
    app.router.add_post("/sim/fault", handlers.set_fault)
    app.router.add_get("/sim/fault", handlers.get_fault)
    app.router.add_get("/sim/stats", handlers.stats)

    async def start(_: web.Application) -> None:
        await engine.start()

    async def stop(_: web.Application) -> None:
        await engine.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app
