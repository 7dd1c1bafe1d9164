"""Build kvroute's shipped default tokenizer into ``tokenizer_index/data/default/``.

A real byte-level BPE (about 8k tokens, like GPT-2/Qwen's) trained offline on text that every
CPython install carries: the docstrings of the standard library and its documentation topics
(``pydoc_data/topics.py``), read in a fixed order. Training is deterministic, so running this
script again with the same Python version reproduces the same files byte for byte::

    python tokenizer_index/data/build_default_tokenizer.py [--out DIR] [--check]

The output is a valid Hugging Face tokenizer directory (``tokenizer.json`` plus a
``tokenizer_config.json`` holding the ChatML chat template from ``chatml.jinja``), loadable by
``transformers.AutoTokenizer.from_pretrained`` as a ``PreTrainedTokenizerFast`` and by
:meth:`kvroute.tokenizer_index.RequestTokenizer.from_pretrained`. ``--check`` also loads it with
transformers (when installed) and compares a rendered chat with kvroute's own encoding.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "default"
TEMPLATE_FILE = HERE / "chatml.jinja"

VOCAB_SIZE = 8000  # learned tokens (256 byte tokens included); added tokens come on top
CORPUS_LIMIT_BYTES = 6_000_000
# Special tokens: never produced from plain text, written by the chat template.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special (as in Qwen's vocabularies): tool-call and reasoning markers.
MARKER_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def stdlib_corpus(limit_bytes: int = CORPUS_LIMIT_BYTES) -> Iterator[str]:
    """Yield training texts in a fixed order: documentation topics, then docstrings by file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    topics = stdlib / "pydoc_data" / "topics.py"
    if topics.exists():
        for text in _module_string_constants(topics):
            total += len(text)
            yield text
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib).parts
        if relative[0] in {"site-packages", "test", "idlelib", "lib2to3", "pydoc_data"} or "tests" in relative:
            continue
        for text in _docstrings(path):
            if total >= limit_bytes:
                return
            total += len(text)
            yield text


def _parse(path: Path) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # old escape sequences in some stdlib modules
            return ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _module_string_constants(path: Path) -> Iterator[str]:
    tree = _parse(path)
    if tree is None:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 40:
            yield node.value


def _docstrings(path: Path) -> Iterator[str]:
    tree = _parse(path)
    if tree is None:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=True)
            if docstring:
                yield docstring


def train_tokenizer(texts: Iterator[str]) -> Tokenizer:
    """Train the byte-level BPE and add the special and marker tokens after the learned ones."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in MARKER_TOKENS])
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, chat_template: str) -> dict[str, object]:
    """The ``tokenizer_config.json`` transformers reads: class, special tokens, chat template."""
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }


def build(out: Path) -> list[Path]:
    """Train and write the tokenizer directory; returns the files written."""
    tokenizer = train_tokenizer(stdlib_corpus())
    chat_template = TEMPLATE_FILE.read_text(encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = out / "tokenizer.json"
    tokenizer.save(str(tokenizer_file), pretty=False)
    config_file = out / "tokenizer_config.json"
    config_file.write_text(json.dumps(tokenizer_config(tokenizer, chat_template), indent=2, ensure_ascii=False) + "\n")
    return [tokenizer_file, config_file]


def check(out: Path) -> None:
    """Load the result with kvroute and, when available, with transformers; compare one chat."""
    sys.path.insert(0, str(HERE.parents[1]))
    from kvroute.tokenizer_index.tokenizer import RequestTokenizer

    ours = RequestTokenizer.from_pretrained(str(out))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime number larger than 100. 😀 素数"},
    ]
    ids = ours.encode_chat(messages)
    print(f"kvroute: {len(ids)} tokens, incremental={ours.incremental}")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print("transformers not installed: skipped the transformers check")
        return
    theirs = AutoTokenizer.from_pretrained(str(out))
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if list(expected) != ids:
        raise SystemExit(f"mismatch with transformers ({type(theirs).__name__}): {expected} != {ids}")
    print(f"transformers {type(theirs).__name__}: identical token ids")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--check", action="store_true", help="verify the result after building")
    args = parser.parse_args(argv)
    for path in build(args.out):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        print(f"{path}  {path.stat().st_size:>8} bytes  sha256:{digest}")
    print(f"python {sys.version.split()[0]}")
    if args.check:
        check(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
