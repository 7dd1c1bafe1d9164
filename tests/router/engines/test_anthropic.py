"""The Anthropic Messages endpoints: usage as vLLM reports it, the prompt, the session key."""

from __future__ import annotations

from typing import Any

import httpx

from kvroute.router.engines.anthropic import MESSAGES, anthropic_usage, disabled_thinking_effort
from kvroute.router.engines.usage import StreamTap, Usage, usage_from_body
from kvroute.router.routing.request_info import session_key_of
from kvroute.tokenizer_index import RequestTokenizer


def test_the_prompt_is_the_sum_of_the_uncached_read_and_written_tokens() -> None:
    """vLLM's ``input_tokens`` counts only what was neither read from the cache nor written to it."""
    body = b'{"usage": {"input_tokens": 17, "cache_read_input_tokens": 640, "cache_creation_input_tokens": 0}}'
    assert MESSAGES.usage is not None
    assert usage_from_body(body, MESSAGES.usage) == Usage(prompt_tokens=657, cached_tokens=640)
    assert anthropic_usage({"usage": {"input_tokens": 5}}) == Usage(prompt_tokens=5, cached_tokens=None)
    assert anthropic_usage({"usage": {"input_tokens": -1}}) is None
    assert anthropic_usage({"usage": {"input_tokens": 5, "cache_read_input_tokens": "x"}}) is None


def test_a_stream_counts_its_last_usage() -> None:
    """message_start carries the usage known then, the last message_delta all of it."""
    start = b'event: message_start\ndata: {"type": "message_start", "message": {"usage": {"input_tokens": 657}}}\n\n'
    delta = (
        b'event: message_delta\ndata: {"type": "message_delta", "usage": '
        b'{"input_tokens": 17, "cache_read_input_tokens": 640, "output_tokens": 4}}\n\n'
    )
    stop = b'event: message_stop\ndata: {"type": "message_stop"}\n\n'
    assert MESSAGES.usage is not None
    tap = StreamTap(strip_usage_chunk=False, usage_format=MESSAGES.usage)
    for chunk in (start, delta, stop):
        assert tap.feed(chunk) == chunk
    tap.finish()
    assert tap.usage == Usage(prompt_tokens=657, cached_tokens=640)


def test_a_vllm_backend_is_sent_the_messages_api(sim_engines: Any, router_server: Any) -> None:
    """The router proxies both Messages paths to a vLLM backend (a sim engine, which answers
    them 404 itself: the router's own 404 for an unknown path would name no backend)."""
    (engine,) = sim_engines(1)
    router = router_server([engine])
    body = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        answer = httpx.post(router.url + path, json=body, timeout=30)
        assert answer.headers["x-kvroute-backend"] == engine.url, (path, answer.status_code, answer.text)


def test_claude_codes_session_is_its_key() -> None:
    body = {"metadata": {"user_id": "user_ab12_account__session_5f0e"}, "messages": []}
    assert session_key_of(body, {}, "x-session-id") == "user_ab12_account__session_5f0e"
    assert session_key_of(body, {"x-session-id": "s"}, "x-session-id") == "s"
    assert session_key_of({"metadata": {"user_id": 3}}, {}, "x-session-id") is None
    # OpenAI's own cache-routing hint comes before the user field.
    assert session_key_of({"prompt_cache_key": "conv-1", "user": "u"}, {}, "x-session-id") == "conv-1"
    assert session_key_of({"prompt_cache_key": "", "user": "u"}, {}, "x-session-id") == "u"


def test_the_prompt_is_the_converted_chat_rendered() -> None:
    tokenizer = RequestTokenizer.default()
    body = {"model": "m", "max_tokens": 4, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    assert MESSAGES.prompt is not None
    ids = MESSAGES.prompt(tokenizer, body)
    assert ids is not None
    assert ids.tolist() == tokenizer.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    )
    assert MESSAGES.prompt(tokenizer, {**body, "messages": "nope"}) is None


#: Qwen 3's switch, reduced: thinking off leaves an empty think block before the answer.
THINKING_SWITCH = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_a_disabled_thinking_asks_for_the_effort_the_template_honours() -> None:
    """vLLM's probe: ``none`` where the template renders it apart from every thinking
    effort, else ``low`` (it would be ignored, or it fails)."""
    assert disabled_thinking_effort(RequestTokenizer.default(chat_template=THINKING_SWITCH)) == "none"
    assert disabled_thinking_effort(RequestTokenizer.default()) == "low"  # ChatML reads neither keyword
    refusing = "{% if reasoning_effort == 'none' %}{{ raise_exception('no') }}{% endif %}" + THINKING_SWITCH
    assert disabled_thinking_effort(RequestTokenizer.default(chat_template=refusing)) == "low"


def test_thinking_disabled_and_an_effort_reach_the_template() -> None:
    tokenizer = RequestTokenizer.default(chat_template=THINKING_SWITCH)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert MESSAGES.prompt is not None
    plain = tokenizer.decode(MESSAGES.prompt(tokenizer, body).tolist())
    disabled = tokenizer.decode(MESSAGES.prompt(tokenizer, {**body, "thinking": {"type": "disabled"}}).tolist())
    assert not plain.endswith("</think>\n\n") and disabled == plain + "<think>\n\n</think>\n\n"
    # An effort of the output config thinks (enable_thinking true): as without one here.
    effort = {**body, "output_config": {"effort": "high"}}
    assert tokenizer.decode(MESSAGES.prompt(tokenizer, effort).tolist()) == plain
