"""What does mixing sources cost the loader? One token cache against three (data.sources).

    python benchmarks/mixture_loader.py             # Multi30k if ../shared/data/multi30k exists
    python benchmarks/mixture_loader.py --quick     # 2 repeats: a smoke test

The same pairs both ways: the training split whole (data.train: one cache), and cut into three
sources of 50%, 30% and 20% of its lines with weights 5:3:2 and a tag on the second
(data.sources: a mixture's caches), so that an epoch holds the same examples. Each repeat takes
three epochs' batches from each loader in turn (the loader alone, its read-ahead and next-epoch
plan threads running as in training) and reports target tokens/s; the ratio is mixed / single,
and the goal (issue 41) is a mixing cost under 10%, a ratio >= 0.9. The batches/s ratio is the
same per batch: a tag is a source token that the token budget counts, so a tagged mixture makes
more, smaller batches of the same examples, fewer target tokens per batch whatever the loader's
speed. Also timed: one epoch's plan (for the mixture, which examples of each source and then the
same planner).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import time
from pathlib import Path

from _common import fmt, interleaved, machine, markdown_table, summary

from aiayn.config import TokenizerConfig, config_from_dict
from aiayn.corpora import demo
from aiayn.data import ensure_cache, make_loader
from aiayn.data.mixture import as_train, cache_folder
from aiayn.runtime.malloc import keep_freed_memory
from aiayn.tokenizer import Tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
OUT = ROOT / "runs" / "bench" / "mixture"
PARTS = {"a": 0.5, "b": 0.3, "c": 0.2}  # share of the lines, and the weight
TAG = "<bt>"
SINGLE = "1 source (data.train)"
EPOCHS = 3  # per timed repeat: Multi30k's epoch takes some 20 ms


def corpus_lines(numbers: bool) -> tuple[dict[str, list[str]], str]:
    if MULTI30K.is_dir() and not numbers:
        read = {
            s: gzip.open(MULTI30K / f"train.{s}.gz", "rt").read().splitlines() for s in ("de", "en")
        }
        return {"src": read["de"], "tgt": read["en"]}, "Multi30k de-en train"
    d = demo.write_numbers(OUT / "numbers")
    read = {s: (d / f"train.{s}").read_text().splitlines() for s in ("en", "de")}
    return {"src": read["en"], "tgt": read["de"]}, "generated numbers en-de train"


def write_parts(lines: dict[str, list[str]]) -> dict[str, Path]:
    """The whole corpus and its three parts as line-aligned files: {name: prefix}."""
    n = len(lines["src"])
    cuts = [0, *itertools.accumulate(round(share * n) for share in PARTS.values())]
    cuts[-1] = n
    spans = {"whole": (0, n)} | {name: (cuts[i], cuts[i + 1]) for i, name in enumerate(PARTS)}
    out = {}
    for name, (lo, hi) in spans.items():
        prefix = OUT / "corpus" / name
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for side, lang in (("src", "s"), ("tgt", "t")):
            path = Path(f"{prefix}.{lang}")
            if not path.is_file():
                path.write_text("\n".join(lines[side][lo:hi]) + "\n")
        out[name] = prefix
    return out


def tokenizer(lines: dict[str, list[str]]) -> Tokenizer:
    path = OUT / "bpe8k_tagged.model"
    if path.is_file():
        return Tokenizer(path)
    cfg = TokenizerConfig(vocab_size=8000, user_symbols=[TAG])
    return train_tokenizer(cfg, lines["src"][:20000] + lines["tgt"][:20000], path)


def loaders(prefixes: dict[str, Path], tok: Tokenizer, max_tokens: int, buffer: int) -> dict:
    """{row name: loader}: the whole corpus as data.train, and its parts as data.sources with
    and without the tag (what the tag costs is its token, not the mixing)."""
    data = dict(src_lang="s", tgt_lang="t", shuffle_buffer=buffer, max_len=128)
    data["cache_dir"] = str(OUT / "cache")
    base = {"model": {"preset": "small"}, "train": {"max_tokens": max_tokens, "seed": 1}}
    single = config_from_dict({**base, "data": {**data, "train": str(prefixes["whole"])}})
    cache = ensure_cache(single, "train", tok)
    out = {SINGLE: make_loader(single, single.data.train, tok, train=True, cache=cache)}
    for name, tag in (("3 sources (data.sources), one tagged", TAG), ("3 sources, no tag", None)):
        sources = [
            {
                "name": n,
                "path": str(prefixes[n]),
                "weight": w * 10,
                "tag": tag if n == "b" else None,
            }
            for n, w in PARTS.items()
        ]
        mixed = config_from_dict({**base, "data": {**data, "sources": sources}})
        caches = [
            ensure_cache(as_train(mixed, s), "train", tok, folder=cache_folder(s))
            for s in mixed.data.sources
        ]
        out[name] = make_loader(mixed, None, tok, train=True, cache=caches)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--shuffle-buffer", type=int, default=2000, help="examples bucketed together")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 repeats")
    p.add_argument("--numbers", action="store_true", help="the generated corpus, not Multi30k")
    args = p.parse_args(argv)
    keep_freed_memory()
    lines, corpus = corpus_lines(args.numbers)
    tok = tokenizer(lines)
    made = loaders(write_parts(lines), tok, args.max_tokens, args.shuffle_buffer)
    streams = {name: (ld, iter(ld)) for name, ld in made.items()}
    batch_rates: dict[str, list[float]] = {name: [] for name in streams}

    def epoch_of(name: str):
        ld, it = streams[name]

        def timed() -> float:
            # Counted on plans of their own: ld.rows.plan(e) would replace the loader's current
            # and next-epoch plans, which it would then make again inside the timed window.
            n = sum(len(ld.rows.compute_plan(ld.epoch + e)) for e in range(EPOCHS))
            start, tokens = time.perf_counter(), 0
            for batch in itertools.islice(it, n):
                tokens += batch.n_tokens
            seconds = time.perf_counter() - start
            batch_rates[name].append(n / seconds)
            return tokens / seconds

        return timed

    def plan_of(name: str):
        ld = streams[name][0]
        epochs = itertools.count(1000)

        def timed() -> float:
            start = time.perf_counter()
            ld.rows.compute_plan(next(epochs))
            return time.perf_counter() - start

        return timed

    repeats = 2 if args.quick else args.repeats
    for name in streams:  # the first epoch warms the page cache and the threads
        epoch_of(name)()
    rates = interleaved({n: epoch_of(n) for n in streams}, repeats)
    plans = interleaved({n: plan_of(n) for n in streams}, repeats)
    base = summary(rates[SINGLE])[0]
    batch_base = summary(batch_rates[SINGLE][-repeats:])[0]
    rows = []
    for name in streams:
        med, lo, hi = summary(rates[name])
        rows.append(
            [
                name,
                f"{len(streams[name][0].rows.plan(0)[0]):,}",
                f"{fmt(med)} ({fmt(lo)}-{fmt(hi)})",
                f"{med / base:.3f}",
                f"{summary(batch_rates[name][-repeats:])[0] / batch_base:.3f}",
                f"{1000 * summary(plans[name])[0]:.1f}",
            ]
        )
    print(
        f"{corpus}, {made[SINGLE].stats()['examples_read']:,} pairs; max_tokens {args.max_tokens}, "
    )
    print(f"shuffle_buffer {args.shuffle_buffer}, {repeats} repeats; {machine()}\n")
    header = [
        "loader",
        "batches/epoch",
        "target tokens/s, median (min-max)",
        "ratio",
        "batches/s ratio",
        "plan ms",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
