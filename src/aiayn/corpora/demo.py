"""Corpora the project makes itself, so every path can be tried with no download.

numbers: English number words -> German number words ("three hundred twenty-one" ->
"dreihunderteinundzwanzig"), a small translation task with real reordering (German puts units
before tens) and compounding. lm: counting runs in English words. classify: number words
labelled by parity. The same seed gives the same files.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

_VERSION = 1  # bump when the generated text changes, so old directories are rewritten

_EN_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_EN_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_DE_UNITS = (
    "null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn vierzehn "
    "fünfzehn sechzehn siebzehn achtzehn neunzehn"
).split()
_DE_TENS = "_ _ zwanzig dreißig vierzig fünfzig sechzig siebzig achtzig neunzig".split()

LIMIT = 1_000_000
_LARGE = [(1_000, 10_000), (10_000, 100_000), (100_000, LIMIT)]  # numbers of 4, 5, 6 digits


def _check(n: int) -> None:
    if not 0 <= n < LIMIT:
        raise ValueError(f"number words cover 0 <= n < {LIMIT}, got {n}")


def english_number(n: int) -> str:
    """321 -> 'three hundred twenty-one'; no 'and', tens hyphenated."""
    _check(n)
    if n == 0:
        return "zero"
    thousands, rest = divmod(n, 1000)
    words = [_en_below_1000(thousands), "thousand"] if thousands else []
    if rest:
        words.append(_en_below_1000(rest))
    return " ".join(words)


def _en_below_1000(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = [_EN_UNITS[hundreds], "hundred"] if hundreds else []
    if 0 < rest < 20:
        words.append(_EN_UNITS[rest])
    elif rest:
        tens, units = divmod(rest, 10)
        words.append(_EN_TENS[tens] + (f"-{_EN_UNITS[units]}" if units else ""))
    return " ".join(words)


def german_number(n: int) -> str:
    """321 -> 'dreihunderteinundzwanzig': one word, units before tens, 'eins' only at the end."""
    _check(n)
    if n == 0:
        return "null"
    thousands, rest = divmod(n, 1000)
    word = _de_below_1000(thousands, final=False) + "tausend" if thousands else ""
    return word + (_de_below_1000(rest, final=True) if rest else "")


def _de_below_1000(n: int, final: bool) -> str:
    """`final`: these are the last words, where a lone 1 is 'eins' (einhunderteins) and not
    the compound 'ein' (einhunderteintausend)."""
    hundreds, rest = divmod(n, 100)
    word = ("ein" if hundreds == 1 else _DE_UNITS[hundreds]) + "hundert" if hundreds else ""
    if rest == 1:
        return word + ("eins" if final else "ein")
    if rest < 20:
        return word + (_DE_UNITS[rest] if rest else "")
    tens, units = divmod(rest, 10)
    if units:
        word += ("ein" if units == 1 else _DE_UNITS[units]) + "und"
    return word + _DE_TENS[tens]


def _draw(rng: random.Random, n: int, bands: list[tuple[int, int]]) -> list[int]:
    """n distinct numbers spread evenly over the bands [lo, hi) as far as each band allows
    (a small band that fills up leaves its share to the larger ones), shuffled."""
    quotas, left = [], n
    for i, (lo, hi) in enumerate(bands):
        quota = min(hi - lo, -(-left // (len(bands) - i)))
        quotas.append(quota)
        left -= quota
    if left > 0:
        raise ValueError(f"cannot draw {n} distinct numbers from {bands}")
    numbers = [
        x for (lo, hi), q in zip(bands, quotas, strict=True) for x in rng.sample(range(lo, hi), q)
    ]
    rng.shuffle(numbers)
    return numbers


def _split(numbers: list[int], n_train: int, n_valid: int) -> dict[str, list[int]]:
    return {
        "train": numbers[:n_train],
        "valid": numbers[n_train : n_train + n_valid],
        "test": numbers[n_train + n_valid :],
    }


def write_numbers(
    out_dir: str | Path,
    n_train: int = 40_000,
    n_valid: int = 1_000,
    n_test: int = 1_000,
    seed: int = 1,
    digits: tuple[int, ...] = (4, 5, 6),
) -> Path:
    """English -> German number pairs in train/valid/test.{en,de}; the splits share no number.

    Every number below 1000 is in train (up to n_train of them): they hold every word the task
    uses. The rest, and all of valid/test, are drawn evenly over numbers of `digits` digits
    (4, 5 and 6), so valid and test measure whether the model composes words it saw into
    numbers it never saw. Fewer digits make a domain of its own: a model trained on (4, 5)
    has never put "hunderttausend" together (the fine-tuning recipe, launch/adapt.py).
    """
    if not digits or any(d not in (4, 5, 6) for d in digits):
        raise ValueError(f"digits must be among 4, 5 and 6, got {digits}")
    meta = dict(kind="numbers", n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed)
    if tuple(digits) != (4, 5, 6):  # the default's meta stays as it was: its corpus is kept
        meta["digits"] = list(digits)
    bands = [_LARGE[d - 4] for d in sorted(set(digits))]

    def write(out: Path) -> None:
        rng = random.Random(seed)
        small = rng.sample(range(1000), min(n_train, 1000))
        large = _draw(rng, n_train - len(small) + n_valid + n_test, bands)
        splits = _split(large, n_train - len(small), n_valid)
        splits["train"] += small
        rng.shuffle(splits["train"])
        for name, numbers in splits.items():
            _write_lines(out / f"{name}.en", map(english_number, numbers))
            _write_lines(out / f"{name}.de", map(german_number, numbers))

    names = [f"{s}.{lang}" for s in ("train", "valid", "test") for lang in ("en", "de")]
    return _write_once(Path(out_dir), meta, names, write)


def write_lm(
    out_dir: str | Path,
    n_train: int = 20_000,
    n_valid: int = 500,
    n_test: int = 500,
    seed: int = 1,
    min_run: int = 4,
    max_run: int = 16,
) -> Path:
    """Documents of counting runs ('forty-one forty-two forty-three ...'), one per line, in
    train/valid/test.txt. A run's length is uniform in [min_run, max_run]; no two documents,
    in any split, start at the same number."""
    meta = dict(kind="lm", n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed)
    meta.update(min_run=min_run, max_run=max_run)

    def write(out: Path) -> None:
        rng = random.Random(seed)
        bands = [(0, 1000)] + _LARGE[:-1] + [(_LARGE[-1][0], LIMIT - max_run)]
        starts = _split(_draw(rng, n_train + n_valid + n_test, bands), n_train, n_valid)
        for name, numbers in starts.items():
            runs = (range(s, s + rng.randint(min_run, max_run)) for s in numbers)
            _write_lines(out / f"{name}.txt", (" ".join(map(english_number, r)) for r in runs))

    return _write_once(Path(out_dir), meta, ["train.txt", "valid.txt", "test.txt"], write)


def write_classify(
    out_dir: str | Path,
    n_train: int = 20_000,
    n_valid: int = 1_000,
    n_test: int = 1_000,
    seed: int = 1,
) -> Path:
    """JSONL {"text": english_number(n), "label": n % 2} in train/valid/test.jsonl.

    Parity looks like a last-word rule, but the words must be read in context: "one" is odd
    in "twenty-one" and says nothing in "one hundred four". Splits share no number.
    """
    meta = dict(kind="classify", n_train=n_train, n_valid=n_valid, n_test=n_test, seed=seed)

    def write(out: Path) -> None:
        rng = random.Random(seed)
        numbers = _draw(rng, n_train + n_valid + n_test, [(0, 1000)] + _LARGE)
        for name, split in _split(numbers, n_train, n_valid).items():
            rows = (json.dumps({"text": english_number(n), "label": n % 2}) for n in split)
            _write_lines(out / f"{name}.jsonl", rows)

    return _write_once(Path(out_dir), meta, ["train.jsonl", "valid.jsonl", "test.jsonl"], write)


def _write_once(out: Path, meta: dict, names: list[str], write: Callable[[Path], None]) -> Path:
    """Write unless `out` already holds these files made with these parameters (meta.json)."""
    meta = {**meta, "version": _VERSION}
    meta_path = out / "meta.json"
    if meta_path.is_file() and all((out / n).is_file() for n in names):
        if json.loads(meta_path.read_text()) == meta:
            return out
    out.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)  # half-written files must not look finished
    write(out)
    tmp = meta_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, meta_path)
    return out


def _write_lines(path: Path, lines) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line + "\n")
    os.replace(tmp, path)
