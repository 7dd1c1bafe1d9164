"""RequestTokenizer: exact against transformers, incremental == whole, bounded cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, normalizers

from kvroute.tokenizer_index import RequestTokenizer
from kvroute.tokenizer_index.chat_messages import media_placeholder
from kvroute.tokenizer_index.chat_template import ChatTemplateError, detect_content_format, tojson
from kvroute.tokenizer_index.piece_cache import PieceCache, frozen_ids
from kvroute.tokenizer_index.tokenizer import _never_overlap
from tests.tokenizer_index.tokenizers_fixtures import (
    OPENAI_PARTS_TEMPLATE,
    hf_chat_ids,
    llama3_style_dir,
    mistral_style_dir,
    train_tokenizer,
    write_tokenizer_dir,
)

transformers = pytest.importorskip("transformers")

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- tokenizers under test -----------------------------------------------------------------


@pytest.fixture(scope="module")
def default_tok() -> RequestTokenizer:
    return RequestTokenizer.default()


@pytest.fixture(scope="module")
def default_hf() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(RequestTokenizer.default_path()))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama3_style_dir(tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def llama_tok(llama_dir: Path) -> RequestTokenizer:
    return RequestTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def llama_hf(llama_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module", params=["default", "llama3"])
def pair(request: pytest.FixtureRequest) -> tuple[RequestTokenizer, Any]:
    """(kvroute tokenizer, transformers tokenizer) over the same files, two templates."""
    if request.param == "default":
        return request.getfixturevalue("default_tok"), request.getfixturevalue("default_hf")
    return request.getfixturevalue("llama_tok"), request.getfixturevalue("llama_hf")


# --- conversation strategies ------------------------------------------------------------------

SNIPPETS = [
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "中文字符",
    "日本語のテキスト",
    "e\u0301",
    "a\u0308\u0304",
    "שלום",
    "\r\n",
    "\n\n",
    "  ",
    "\t",
    "<|im_end|>",
    "<|im_start|>",
    "<|eot_id|>",
    "<tool_call>",
    '{"json": [1, 2]}',
    "The router",
    "ﬁ",
]
texts = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), st.sampled_from(SNIPPETS)),
    max_size=6,
).map("".join)
names = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=6,
)
tools_strategy = st.lists(
    st.builds(
        lambda name, description, props: {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": {key: {"type": "string"} for key in props}},
            },
        },
        names,
        texts,
        st.lists(names, max_size=3),
    ),
    min_size=1,
    max_size=3,
)


@st.composite
def conversations(draw: st.DrawFn, *, allow_tools: bool = True) -> list[dict[str, Any]]:
    """Conversations already in the form vLLM hands to the template (dict arguments, str content)."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    for turn in range(draw(st.integers(1, 4))):
        user: dict[str, Any] = {"role": "user", "content": draw(texts)}
        if draw(st.integers(0, 4)) == 0:
            user["name"] = draw(names)
        messages.append(user)
        if allow_tools and draw(st.integers(0, 2)) == 0:
            calls = [
                {
                    "id": f"call_{turn}_{index}",
                    "type": "function",
                    "function": {
                        "name": draw(names),
                        "arguments": draw(st.dictionaries(names, json_values, max_size=3)),
                    },
                }
                for index in range(draw(st.integers(1, 2)))
            ]
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            for call in calls:
                messages.append({"role": "tool", "content": draw(texts), "tool_call_id": call["id"]})
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(texts)})
    return messages


# --- exactness against transformers ---------------------------------------------------------


@SETTINGS
@given(messages=conversations(), tools=st.none() | tools_strategy, generation=st.booleans())
def test_encode_chat_equals_transformers(
    pair: tuple[RequestTokenizer, Any], messages: list[dict[str, Any]], tools: Any, generation: bool
) -> None:
    ours, hf = pair
    expected = hf_chat_ids(hf, messages, tools=tools, add_generation_prompt=generation)
    assert ours.encode_chat(messages, tools=tools, add_generation_prompt=generation) == expected


def test_default_tokenizer_is_a_small_hf_directory(default_hf: Any) -> None:
    path = RequestTokenizer.default_path()
    files = {child.name for child in path.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(child.stat().st_size for child in path.iterdir()) < 1_000_000
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert isinstance(default_hf, transformers.PreTrainedTokenizerFast)
    assert default_hf.eos_token == "<|im_end|>"
    tok = RequestTokenizer.default()
    assert 8000 <= tok.vocab_size < 8100
    assert tok.eos_token_id == default_hf.eos_token_id
    assert tok.incremental
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok.encode_text(special)) == 1


def test_vllm_request_normalisation(default_tok: RequestTokenizer, default_hf: Any) -> None:
    """OpenAI-shaped inputs are rendered as vLLM renders them, not as transformers would raw."""
    arguments = {"city": "Paris", "days": [1, 2]}
    as_vllm = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "content": "sunny\n20C", "tool_call_id": "c1"},
        {"role": "user", "content": "first part\nsecond part"},
    ]
    as_openai = [
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                }
            ],
        },
        {
            "role": "tool",
            "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "20C"}],
            "tool_call_id": "c1",
        },
        {"role": "user", "content": [{"type": "text", "text": "first part"}, "second part"], "refusal": None},
    ]
    expected = hf_chat_ids(default_hf, as_vllm, add_generation_prompt=True)
    assert default_tok.encode_chat(as_openai) == expected
    # Invalid JSON arguments become {} as in vLLM; an empty tool_calls list is dropped.
    broken = [
        {
            "role": "assistant",
            "content": "x",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}],
        }
    ]
    fixed = [
        {
            "role": "assistant",
            "content": "x",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}],
        }
    ]
    assert default_tok.encode_chat(broken) == hf_chat_ids(default_hf, fixed, add_generation_prompt=True)
    empty_calls = [{"role": "assistant", "content": "x", "tool_calls": []}]
    assert default_tok.encode_chat(empty_calls) == hf_chat_ids(
        default_hf, [{"role": "assistant", "content": "x"}], add_generation_prompt=True
    )
    # Tools are dumped like vLLM's pydantic models: missing fields render as null.
    bare_tool = [{"type": "function", "function": {"name": "now"}}]
    dumped_tool = [{"type": "function", "function": {"name": "now", "description": None, "parameters": None}}]
    assert default_tok.encode_chat(as_vllm[:1], tools=bare_tool) == hf_chat_ids(
        default_hf, as_vllm[:1], tools=dumped_tool, add_generation_prompt=True
    )


def test_reasoning_and_template_kwargs(
    llama_tok: RequestTokenizer, llama_hf: Any, default_tok: RequestTokenizer, default_hf: Any
) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning": "think"}]
    assert default_tok.encode_chat(messages) == hf_chat_ids(default_hf, messages, add_generation_prompt=True)
    assert "<think>\nthink\n</think>" in default_tok.render_chat(messages)
    # A template variable given by the request (a fixed date instead of strftime_now).
    kwargs = {"date_string": "01 Jan 2030"}
    ids = llama_tok.encode_chat(messages, chat_template_kwargs=kwargs)
    assert ids == hf_chat_ids(llama_hf, messages, add_generation_prompt=True, **kwargs)
    assert "01 Jan 2030" in llama_tok.render_chat(messages, chat_template_kwargs=kwargs)
    # apply_chat_template's own keywords steer rendering when passed in chat_template_kwargs.
    no_prompt = llama_tok.encode_chat(messages, chat_template_kwargs={"add_generation_prompt": False})
    assert no_prompt == hf_chat_ids(llama_hf, messages, add_generation_prompt=False)
    with pytest.raises(ValueError):
        llama_tok.encode_chat(messages, chat_template_kwargs={"tokenize": False})
    # Nor may they set what the render is handed itself (transformers: a TypeError).
    for name in ("messages", "tools"):
        with pytest.raises(ChatTemplateError, match=f"may not set {name}"):
            llama_tok.encode_chat(messages, chat_template_kwargs={name: []})


def test_the_engines_chat_template_and_default_keywords(llama_dir: Path, llama_hf: Any, default_hf: Any) -> None:
    """What the engines were started with renders as transformers renders it given the same:
    default keywords (``vllm serve --default-chat-template-kwargs``) under the request's own,
    and a template (``--chat-template``) in place of the tokenizer's, tools or not. Here a
    default date changes the first block of every prompt."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    dated = RequestTokenizer.from_pretrained(llama_dir, default_chat_template_kwargs={"date_string": "01 Jan 2030"})
    assert dated.encode_chat(messages) == hf_chat_ids(
        llama_hf, messages, add_generation_prompt=True, date_string="01 Jan 2030"
    )
    own = {"date_string": "02 Feb 2031"}
    assert dated.encode_chat(messages, chat_template_kwargs=own) == hf_chat_ids(
        llama_hf, messages, add_generation_prompt=True, **own
    )
    # apply_chat_template's own keywords, as defaults too
    unprompted = {"add_generation_prompt": False, "date_string": "01 Jan 2030"}
    assert RequestTokenizer.from_pretrained(llama_dir, default_chat_template_kwargs=unprompted).encode_chat(
        messages
    ) == hf_chat_ids(llama_hf, messages, **unprompted)
    for forbidden in ("chat_template", "tokenize"):
        with pytest.raises(ValueError, match=forbidden):
            RequestTokenizer.from_pretrained(llama_dir, default_chat_template_kwargs={forbidden: "x"})

    chatml = default_hf.chat_template
    replaced = RequestTokenizer.from_pretrained(llama_dir, chat_template=chatml)
    tools = [{"type": "function", "function": {"name": "now", "description": "the time", "parameters": {}}}]
    assert replaced.encode_chat(messages) == hf_chat_ids(
        llama_hf, messages, add_generation_prompt=True, chat_template=chatml
    )
    assert replaced.encode_chat(messages, tools=tools) == hf_chat_ids(
        llama_hf, messages, tools=tools, add_generation_prompt=True, chat_template=chatml
    )
    assert replaced.encode_chat(messages) != RequestTokenizer.from_pretrained(llama_dir).encode_chat(messages)


def test_a_chat_template_the_request_brings(llama_dir: Path, llama_hf: Any, default_hf: Any) -> None:
    """A request's own ``chat_template`` (vLLM's ``--trust-request-chat-template``): Jinja
    source, rendered as transformers renders it, whole (its shape is neither probed nor
    kept, so clients cannot grow that table); a bad one is the request's error."""
    tokenizer = RequestTokenizer.from_pretrained(llama_dir)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "?"},
    ]
    tokenizer.encode_chat(messages)
    shapes = dict(tokenizer._incremental_shapes)
    chatml = default_hf.chat_template
    assert tokenizer.encode_chat(messages, chat_template=chatml) == hf_chat_ids(
        llama_hf, messages, add_generation_prompt=True, chat_template=chatml
    )
    assert tokenizer.encode_chat_array(messages * 30, chat_template=chatml).tolist() == hf_chat_ids(
        llama_hf, messages * 30, add_generation_prompt=True, chat_template=chatml
    )
    assert tokenizer._incremental_shapes == shapes
    with pytest.raises(ValueError):
        tokenizer.encode_chat(messages, chat_template="{% if %}")


def test_continue_final_message(pair: tuple[RequestTokenizer, Any]) -> None:
    ours, hf = pair
    messages = [{"role": "user", "content": "Say a word"}, {"role": "assistant", "content": "Sure, the word is  "}]
    expected = hf_chat_ids(hf, messages, continue_final_message=True)
    assert ours.encode_chat(messages, add_generation_prompt=False, continue_final_message=True) == expected
    with pytest.raises(ValueError):
        ours.encode_chat(messages, add_generation_prompt=True, continue_final_message=True)


# --- templates: errors, formats, files ------------------------------------------------------


@pytest.mark.parametrize("kind", ["metaspace_first", "metaspace_always"])
def test_sentencepiece_style_tokenizers(tmp_path: Path, kind: str) -> None:
    """Metaspace 'first' puts a prefix space at the text's start only: its pieces are
    tokenized after an added token (the context), the text's first alone; exact either way."""
    directory = mistral_style_dir(tmp_path / kind, kind)  # type: ignore[arg-type]
    ours = RequestTokenizer.from_pretrained(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    assert ours.incremental
    assert (ours._context is not None) == (kind == "metaspace_first")
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "General Kenobi"},
        {"role": "user", "content": "[INST]x café 中文"},
        {"role": "assistant", "content": " two  spaces\n"},
        {"role": "user", "content": "Hello there"},
    ]
    for end in (1, 3, 5, 3, 1):  # turn by turn, then again from the warm cache
        assert ours.encode_chat(messages[:end]) == hf_chat_ids(hf, messages[:end], add_generation_prompt=True)
        assert ours.encode_chat_array(messages[:end]).tolist() == ours.encode_chat(messages[:end])
    text = "<s>a</s>b [INST]c\n[/INST]  d</s>"
    assert ours.encode_text(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.encode_chat_array(messages).tolist() == ours.encode_chat(messages)
    assert ours.encode_prompt_array(text).tolist() == ours.encode_prompt(text) == hf(text)["input_ids"]
    # The template's raise_exception reaches the caller as a client error.
    with pytest.raises(ChatTemplateError, match="alternate"):
        ours.encode_chat([{"role": "assistant", "content": "first"}])


@SETTINGS
@given(value=json_values, indent=st.none() | st.integers(0, 3), sort_keys=st.booleans())
def test_tojson_filter_equals_json_dumps(value: Any, indent: int | None, sort_keys: bool) -> None:
    """The template's ``tojson``, whose plain form reuses one encoder, dumps as transformers' does."""
    assert tojson(value) == json.dumps(value, ensure_ascii=False)
    assert tojson(value, indent=indent, sort_keys=sort_keys) == json.dumps(
        value, ensure_ascii=False, indent=indent, sort_keys=sort_keys
    )
    assert tojson(value, ensure_ascii=True) == json.dumps(value)


def test_content_format_detection() -> None:
    assert detect_content_format(OPENAI_PARTS_TEMPLATE) == "openai"
    assert detect_content_format(RequestTokenizer.default().chat_template().source) == "string"
    through_variable = (
        "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
        "{% for c in m['content'] | list %}{{ c.text }}{% endfor %}{% endfor %}"
    )
    assert detect_content_format(through_variable) == "openai"
    assert detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"


def test_multimodal_parts_hash_their_content(tmp_path: Path) -> None:
    image_a = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    image_b = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}

    def chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}]

    default_tok = RequestTokenizer.default()
    parts_dir = write_tokenizer_dir(
        tmp_path / "vlm",
        Tokenizer.from_file(str(RequestTokenizer.default_path() / "tokenizer.json")),
        chat_template=OPENAI_PARTS_TEMPLATE,
        special_tokens={"eos_token": "<|im_end|>"},
    )
    parts_tok = RequestTokenizer.from_pretrained(parts_dir)
    assert parts_tok.chat_template().content_format == "openai"
    for tok in (default_tok, parts_tok):
        first = tok.encode_chat(chat(image_a))
        assert first == tok.encode_chat(chat(dict(image_a)))  # equal images: equal keys
        assert first != tok.encode_chat(chat(image_b))  # different images: different keys
        assert first != tok.encode_chat(chat(audio))
        assert media_placeholder("image", "data:image/png;base64,AAAA") in tok.render_chat(chat(image_a))
    # A client-supplied uuid identifies the item instead of its data.
    with_uuid = {**image_a, "uuid": "img-1"}
    other_data_same_uuid = {**image_b, "uuid": "img-1"}
    assert default_tok.encode_chat(chat(with_uuid)) == default_tok.encode_chat(chat(other_data_same_uuid))
    # string format: media placeholders first, then the text (vLLM's layout)
    assert default_tok.render_chat(chat(image_a)).startswith(
        "<|im_start|>user\n" + media_placeholder("image", "data:image/png;base64,AAAA") + "\ndescribe<|im_end|>"
    )
    with pytest.raises(ValueError, match="unsupported"):
        default_tok.encode_chat([{"role": "user", "content": [{"type": "hologram"}]}])


def test_template_files_and_fallback(tmp_path: Path, default_hf: Any) -> None:
    tokenizer = Tokenizer.from_file(str(RequestTokenizer.default_path() / "tokenizer.json"))
    chatml = RequestTokenizer.default().chat_template().source
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    directory = write_tokenizer_dir(
        tmp_path / "multi",
        tokenizer,
        chat_template={"default": plain, "tool_use": chatml},
        special_tokens={"eos_token": "<|im_end|>"},
    )
    ours = RequestTokenizer.from_pretrained(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, add_generation_prompt=True)
    # Where there are several, a request's chat_template may name one (transformers looks
    # names up there only).
    assert ours.encode_chat(messages, chat_template="tool_use") == hf_chat_ids(
        hf, messages, add_generation_prompt=True, chat_template="tool_use"
    )
    assert ours.render_chat(messages, chat_template="default") == "user: hi\n"
    assert ours.encode_chat(messages, tools=tools) == hf_chat_ids(hf, messages, tools=tools, add_generation_prompt=True)
    assert ours.render_chat(messages) == "user: hi\n"
    # A tokenizer without any chat template gets the shipped ChatML one.
    bare = write_tokenizer_dir(tmp_path / "bare", tokenizer, chat_template=None, special_tokens={})
    fallback = RequestTokenizer.from_pretrained(bare)
    assert not fallback.has_own_chat_template
    assert fallback.encode_chat(messages) == hf_chat_ids(default_hf, messages, add_generation_prompt=True)


def test_directory_without_tokenizer_json_loads_through_transformers(tmp_path: Path) -> None:
    """The transformers path (hub ids, vocab/merges-only directories) gives the same ids."""
    directory = tmp_path / "gpt2-files"
    directory.mkdir()
    Tokenizer.from_file(str(RequestTokenizer.default_path() / "tokenizer.json")).model.save(str(directory))
    config = json.loads((RequestTokenizer.default_path() / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert not (directory / "tokenizer.json").exists()
    ours = RequestTokenizer.from_pretrained(directory)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [{"role": "system", "content": "Sé brief."}, {"role": "user", "content": "Hello wörld 😀<|im_end|>"}]
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, add_generation_prompt=True)
    assert ours.has_own_chat_template and ours.incremental
    with pytest.raises(FileNotFoundError):
        RequestTokenizer.from_pretrained(tmp_path / "does-not-exist")


# --- completions ----------------------------------------------------------------------------


def test_encode_prompt_forms(llama_tok: RequestTokenizer, llama_hf: Any, default_tok: RequestTokenizer) -> None:
    text = "Once upon a time<|eot_id|> there was 中文"
    with_bos = llama_hf(text)["input_ids"]  # completions add special tokens, as vLLM does
    assert with_bos[0] == llama_hf.bos_token_id
    assert llama_tok.encode_prompt(text) == with_bos
    assert default_tok.encode_prompt(text) == default_tok.encode_text(text)  # no BOS in this one
    ids = [5, 6, 7]
    assert llama_tok.encode_prompt(ids) == ids
    assert llama_tok.encode_prompt([text, "other"]) == with_bos
    assert llama_tok.encode_prompt([[9, 8], [1]]) == [9, 8]
    for bad in ([], [1, "a"], 3.5, None, [None]):
        with pytest.raises(ValueError):
            llama_tok.encode_prompt(bad)  # type: ignore[arg-type]


# --- incremental == whole -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cached_pair(pair: tuple[RequestTokenizer, Any]) -> dict[bool, RequestTokenizer]:
    """Copies of a tokenizer under test with a roomy and a tiny (always evicting) cache."""
    shared, _ = pair
    return {
        small: RequestTokenizer(
            shared.backend,
            chat_templates={"default": shared.chat_template().source},
            special_tokens=shared.special_tokens,
            cache_bytes=2_000 if small else 1 << 20,
        )
        for small in (False, True)
    }


@SETTINGS
@given(messages=conversations(), small_cache=st.booleans())
def test_incremental_equals_whole_across_turns(
    cached_pair: dict[bool, RequestTokenizer], messages: list[dict[str, Any]], small_cache: bool
) -> None:
    """Each growing prefix of a conversation, tokenized with a warm cache, equals whole-text."""
    tok = cached_pair[small_cache]
    tok.clear_cache()
    assert tok.incremental
    hits_before = tok.cache_stats().hits
    for end in range(1, len(messages) + 1):
        text = tok.render_chat(messages[:end])
        assert tok.encode_chat(messages[:end]) == tok.backend.encode(text, add_special_tokens=False).ids
    if not small_cache and len(messages) > 1:
        assert tok.cache_stats().hits > hits_before


@pytest.fixture(scope="module")
def tricky_tok() -> RequestTokenizer:
    """Added tokens with every flag: lstrip, rstrip, single_word, normalized, overlapping."""
    added = [
        AddedToken("<L>", lstrip=True, normalized=False),
        AddedToken("<R>", rstrip=True, normalized=False),
        AddedToken("<R>x", normalized=False),
        AddedToken("word", single_word=True, normalized=False),
        AddedToken("<N>", normalized=True),
        AddedToken("<|a|>", normalized=False),
        AddedToken("<|a|><|b|>", normalized=False),
    ]
    tokenizer = train_tokenizer("byte_level", ["<s>", "</s>"], added)
    return RequestTokenizer(tokenizer, cache_bytes=1 << 16)


tricky_texts = st.lists(
    st.sampled_from(
        [
            "<L>",
            "<R>",
            "<R>x",
            "word",
            "<N>",
            "<|a|>",
            "<|b|>",
            "<s>",
            "</s>",
            " ",
            "\n",
            "  ",
            "a",
            "words",
            "é",
            "😀",
            "<",
            ">",
            "|",
        ]
    )
    | st.text(max_size=4),
    max_size=14,
).map("".join)


@SETTINGS
@given(text=tricky_texts)
def test_pieces_match_the_tokenizers_own_cuts(tricky_tok: RequestTokenizer, text: str) -> None:
    assert tricky_tok.incremental
    expected = tricky_tok.backend.encode(text, add_special_tokens=False).ids
    assert tricky_tok.encode_text(text) == expected
    assert tricky_tok.encode_text(text) == expected  # again, from the cache


@pytest.fixture(scope="module")
def overlapping_tok() -> RequestTokenizer:
    """Added tokens that all cut, some overlapping or inside others (the pieces and the
    units that end in one, ``_text_and_final_token``)."""
    added = [
        AddedToken("<|a|>", normalized=False),
        AddedToken("<|a|><|b|>", normalized=False),
        AddedToken("<|b|>", normalized=False),
        AddedToken("|><", normalized=False),
    ]
    tok = RequestTokenizer(train_tokenizer("byte_level", ["<s>", "</s>"], added), cache_bytes=1 << 16)
    assert tok.incremental and tok._words is not None and not tok._non_boundaries
    return tok


@SETTINGS
@given(
    text=st.lists(
        st.sampled_from(
            ["<|a|>", "<|b|>", "|><", "<|a|><|b|>", "<s>", "a", " word", " hello there", "\n", "<", "|", ">"]
        )
        | st.text(max_size=4),
        max_size=14,
    ).map("".join)
)
def test_units_ending_in_overlapping_tokens(overlapping_tok: RequestTokenizer, text: str) -> None:
    expected = overlapping_tok.backend.encode(text, add_special_tokens=False).ids
    assert overlapping_tok.encode_text(text) == expected
    assert overlapping_tok.encode_text(text) == expected
    # Cut by re.split (from the start, where every added token cuts) as by the scan.
    assert overlapping_tok._boundary_split is not None
    assert overlapping_tok._pieces(text) == overlapping_tok._pieces("x" + text, 1)


def test_no_context_token_that_a_longer_added_token_starts_with() -> None:
    """Tokenized after "<unk>", a unit starting "x" would read "<unk>x" as one added token."""
    tokenizer = train_tokenizer("metaspace_first", ["<s>", "</s>", "<unk>x"])
    ours = RequestTokenizer(tokenizer)
    assert ours.incremental and ours._context not in (None, "<unk>")
    for text in ("<unk>x y", "a<s>x<unk>xx</s> z", "<s> x<unk>x"):
        assert ours.encode_text(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_fast_paths_say_which_shortcuts_a_tokenizer_takes() -> None:
    default = RequestTokenizer.default().fast_paths()
    assert (default.pieces, default.context_token, default.chunks, default.words) == (
        True,
        None,
        True,
        "ascii+unicode (compiled, new words by BPE)",
    )
    assert default.templates == {"default": None} and default.skeletons == {"default": None}
    assert default.tool_skeletons == {"default": None}
    assert "default: incremental, short chats from skeletons, with tool calls" in default.summary()
    whole = RequestTokenizer(
        RequestTokenizer.default().backend, incremental=False, chat_templates={"default": "{{ messages | length }}"}
    ).fast_paths()
    assert (whole.pieces, whole.chunks, whole.words) == (False, False, "off")
    assert whole.templates["default"] is not None and "messages" in whole.templates["default"]
    assert "pieces off (whole texts)" in whole.summary() and "default: whole (" in whole.summary()
    assert whole.skeletons == {"default": None}  # it reads no text: every shape is one skeleton
    measured = RequestTokenizer(
        RequestTokenizer.default().backend, chat_templates={"default": "{{ messages[0]['content'] | length }}"}
    ).fast_paths()
    assert measured.skeletons["default"] is not None and "short chats rendered (" in measured.summary()
    calls_measured = RequestTokenizer(
        RequestTokenizer.default().backend,
        chat_templates={"default": "{% for m in messages %}{{ m.tool_calls | length }}{{ m.content }}{% endfor %}"},
    ).fast_paths()
    assert calls_measured.skeletons["default"] is None and calls_measured.tool_skeletons["default"] is None
    dumped = RequestTokenizer(
        RequestTokenizer.default().backend,
        chat_templates={"default": "{% for m in messages %}{{ m.tool_calls | tojson }}{{ m.content }}{% endfor %}"},
    ).fast_paths()
    assert dumped.skeletons["default"] is None and dumped.tool_skeletons["default"] is not None
    assert "short chats from skeletons, not with tool calls (" in dumped.summary()
    first = RequestTokenizer(train_tokenizer("metaspace_first", ["<s>", "</s>"])).fast_paths()
    assert first.pieces and first.context_token is not None and first.words == "off"
    # A template that does not compile is reported, not raised (its requests fail as before).
    broken = RequestTokenizer(
        RequestTokenizer.default().backend,
        chat_templates={"default": "{{ messages[0]['content'] }}", "tool_use": "{{ messages[0] }"},
    ).fast_paths()
    assert broken.templates["tool_use"] is not None and "invalid chat template" in broken.templates["tool_use"]


# Added tokens looked for in normalized text (DeepSeek's chat tokens), under no normalizer.
NORMALIZED_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]


def _normalized_tokens_tok(normalizer: Any = None, raw: tuple[str, ...] = ("<s>",)) -> RequestTokenizer:
    tokenizer = train_tokenizer("byte_level", list(raw))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=True) for token in NORMALIZED_TOKENS])
    return RequestTokenizer(tokenizer, cache_bytes=1 << 16)


normalized_token_texts = st.lists(
    st.sampled_from([*NORMALIZED_TOKENS, "<s>", "<｜", "｜>", "User", " ", "\n", "hi", "é", "e\u0301", "12"])
    | st.text(max_size=4),
    max_size=14,
).map("".join)


@pytest.mark.parametrize(
    ("first", "second", "apart"),
    [
        (["<a>"], ["<b>"], True),
        (["<a>b"], ["<a>"], False),  # one holds the other
        (["x"], ["<x>"], False),
        (["ab"], ["bc"], False),  # the end of one starts the other
        (["bc"], ["ab"], False),
        (["<｜User｜>"], ["<s>", "</s>"], True),
        ([], ["<s>"], True),
    ],
)
def test_never_overlap(first: list[str], second: list[str], apart: bool) -> None:
    assert _never_overlap(first, second) is apart


@pytest.fixture(scope="module")
def normalized_toks() -> dict[str, RequestTokenizer]:
    return {
        "none": _normalized_tokens_tok(),
        "nfc": _normalized_tokens_tok(normalizers.NFC()),
        "overlapping": _normalized_tokens_tok(raw=("<s>", "｜>x")),
    }


@SETTINGS
@given(text=normalized_token_texts)
def test_normalized_added_tokens_cut_the_text_when_nothing_normalizes(
    normalized_toks: dict[str, RequestTokenizer], text: str
) -> None:
    """Without a normalizer the library finds normalized added tokens in the raw text too:
    they cut pieces like the others, and the word path and chunking stay on."""
    tok = normalized_toks["none"]
    assert tok.incremental and tok._words is not None and tok.chunks_long_pieces
    assert all(token in tok._boundary_tokens for token in NORMALIZED_TOKENS)
    expected = tok.backend.encode(text, add_special_tokens=False).ids
    assert tok.encode_text(text) == expected
    assert tok.encode_text_array(text).tolist() == expected


@pytest.mark.parametrize("kind", ["nfc", "overlapping"])
def test_normalized_added_tokens_stay_apart_where_they_may_differ(
    normalized_toks: dict[str, RequestTokenizer], kind: str
) -> None:
    """A normalizer that changes text, or a raw token that may overlap a normalized one:
    they are not cut at (nor words nor chunks), and the ids are still the library's."""
    tok = normalized_toks[kind]
    assert not any(token in tok._boundary_tokens for token in NORMALIZED_TOKENS)
    assert tok._words is None and not tok.chunks_long_pieces
    for text in ("<s>hi<｜User｜>e\u0301<｜Assistant｜> x", "<｜User｜><｜User｜>", "<｜<｜Assistant｜>｜>"):
        assert tok.encode_text(text) == tok.backend.encode(text, add_special_tokens=False).ids


# --- the piece cache stays within its byte bound -------------------------------------------


def test_piece_cache_lru_within_byte_bound() -> None:
    cache = PieceCache(max_bytes=20_000)
    for index in range(500):
        ids = list(range(index % 50))
        cache.put_many([(f"piece {index} " * 5, frozen_ids(ids), ids if index % 2 else None)])
        assert cache.stats().bytes <= cache.max_bytes
        cache.get_lists([f"piece {index - 1} " * 5])  # builds the list form of an array-only piece
        assert cache.stats().bytes <= cache.max_bytes
    stats = cache.stats()
    assert stats.evictions > 0 and 0 < stats.entries < 500
    assert cache.measured_bytes() <= stats.bytes + 4096  # the estimate does not under-count
    recent = f"piece {499} " * 5
    oldest = f"piece {0} " * 5
    arrays = cache.get_arrays([recent, oldest])
    assert arrays[0] is not None and arrays[0].tolist() == list(range(499 % 50)) and arrays[1] is None
    assert not arrays[0].flags.writeable  # shared with later lookups
    assert cache.get_lists([recent, oldest]) == [list(range(499 % 50)), None]
    cache.clear()
    assert cache.stats().bytes == 0 and len(cache) == 0
    disabled = PieceCache(0)
    disabled.put_many([("x", frozen_ids([1]), [1])])
    assert len(disabled) == 0
    with pytest.raises(ValueError):
        PieceCache(-1)


def test_tokenizer_cache_bound_holds_over_many_conversations() -> None:
    tok = RequestTokenizer.default(cache_bytes=64_000)
    history: list[dict[str, Any]] = []
    for turn in range(60):
        history.append({"role": "user", "content": f"question {turn}: " + "why? " * (turn % 7 + 1) * 20})
        history.append({"role": "assistant", "content": f"answer {turn} " * 30})
        tok.encode_chat(history[-20:])
        assert tok.cache_stats().bytes <= 64_000
    assert tok.cache_stats().evictions > 0
    uncached = RequestTokenizer.default(cache_bytes=0)
    assert uncached.encode_chat(history) == tok.encode_chat(history)
    assert uncached.cache_stats().entries == 0
    assert np.array_equal(uncached.encode_chat_array(history), tok.encode_chat_array(history))


# --- int64 arrays equal the lists ---------------------------------------------------------------


@SETTINGS
@given(messages=conversations(), small_cache=st.booleans(), arrays_first=st.booleans())
def test_arrays_equal_lists_across_turns(
    cached_pair: dict[bool, RequestTokenizer], messages: list[dict[str, Any]], small_cache: bool, arrays_first: bool
) -> None:
    """Each growing prefix of a conversation: the array equals the list, whichever warmed the cache."""
    tok = cached_pair[small_cache]
    tok.clear_cache()
    for end in range(1, len(messages) + 1):
        turn = messages[:end]
        if arrays_first:
            array, ids = tok.encode_chat_array(turn), tok.encode_chat(turn)
        else:
            ids, array = tok.encode_chat(turn), tok.encode_chat_array(turn)
        assert array.dtype == np.int64 and array.ndim == 1 and array.flags.c_contiguous
        assert array.tolist() == ids
        text = tok.render_chat(turn)
        assert np.array_equal(tok.encode_prompt_array(text), tok.encode_prompt(text))
        assert tok.cache_stats().bytes <= tok.cache_stats().max_bytes


def test_returned_arrays_are_the_callers_own(default_tok: RequestTokenizer) -> None:
    """Results are new writable arrays: changing one never reaches the cache or a later result."""
    messages = [{"role": "user", "content": "Tell me about prefix caches."}]
    expected = default_tok.encode_chat(messages)
    first = default_tok.encode_chat_array(messages)
    assert first.flags.writeable and first.flags.owndata
    first[:] = 0
    assert default_tok.encode_chat_array(messages).tolist() == expected
    assert default_tok.encode_chat(messages) == expected
    ids = [3, 1, 4, 1, 5]
    from_ids = default_tok.encode_prompt_array(ids)
    from_ids[0] = 9
    assert ids == [3, 1, 4, 1, 5]


def test_encode_prompt_array_forms(llama_tok: RequestTokenizer, llama_hf: Any) -> None:
    text = "Once upon a time<|eot_id|> there was 中文"
    with_bos = llama_hf(text)["input_ids"]
    cases = [
        (text, with_bos),
        ([text, "other"], with_bos),
        ([5, 6, 7], [5, 6, 7]),
        ((5, 6), [5, 6]),
        ([[9, 8], [1]], [9, 8]),
        ([""], llama_hf("")["input_ids"]),
    ]
    for prompt, expected in cases:
        array = llama_tok.encode_prompt_array(prompt)  # type: ignore[arg-type]
        assert array.dtype == np.int64 and array.flags.c_contiguous
        assert array.tolist() == llama_tok.encode_prompt(prompt) == expected  # type: ignore[arg-type]
    # JSON true/false among integer ids count as 1/0, as pydantic validates vLLM's request.
    mixed = [7, True, False]
    assert llama_tok.encode_prompt(mixed) == llama_tok.encode_prompt_array(mixed).tolist() == [7, 1, 0]
    bad_prompts = (
        [],
        [1, "a"],
        [1, "2"],
        [1, 2.5],
        [1, None],
        [1, [2]],
        [1, 2**63],
        [True, 2],
        3.5,
        None,
        [None],
        b"ab",
    )
    for bad in bad_prompts:
        with pytest.raises(ValueError):
            llama_tok.encode_prompt_array(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            llama_tok.encode_prompt(bad)  # type: ignore[arg-type]


def test_cache_bound_holds_with_both_forms() -> None:
    """Lists built beside cached arrays are charged too: the bound holds, the count is honest."""
    tok = RequestTokenizer.default(cache_bytes=48_000)
    history: list[dict[str, Any]] = []
    for turn in range(40):
        history.append({"role": "user", "content": f"question {turn}: " + "how? " * (turn % 5 + 1) * 15})
        history.append({"role": "assistant", "content": f"answer {turn} " * 25})
        window = history[-16:]
        array = tok.encode_chat_array(window)
        assert tok.encode_chat(window) == array.tolist()
        stats = tok.cache_stats()
        assert stats.bytes <= stats.max_bytes
    assert tok.cache_stats().evictions > 0


def test_unit_counts_say_how_text_was_tokenized() -> None:
    """``unit_counts``: new short text word by word, long text in compiled code, the same
    text again from the piece cache; without word splitting, the library."""
    tokenizer = RequestTokenizer.default()
    short, long = "a new question, briefly", " ".join(f"line {number} of a tool result" for number in range(60))
    tokenizer.encode_text(short)
    assert tokenizer.unit_counts()["words"] == 1 and tokenizer.unit_counts()["library"] == 0
    tokenizer.encode_text(long)
    assert tokenizer.unit_counts()["words_compiled"] >= 1
    before = tokenizer.unit_counts()
    tokenizer.encode_text(long)
    after = tokenizer.unit_counts()
    assert after["cached"] > before["cached"] and {**after, "cached": 0} == {**before, "cached": 0}
    plain = RequestTokenizer.default(word_split=False)
    plain.encode_text(short)
    assert plain.unit_counts()["library"] == 1 and plain.unit_counts()["words"] == 0
