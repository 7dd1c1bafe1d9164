"""The new-text benchmark at a tiny size: it runs, the ids agree, the texts are what it says."""

from __future__ import annotations

import json
from pathlib import Path

from kvroute.benchmarks import bench_new_text


def test_tiny_new_text_run(tmp_path: Path) -> None:
    out = tmp_path / "new-text.json"
    assert bench_new_text.main(["--texts", "20", "--rounds", "2", "--out", str(out)]) == 0
    rows = {row["kind"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(bench_new_text.VOCABULARIES)
    for row in rows.values():
        assert row["equal"] and row["library_us"] > 0 and row["word_split_us"] > 0
        assert len(row["rounds_library_us"]) == len(row["rounds_word_split_us"]) == 2


def test_texts_are_distinct_and_only_cjk_leaves_out_spaces() -> None:
    for kind in bench_new_text.VOCABULARIES:
        made = bench_new_text.texts(kind, 50, 3)
        assert len(set(made)) == 50 and made == bench_new_text.texts(kind, 50, 3)
        assert all(len(text) >= bench_new_text.TEXT_CHARS // 2 for text in made)
    assert bench_new_text.texts("ascii", 1, 0)[0].isascii()
    assert bench_new_text.texts("identifiers", 1, 5)[0].count(" id_5_0_") == 8
    vocabulary = set(bench_new_text.VOCABULARIES["fresh"])
    fresh = [
        [word for word in text.split() if word.isalpha() and word not in vocabulary]
        for text in bench_new_text.texts("fresh", 2, 5)
    ]
    assert [len(words) for words in fresh] == [8, 8] and not set(fresh[0]) & set(fresh[1])
    assert not bench_new_text.texts("spaced", 1, 0)[0].isascii()
    punctuated = bench_new_text.texts("punctuated", 1, 0)[0]
    assert not punctuated.isascii() and sum(not character.isascii() for character in punctuated) < len(punctuated) / 20
    assert bench_new_text.texts("cjk", 1, 0)[0].count(" ") == 1  # only before its number


def test_long_texts_of_some_kinds(tmp_path: Path) -> None:
    """``--chars`` past the compiled cutter's threshold, ``--kinds`` a subset."""
    out = tmp_path / "new-text.json"
    argv = ["--texts", "5", "--rounds", "2", "--chars", "3000", "--kinds", "punctuated,spaced", "--out", str(out)]
    assert bench_new_text.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["kind"] for row in rows] == ["punctuated", "spaced"] and all(row["chars"] >= 3000 for row in rows)
    assert all(row["equal"] for row in rows)
