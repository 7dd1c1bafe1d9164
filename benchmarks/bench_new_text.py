"""Tokenizing text the router has not seen: word by word from the word cache vs the library.

Nearly every request brings new text (a user's question, a tool's result). For six kinds
of text, each of distinct ~500-character texts (``--chars``) from a fixed vocabulary (so words recur, as
in a conversation or a codebase) with a unique number at the end, this tokenizes every text
once on a ``RequestTokenizer`` with word-by-word tokenization and on one without
(``word_split=False``: the library's batch call), after a warm-up of other texts of the
same kind, and reports this process's CPU per text (the library's threads included):

* ``ascii``: English words, numbers and code punctuation;
* ``identifiers``: the same with eight identifiers no text had before (``id_3_41_7``):
  new strings, but each pre-tokenizer cuts them into words seen before;
* ``fresh``: the ASCII words with eight words of random letters no text had before (a
  tool result's new names and hashes): every text has words the word table lacks;
* ``punctuated``: the ASCII words with typography as models and web pages write it (curly
  quotes and apostrophes, dashes, ellipses): ASCII but for a character every few words;
* ``spaced``: accented Latin and Cyrillic words between spaces;
* ``cjk``: Chinese and Japanese without spaces (one pre-tokenizer word per sentence, left to
  the library either way).

Every text's ids are checked equal between the two::

    python -m kvroute.benchmarks.bench_new_text [--texts 500] [--rounds 3] [--chars 500] [--kinds ascii,spaced]
        [--tokenizer DIR] [--out bench-out/new-text.json]

Texts of 128 characters or more (64 beyond ASCII) are cut in compiled code
(``word_split.COMPILED_MIN_CHARS``); ``--chars 8000`` times a tool result's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute.tokenizer_index import RequestTokenizer

VOCABULARIES = {
    "ascii": (
        "the router sends each request to the replica holding its prefix def return self value "
        "None True 0 1 42 3.14 error: file line path /usr/lib x = y + 1; {} [] () == != -> # note"
    ).split(),
    "punctuated": (
        "the router sends each request to the replica holding its prefix \u2014 it\u2019s \u201cwarm\u201d "
        "don\u2019t wait\u2026 value error: file line 42 3.14 (note) the user\u2019s cache \u2013 a"
    ).split(),
    "spaced": (
        "naïve café Überprüfung größer résumé niño für être déjà año über straße garçon señor "
        "Москва данные модель запрос кэш ответ and the"
    ).split(),
    "cjk": "数据 模型 路由 缓存 请求 用户 服务器 的 是 在 ， 。 ： キャッシュ リクエスト の を".split(),
}
VOCABULARIES["identifiers"] = VOCABULARIES["fresh"] = VOCABULARIES["ascii"]
JOINERS = {"ascii": " ", "identifiers": " ", "fresh": " ", "punctuated": " ", "spaced": " ", "cjk": ""}
#: Words no other text has, per text of each kind.
NEW_WORDS = {"identifiers": 8, "fresh": 8}
TEXT_CHARS = 500


@dataclass(frozen=True)
class Row:
    """Median over rounds of the CPU per text, microseconds."""

    kind: str
    chars: int
    library_us: float
    word_split_us: float
    rounds_library_us: list[float]
    rounds_word_split_us: list[float]
    equal: bool


def texts(kind: str, count: int, seed: int, chars: int = TEXT_CHARS) -> list[str]:
    """``count`` distinct texts of about ``chars`` characters of ``kind``."""
    rng = random.Random(seed)
    vocabulary, joiner = VOCABULARIES[kind], JOINERS[kind]
    made = []
    for number in range(count):
        words: list[str] = []
        while sum(map(len, words)) + len(words) < chars:
            words.append(rng.choice(vocabulary))
        if kind == "fresh":
            letters = string.ascii_lowercase
            fresh = "".join(" " + "".join(rng.choices(letters, k=rng.randint(5, 9))) for _ in range(NEW_WORDS[kind]))
        else:
            fresh = "".join(f" id_{seed}_{number}_{index}" for index in range(NEW_WORDS.get(kind, 0)))
        made.append(joiner.join(words) + fresh + f" #{seed}-{number}")
    return made


def cpu_per_text(tokenizer: RequestTokenizer, warm: list[str], measured: list[str]) -> tuple[float, list[list[int]]]:
    for text in warm:
        tokenizer.encode_text(text)
    ids = []
    start = time.process_time()
    for text in measured:
        ids.append(tokenizer.encode_text(text))
    return (time.process_time() - start) / len(measured) * 1e6, ids


def measure(kind: str, count: int, rounds: int, tokenizer: Path | None = None, chars: int = TEXT_CHARS) -> Row:
    path = tokenizer or RequestTokenizer.default_path()
    library, words = [], []
    equal = True
    for round_number in range(rounds):
        warm = texts(kind, count, 2 * round_number, chars)
        measured = texts(kind, count, 2 * round_number + 1, chars)
        # Each measured first in every other round, so that neither always runs on a warmer process.
        if round_number % 2:
            with_words, got = cpu_per_text(RequestTokenizer.from_pretrained(path), warm, measured)
            without, expected = cpu_per_text(RequestTokenizer.from_pretrained(path, word_split=False), warm, measured)
        else:
            without, expected = cpu_per_text(RequestTokenizer.from_pretrained(path, word_split=False), warm, measured)
            with_words, got = cpu_per_text(RequestTokenizer.from_pretrained(path), warm, measured)
        library.append(round(without, 1))
        words.append(round(with_words, 1))
        equal = equal and got == expected
    return Row(
        kind=kind,
        chars=len(texts(kind, 1, 0, chars)[0]),
        library_us=statistics.median(library),
        word_split_us=statistics.median(words),
        rounds_library_us=library,
        rounds_word_split_us=words,
        equal=equal,
    )


def format_table(rows: list[Row]) -> str:
    lines = ["text        chars  library us/text  word by word us/text  (rounds)                      ids equal"]
    for row in rows:
        lines.append(
            f"{row.kind:10s} {row.chars:6d}  {row.library_us:15.0f}  {row.word_split_us:20.0f}  "
            f"({', '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(row.rounds_library_us, row.rounds_word_split_us))})"
            f"  {row.equal}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvroute.benchmarks.bench_new_text", description=__doc__)
    parser.add_argument("--texts", type=int, default=500, help="texts measured per kind and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/new-text.json"))
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory (default: kvroute's)")
    parser.add_argument("--chars", type=int, default=TEXT_CHARS, help="characters per text, about")
    parser.add_argument("--kinds", default=",".join(VOCABULARIES), help="comma-separated kinds of text")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(VOCABULARIES):
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    rows = [measure(kind, args.texts, args.rounds, args.tokenizer, args.chars) for kind in kinds]
    print(format_table(rows))
    machine = f"{os.cpu_count()} cpus, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    print(f"machine: {machine}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"rows": [asdict(row) for row in rows], "machine": machine, "python": platform.python_version()}, indent=1
        )
    )
    print(f"wrote {args.out}")
    return 0 if all(row.equal for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
