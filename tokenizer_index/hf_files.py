"""Loading a Hugging Face tokenizer directory without transformers.

Reads what transformers reads for a fast tokenizer: ``tokenizer.json`` (the ``tokenizers``
pipeline), the chat templates (``chat_template.jinja`` and ``additional_chat_templates/*.jinja``
as transformers 5 saves them, ``chat_template.json`` as processors save them, or the
``chat_template`` entry of ``tokenizer_config.json``) and the special tokens the template sees
as variables (``bos_token``, ``eos_token``, ... and model-specific ``*_token`` entries). Like
transformers, special tokens named in the config but missing from ``tokenizer.json`` are added.

A name that is not a local directory with a ``tokenizer.json`` (a hub id, or a directory with
only a SentencePiece model) goes through ``transformers.AutoTokenizer`` when it is installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer's pieces: the encoding pipeline, its chat templates and special tokens."""

    tokenizer: Tokenizer
    chat_templates: dict[str, str]  # name -> Jinja source; "default" is the main one
    special_tokens: dict[str, str]  # template variables such as bos_token -> "<s>"
    name_or_path: str


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as saved: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _templates_from_entry(entry: Any) -> dict[str, str]:
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        return {item["name"]: item["template"] for item in entry if isinstance(item, Mapping)}
    if isinstance(entry, Mapping):
        return {str(name): source for name, source in entry.items() if isinstance(source, str)}
    return {}


def read_chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The directory's chat templates, Jinja files first (they win in transformers 5)."""
    templates: dict[str, str] = {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    processor_templates = _templates_from_entry(_read_json(directory / "chat_template.json").get("chat_template"))
    if processor_templates:
        return processor_templates
    return _templates_from_entry(config.get("chat_template"))


def load_chat_template(value: str) -> str:
    """A chat template given as an engine takes it (``vllm serve --chat-template``): the
    contents of the file at ``value``, else ``value`` itself when it reads as Jinja (holds a
    brace or a newline), else an error naming the missing file."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. Jinja source longer than a file name may be
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if any(mark in value for mark in "{}\n"):
        return value
    raise FileNotFoundError(f"chat template {value!r} is neither a file nor Jinja source")


def read_directory_chat_templates(directory: Path) -> dict[str, str]:
    """The chat templates of a tokenizer directory (see :func:`read_chat_templates`)."""
    return read_chat_templates(directory, _read_json(directory / "tokenizer_config.json"))


def read_special_tokens(config: Mapping[str, Any], legacy_map: Mapping[str, Any]) -> dict[str, str]:
    """Named and model-specific special tokens, as transformers 5's ``special_tokens_map``."""
    tokens: dict[str, str] = {}
    for key in NAMED_SPECIAL_TOKENS:
        text = _token_text(config.get(key, legacy_map.get(key)))
        if text is not None:
            tokens[key] = text
    for key, value in config.items():
        if key.endswith("_token") and key not in tokens:
            text = _token_text(value)
            if text is not None:
                tokens[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            text = _token_text(value)
            if text is not None:
                tokens[str(key)] = text
    return tokens


def _added_token(spec: Mapping[str, Any], *, special_default: bool) -> AddedToken:
    special = bool(spec.get("special", special_default))
    return AddedToken(
        spec["content"],
        single_word=bool(spec.get("single_word", False)),
        lstrip=bool(spec.get("lstrip", False)),
        rstrip=bool(spec.get("rstrip", False)),
        normalized=bool(spec.get("normalized", not special)),
        special=special,
    )


def _add_missing_tokens(tokenizer: Tokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, str]) -> None:
    """Add config-declared tokens that ``tokenizer.json`` lacks, as transformers does on load."""
    present = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    declared = config.get("added_tokens_decoder")
    if isinstance(declared, Mapping):
        for _, spec in sorted(declared.items(), key=lambda item: int(item[0])):
            if isinstance(spec, Mapping) and isinstance(spec.get("content"), str) and spec["content"] not in present:
                tokenizer.add_tokens([_added_token(spec, special_default=False)])
                present.add(spec["content"])
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    extra_texts = [_token_text(value) for value in (extra.values() if isinstance(extra, Mapping) else extra or [])]
    for text in [*special_tokens.values(), *extra_texts]:
        if text is not None and text not in present:
            tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
            present.add(text)


def load_directory(directory: Path) -> TokenizerFiles:
    """Load a local tokenizer directory that has a ``tokenizer.json``."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = _read_json(directory / "tokenizer_config.json")
    special_tokens = read_special_tokens(config, _read_json(directory / "special_tokens_map.json"))
    _add_missing_tokens(tokenizer, config, special_tokens)
    if config.get("split_special_tokens"):
        tokenizer.encode_special_tokens = True
    return TokenizerFiles(
        tokenizer=tokenizer,
        chat_templates=read_chat_templates(directory, config),
        special_tokens=special_tokens,
        name_or_path=str(directory),
    )


def load_with_transformers(name_or_path: str) -> TokenizerFiles:
    """Load through ``transformers.AutoTokenizer`` (hub ids, SentencePiece-only directories)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(
            f"{name_or_path!r} is not a directory with a tokenizer.json, and loading it any other way "
            "needs transformers (pip install 'kvroute[hf]')"
        ) from exc
    hf_tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"{name_or_path!r} has no fast (Rust) tokenizer; kvroute needs one")
    template = hf_tokenizer.chat_template
    special_tokens = {
        key: str(value) for key, value in hf_tokenizer.special_tokens_map.items() if isinstance(value, str)
    }
    return TokenizerFiles(
        tokenizer=backend,
        chat_templates=_templates_from_entry(template),
        special_tokens=special_tokens,
        name_or_path=name_or_path,
    )


def load(name_or_path: str | Path) -> TokenizerFiles:
    """A local directory with ``tokenizer.json`` directly, anything else via transformers."""
    directory = Path(name_or_path).expanduser()
    if (directory / "tokenizer.json").is_file():
        return load_directory(directory)
    text = str(name_or_path)
    if not directory.exists() and (directory.is_absolute() or text.startswith((".", "~"))):
        raise FileNotFoundError(f"no tokenizer directory at {text}")
    return load_with_transformers(text)
