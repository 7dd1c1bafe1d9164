"""Real tokenizers built offline for the tokenizer tests: tiny BPEs trained in memory.

Each helper writes a genuine Hugging Face tokenizer directory (``tokenizer.json`` +
``tokenizer_config.json`` with a chat template) that both kvroute and transformers load, so
the tests compare the two on the same files. The templates are written for these tests in
the style of well-known model families (Llama 3, Mistral, a multimodal ChatML).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.paths import REPO

PipelineKind = Literal["byte_level", "metaspace_first", "metaspace_always"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the router keeps caches warm.",
    "Each request is rendered with the model's own chat template, then tokenized exactly.",
    'Tools: {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "def route(request):\n    return min(backends, key=cost)\n",
    "Numbers 0123456789, punctuation !?.,;: and quotes \"double\" 'single'.",
    "Unicode: café, naïve, 中文字符, 日本語, 한국어, emoji 😀👍🏽, שלום, Ελληνικά.",
] * 20

LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\nTools:\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=2) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{% for message in loop_messages %}
    {% if message['role'] == 'assistant' and message['tool_calls'] is defined %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {% for tool_call in message['tool_calls'] %}
            {{- '{"name": "' + tool_call['function']['name'] + '", "parameters": ' }}
            {{- tool_call['function']['arguments'] | tojson }}
            {{- "}" }}
        {% endfor %}
        {{- "<|eot_id|>" }}
    {% elif message['role'] == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message['content'] + "<|eot_id|>" }}
    {% else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {% endif %}
{% endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
# Llama 3.1's shape (the system message peeled off, then, with tools and
# tools_in_user_message, the first user message too), shared with the long-prompt benchmark.
LLAMA31_STYLE_TEMPLATE = (REPO / "benchmarks" / "templates" / "llama31_style.jinja").read_text()
# Llama 3's first shape: the BOS token joined to the first message's text by position.
LLAMA3_INDEX_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + (message['content'] or '') | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

MISTRAL_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
MISTRAL_SPECIALS = ("<s>", "</s>", "[INST]", "[/INST]")
# Later Mistral shapes: an optional system message peeled off and joined to the first user
# message (``loop.first``) or, as Mixtral's does, to the last one (``loop.last``: lookaround);
# roles checked to alternate by the loop position's parity in both.
MISTRAL_SYSTEM_TEMPLATE = """
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, roles must alternate user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.POSITION and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles after an optional system message') }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_FIRST_TEMPLATE = MISTRAL_SYSTEM_TEMPLATE.replace("POSITION", "first")
MIXTRAL_LAST_TEMPLATE = MISTRAL_SYSTEM_TEMPLATE.replace("POSITION", "last")

# A multimodal ChatML: iterates over content parts, so vLLM gives it the "openai" format.
OPENAI_PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<|image|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(
    kind: PipelineKind,
    specials: Sequence[str],
    added: Sequence[AddedToken] = (),
    *,
    vocab_size: int = 600,
    bos: str | None = None,
) -> Tokenizer:
    """A tiny BPE trained on a fixed corpus (well under a second).

    ``byte_level``: GPT-2/Llama-3 style. ``metaspace_*``: SentencePiece style, whose
    ``prepend_scheme`` decides whether the text can be cut at added tokens. With ``bos`` the
    post-processor puts that token in front of every sequence (as Llama's tokenizers do).
    """
    if kind == "byte_level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
        tokenizer.normalizer = normalizers.NFKC()
        scheme = "first" if kind == "metaspace_first" else "always"
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
        alphabet = sorted(set("".join(_CORPUS)) | {"▁"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=alphabet,
        special_tokens=["<unk>"] if kind != "byte_level" else [],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    if added:
        tokenizer.add_tokens(list(added))
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer


# Pre-tokenizer regexes of well-known byte-level BPEs (as their tokenizer.json files write them).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
O200K_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek V3's three Splits, one after the other: digit runs, CJK runs, then words.
DEEPSEEK_V3_PATTERNS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


def regex_split_tokenizer(
    pattern: str | Sequence[str],
    specials: Sequence[str],
    *,
    normalizer: normalizers.Normalizer | None = None,
    vocab_size: int = 600,
) -> Tokenizer:
    """A byte-level BPE whose words come from a Split regex, as Llama 3's and Qwen 2's do
    (several, one after the other, as DeepSeek V3's)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(source), behavior="isolated") for source in patterns),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


def write_tokenizer_dir(
    directory: Path,
    tokenizer: Tokenizer,
    *,
    chat_template: str | Mapping[str, str] | None,
    special_tokens: Mapping[str, str | None],
    template_in_jinja_file: bool = False,
) -> Path:
    """Save a Hugging Face tokenizer directory that transformers loads as a fast tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special_tokens}
    if isinstance(chat_template, Mapping):
        default = chat_template["default"]
        (directory / "chat_template.jinja").write_text(default, encoding="utf-8")
        extra_dir = directory / "additional_chat_templates"
        extra_dir.mkdir(exist_ok=True)
        for name, source in chat_template.items():
            if name != "default":
                (extra_dir / f"{name}.jinja").write_text(source, encoding="utf-8")
    elif chat_template is not None and template_in_jinja_file:
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    elif chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return directory


def llama3_style_dir(directory: Path) -> Path:
    """Byte-level BPE with Llama-3-like specials, a BOS post-processor and template."""
    tokenizer = train_tokenizer("byte_level", LLAMA3_SPECIALS, bos="<|begin_of_text|>")
    return write_tokenizer_dir(
        directory,
        tokenizer,
        chat_template=LLAMA3_STYLE_TEMPLATE,
        special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    )


def mistral_style_dir(directory: Path, kind: PipelineKind) -> Path:
    """SentencePiece-style (Metaspace) BPE with [INST] markers and a strict template."""
    tokenizer = train_tokenizer(kind, MISTRAL_SPECIALS)
    return write_tokenizer_dir(
        directory,
        tokenizer,
        chat_template=MISTRAL_STYLE_TEMPLATE,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    )


def hf_chat_ids(hf_tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers' ``apply_chat_template(tokenize=True)`` ids, whatever container it returns."""
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(token) for token in out]
