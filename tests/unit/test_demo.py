"""Generated demo corpora: correct number words, disjoint deterministic splits, no rewrite."""

from __future__ import annotations

import json

import pytest

from aiayn.corpora.demo import (
    english_number,
    german_number,
    write_classify,
    write_lm,
    write_numbers,
)

KNOWN = [
    (0, "zero", "null"),
    (1, "one", "eins"),
    (7, "seven", "sieben"),
    (11, "eleven", "elf"),
    (12, "twelve", "zwölf"),
    (16, "sixteen", "sechzehn"),
    (17, "seventeen", "siebzehn"),
    (21, "twenty-one", "einundzwanzig"),
    (30, "thirty", "dreißig"),
    (60, "sixty", "sechzig"),
    (70, "seventy", "siebzig"),
    (100, "one hundred", "einhundert"),
    (101, "one hundred one", "einhunderteins"),
    (321, "three hundred twenty-one", "dreihunderteinundzwanzig"),
    (1000, "one thousand", "eintausend"),
    (1001, "one thousand one", "eintausendeins"),
    (1100, "one thousand one hundred", "eintausendeinhundert"),
    (21_000, "twenty-one thousand", "einundzwanzigtausend"),
    (101_000, "one hundred one thousand", "einhunderteintausend"),
    (
        999_999,
        "nine hundred ninety-nine thousand nine hundred ninety-nine",
        "neunhundertneunundneunzigtausendneunhundertneunundneunzig",
    ),
]

_WORDS = {w: i for i, w in enumerate(english_number(n) for n in range(20))}
_WORDS.update({english_number(n): n for n in range(20, 100, 10)})


def english_to_int(text: str) -> int:
    """The inverse of english_number, written independently of it."""
    total = current = 0
    for word in text.split():
        if word == "hundred":
            current *= 100
        elif word == "thousand":
            total, current = current * 1000, 0
        else:
            current += sum(_WORDS[part] for part in word.split("-"))
    return total + current


@pytest.mark.parametrize(("n", "en", "de"), KNOWN)
def test_known_numbers_have_the_right_words(n, en, de):
    assert english_number(n) == en
    assert german_number(n) == de


def test_english_words_read_back_as_the_same_number():
    for n in list(range(0, 2000)) + list(range(2000, 1_000_000, 997)):
        assert english_to_int(english_number(n)) == n


def test_numbers_outside_the_range_are_refused():
    for bad in (-1, 1_000_000):
        with pytest.raises(ValueError, match="0 <= n < 1000000"):
            english_number(bad)
        with pytest.raises(ValueError):
            german_number(bad)


def read_numbers(path) -> list[int]:
    return [english_to_int(line) for line in path.read_text().splitlines()]


def test_number_splits_are_disjoint_aligned_and_mix_small_and_large(tmp_path):
    out = write_numbers(tmp_path, n_train=3000, n_valid=300, n_test=300, seed=4)
    splits = {s: read_numbers(out / f"{s}.en") for s in ("train", "valid", "test")}
    assert [len(v) for v in splits.values()] == [3000, 300, 300]
    assert len(set().union(*splits.values())) == 3600  # no number twice, in or across splits
    assert set(range(1000)) <= set(splits["train"])
    for name, numbers in splits.items():
        german = (out / f"{name}.de").read_text().splitlines()
        assert german == [german_number(n) for n in numbers]
    digits = [len(str(n)) for n in splits["valid"]]
    assert {4, 5, 6} <= set(digits) and all(digits.count(d) > 60 for d in (4, 5, 6))


def test_number_files_are_deterministic_and_rewritten_only_when_parameters_change(tmp_path):
    a = write_numbers(tmp_path / "a", n_train=500, n_valid=20, n_test=20, seed=1)
    b = write_numbers(tmp_path / "b", n_train=500, n_valid=20, n_test=20, seed=1)
    assert (a / "train.de").read_bytes() == (b / "train.de").read_bytes()
    stamp = (a / "train.en").stat().st_mtime_ns
    write_numbers(a, n_train=500, n_valid=20, n_test=20, seed=1)
    assert (a / "train.en").stat().st_mtime_ns == stamp  # same parameters: left alone
    write_numbers(a, n_train=500, n_valid=20, n_test=20, seed=2)
    assert (a / "train.de").read_bytes() != (b / "train.de").read_bytes()
    assert json.loads((a / "meta.json").read_text())["seed"] == 2


def test_lm_documents_are_counting_runs(tmp_path):
    out = write_lm(tmp_path, n_train=200, n_valid=20, n_test=20, min_run=3, max_run=6)
    starts = []
    for name in ("train", "valid", "test"):
        docs = (out / f"{name}.txt").read_text().splitlines()
        assert len(docs) == {"train": 200}.get(name, 20)
        for doc in docs:
            runs = [
                (s, n)
                for s in {english_to_int(" ".join(doc.split()[:k])) for k in range(1, 8)}
                for n in range(3, 7)
                if s + n <= 1_000_000
                if " ".join(english_number(s + i) for i in range(n)) == doc
            ]
            assert runs, doc
            starts.append(runs[0][0])
    assert len(set(starts)) == len(starts)


def test_classify_rows_are_number_words_labelled_by_parity(tmp_path):
    out = write_classify(tmp_path, n_train=300, n_valid=30, n_test=30)
    seen = set()
    for name in ("train", "valid", "test"):
        for line in (out / f"{name}.jsonl").read_text().splitlines():
            row = json.loads(line)
            n = english_to_int(row["text"])
            assert row["label"] == n % 2 and english_number(n) == row["text"]
            seen.add(n)
    assert len(seen) == 360
