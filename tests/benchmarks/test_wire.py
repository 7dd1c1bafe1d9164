"""wire: a workload's chats over the Responses and Messages APIs, and as vLLM's scale-out
clients send them (rendered, then token ids), carry the same conversation.

The property that matters: vLLM renders the same prompt for the converted request as for
the chat, so the offline bounds (computed from the chats) hold. vLLM's conversions are the
router's own mirrors of them (router/engines/responses_input.py, anthropic_input.py),
checked token for token against real vLLM in the e2e tier."""

from __future__ import annotations

import pytest

from kvroute.benchmarks.wire import (
    MESSAGES_ENDPOINT,
    RESPONSES_ENDPOINT,
    STREAMS,
    TOKENS_ENDPOINT,
    on_wire,
    streaming_body,
)
from kvroute.benchmarks.workloads import agent_sessions, multi_turn
from kvroute.router.engines import endpoint_for
from kvroute.router.engines.usage import Usage
from kvroute.tokenizer_index import RequestTokenizer


@pytest.mark.parametrize("wire", ["responses", "messages"])
def test_every_converted_request_renders_the_chats_prompt(wire: str) -> None:
    tokenizer = RequestTokenizer.default()
    requests = [*agent_sessions(sessions=2, turns=3, scale=0.01), *multi_turn(conversations=2, turns=3)]
    for request in requests:
        sent = on_wire(request, wire)
        assert sent.endpoint == {"responses": RESPONSES_ENDPOINT, "messages": MESSAGES_ENDPOINT}[wire]
        chat_reader, wire_reader = endpoint_for(request.endpoint).prompt, endpoint_for(sent.endpoint).prompt
        assert chat_reader is not None and wire_reader is not None
        assert wire_reader(tokenizer, sent.body).tolist() == chat_reader(tokenizer, request.body).tolist()
    assert on_wire(requests[0], "chat") is requests[0]


def test_each_streams_text_and_usage_are_read() -> None:
    responses = STREAMS[RESPONSES_ENDPOINT]
    assert responses.has_text({"type": "response.output_text.delta", "delta": "Hi"})
    assert not responses.has_text({"type": "response.created", "response": {"usage": None}})
    assert responses.usage({"type": "response.created", "response": {"usage": None}}) is None
    completed = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 90, "input_tokens_details": {"cached_tokens": 64}}},
    }
    assert responses.usage(completed) == Usage(90, 64)
    messages = STREAMS[MESSAGES_ENDPOINT]
    assert messages.has_text({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}})
    assert not messages.has_text({"type": "content_block_start", "content_block": {"type": "text", "text": ""}})
    assert messages.usage(
        {"type": "message_delta", "usage": {"input_tokens": 26, "cache_read_input_tokens": 64}}
    ) == Usage(90, 64)
    # Only OpenAI's chat and completions streams carry usage when asked with stream_options.
    chat_request = next(iter(multi_turn(conversations=1, turns=1)))
    assert streaming_body(chat_request)["stream_options"] == {"include_usage": True}
    for wire in ("responses", "messages"):
        sent = streaming_body(on_wire(chat_request, wire))
        assert sent["stream"] is True and "stream_options" not in sent


def test_the_token_wire_sends_what_the_engine_rendered() -> None:
    """``--wire tokens``: the chat goes to the engine's renderer, and what came back is sent
    to the token-in generation, asking for a stream and its usage chunk."""
    chat_request = next(iter(multi_turn(conversations=1, turns=1)))
    sent = on_wire(chat_request, "tokens")
    assert (sent.endpoint, sent.body) == (TOKENS_ENDPOINT, chat_request.body)
    rendered = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}, "model": "m"}
    body = streaming_body(sent, rendered)
    assert body == {**rendered, "stream": True, "stream_options": {"include_usage": True}}
    tokens = STREAMS[TOKENS_ENDPOINT]
    assert tokens.has_text({"choices": [{"index": 0, "token_ids": [42]}]})
    assert not tokens.has_text({"choices": []})
    final = {"choices": [], "usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}}
    assert tokens.usage(final) == Usage(90, 64)
