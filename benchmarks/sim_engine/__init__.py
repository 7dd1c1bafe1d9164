"""``kvroute sim-engine``: a simulated vLLM replica for tests, demos and benchmarks.

A real server, not a mock: vLLM's OpenAI-compatible API (chat and text completions,
streaming with ``stream_options.include_usage``, ``usage.prompt_tokens_details.cached_tokens``,
``/v1/models``, ``/v1/embeddings``, ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache``,
``/health``), vLLM's Prometheus metrics, and vLLM's ZeroMQ KV events. Prompts are tokenized
by the router's own :class:`kvroute.tokenizer_index.RequestTokenizer`, and a real prefix cache of
full blocks (LRU, tail first) decides what each request finds cached. One continuous-batching
scheduler per replica shares a prefill/decode budget among requests, so load raises the
time to first token and cache hits lower it, as on a GPU. ``/sim/fault`` and ``/sim/stats``
serve the reliability suite.

Requests are judged as vLLM judges them (:mod:`.validation`; :mod:`.parity` holds the cases
and a real vLLM's answers, and checks any server against them), ``n`` samples and prompt
batches answer with several choices.

Modules, in the order a request meets them: :mod:`.config` (settings), :mod:`.server`
(HTTP), :mod:`.validation` (request rules), :mod:`.protocol` (errors, response shapes),
:mod:`.tokens` (prompt ids), :mod:`.scheduler` (batching and timing), :mod:`.cache`
(prefix cache), :mod:`.kv_events` (ZeroMQ publisher), :mod:`.generation` (output tokens,
embeddings), :mod:`.metrics`, :mod:`.faults`; :mod:`.cli` runs it; :mod:`.bench` measures its own CPU per request;
:mod:`.parity` compares a server's answers with vLLM's.

Programmatic use::

    from kvroute.benchmarks.sim_engine.server import SimEngineConfig, build_app
    app = build_app(SimEngineConfig(port=0, time_scale=100.0))  # an aiohttp Application
"""
