"""The OpenAI endpoints' prompts: the keywords vLLM 0.32 hands the chat template."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.router.engines.openai import CHAT, RESPONSES, template_keywords
from kvroute.tokenizer_index import RequestTokenizer

transformers = pytest.importorskip("transformers")

#: Qwen 3's switch, reduced, as in test_anthropic.
SWITCH = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}{% endif %}"
)


def test_the_effort_sets_enable_thinking_unless_the_request_does() -> None:
    assert template_keywords({}, None) is None
    assert template_keywords({}, "auto") is None
    assert template_keywords({}, "none") == {"enable_thinking": False, "reasoning_effort": "none"}
    assert template_keywords({}, "low") == {"enable_thinking": True, "reasoning_effort": "low"}
    own = {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "x", "k": 1}}
    assert template_keywords(own, "none") == {"enable_thinking": True, "reasoning_effort": "none", "k": 1}
    assert template_keywords(own, None) == {"enable_thinking": True, "reasoning_effort": "x", "k": 1}


@pytest.mark.parametrize("effort", ["none", "high"])
def test_a_chats_and_a_responses_effort_render_as_transformers_renders_the_keywords(effort: str) -> None:
    tokenizer = RequestTokenizer.default(chat_template=SWITCH)
    hf = transformers.AutoTokenizer.from_pretrained(str(RequestTokenizer.default_path()))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    expected = hf.apply_chat_template(
        messages,
        chat_template=SWITCH,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=effort != "none",
        reasoning_effort=effort,
    )
    assert CHAT.prompt is not None and RESPONSES.prompt is not None
    chat = CHAT.prompt(tokenizer, {"model": "m", "messages": messages, "reasoning_effort": effort})
    responses = RESPONSES.prompt(tokenizer, {"model": "m", "input": "hi", "reasoning": {"effort": effort}})
    assert chat is not None and responses is not None
    assert tokenizer.decode(chat.tolist()) == tokenizer.decode(responses.tolist()) == expected
