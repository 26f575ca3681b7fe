"""Back-translation on Multi30k de->en, end to end, and its table.

    make backtranslation                            # or, in the venv:
    python launch/backtranslation.py [--steps N] [key=value ...]

The classic experiment (Sennrich et al. 2016; tagged: Caswell et al. 2019) on data the project
has. Multi30k's 29,000 training pairs are cut in two: half A is the parallel data, half B's
English side the monolingual text (its German is used only by the "full" row). Stages, each the
`aiayn` command a user would type (printed before it runs):
  0. corpus     ../shared/data/multi30k where it is there, else `aiayn data download multi30k`
                into data/corpora/multi30k, given to every training as overrides
  1. data       half A (de, en) and half B (en) under data/backtranslation/
  2. tokenizer  one joint BPE vocabulary, trained on half A, with <bt> as a user symbol, for
                every model below (so their scores compare)
  3. reverse    an en->de model trained on half A (configs/multi30k_de_en.yaml with the
                languages swapped), its last 5 checkpoints averaged
  4. translate  half B's English into German with it (`aiayn translate --input --output`,
                beam 4): the synthetic source side of the back-translated corpus
  5. de->en     four models, as the Multi30k recipe trains them: half A only; half A + the
                back-translation tagged <bt> (data.sources, weights 1:1); the same untagged;
                and the full parallel set (both halves). Each averaged and scored on
                test_2016_flickr.
  6. --variants  Edunov et al. (2018)'s other synthetic sources, each translated from half B
                by the same reverse model and trained on untagged and tagged: sampled from the
                10 most probable tokens, sampled from all, and beam output with noise (words
                dropped and blanked with p 0.1, moved at most 3 places). Untagged rows first.
                --variants-only: the reverse model and these rows, with beam's untagged row
                (after the untagged variants) to compare them with on the same machine, without
                half A, beam tagged and full. A row takes 15-17 min on 2 cores; the untagged
                rows' results: docs/recipes.md#sampled-and-noised-back-translation.
                --seeds 1 2 3: the untagged rows at each train.seed, with their mean and sd.
A stage whose result exists is kept, so an interrupted run goes on where it stopped.
key=value overrides go to every training (e.g. train.max_steps=1000).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

from aiayn.config import load_config

from stages import (  # launch/stages.py
    ROOT,
    Stages,
    corpus_overrides,
    main_guard,
    run,
    tokenizer_once,
)

CONFIG = "configs/multi30k_de_en.yaml"
DATA = Path("data/backtranslation")
TAG = "<bt>"
VARIANTS = {
    "sampled top-10": ["decode.sampling.enabled=true", "decode.sampling.top_k=10"],
    "sampled": ["decode.sampling.enabled=true"],
    "noised beam": ["decode.noise.drop=0.1", "decode.noise.blank=0.1", "decode.noise.swap=3"],
}
"""--variants: the synthetic sources beside beam's, as `aiayn translate` overrides (Edunov et
al. 2018, §3 and Table 1)."""


def split_halves(train: Path, out: Path) -> int:
    """half_a.{de,en}: the first half of the training pairs; mono.en: the second half's
    English; half_b.de is kept for the full-data row only. Returns the pairs per half."""
    lines = {}
    for lang in ("de", "en"):
        with gzip.open(f"{train}.{lang}.gz", "rt", encoding="utf-8") as fh:
            lines[lang] = fh.read().splitlines()
    half = len(lines["de"]) // 2
    out.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "en"):
        (out / f"half_a.{lang}").write_text("\n".join(lines[lang][:half]) + "\n", "utf-8")
    (out / "mono.en").write_text("\n".join(lines["en"][half:]) + "\n", "utf-8")
    return half


def train_and_score(name: str, common: list[str], data: list[str], k: int) -> dict:
    """`aiayn train` of runs/backtranslation/NAME, then `aiayn finish --last k`: its test
    scores (kept from an earlier run where its summary exists)."""
    run_dir = f"runs/backtranslation/{name}"
    summary = ROOT / run_dir / "averaged" / "summary.json"
    if not summary.is_file():
        run(["train", *common, f"run_dir={run_dir}", *data])
        run(["finish", run_dir, "--last", str(k)], True)
    return json.loads(summary.read_text())["scores"]["test"]


def back_translate(data_dir: Path, prefix: str, decoding: list[str]) -> None:
    """Half B's English into German by the averaged reverse model, with `decoding` overrides:
    PREFIX.de, beside a copy of the English as PREFIX.en (kept where it exists)."""
    if not (data_dir / f"{prefix}.de").is_file():
        reverse = "runs/backtranslation/reverse/averaged"
        run(["translate", "--checkpoint", reverse, "--input", f"{DATA}/mono.en",
             "--output", f"{DATA}/{prefix}.de", *decoding])  # fmt: skip
        (data_dir / f"{prefix}.en").write_bytes((data_dir / "mono.en").read_bytes())
    lines = (data_dir / f"{prefix}.de").read_text("utf-8").splitlines()
    empty = sum(not line.strip() for line in lines)
    # decode.min_len keeps beam search from the empty hypothesis (docs/recipes.md); with
    # decode.min_len=0 some are empty, and the token cache drops those pairs.
    print(f"{empty} of {len(lines)} back-translations ({prefix}) are empty")


def bt_data(prefix: str, tag: str) -> list[str]:
    """Overrides for data.sources of half A and the back-translation PREFIX, 1:1, the latter
    with `tag`, in place of data.train."""
    sources = (
        f"data.sources=[{{name: parallel, path: {DATA}/half_a, weight: 1}}, "
        f"{{name: bt, path: {DATA}/{prefix}, weight: 1{tag}}}]"
    )
    return ["data.train=null", sources]


def print_seed_means(rows: dict[str, dict], seeds: list[int]) -> None:
    """The rows trained at several seeds: test BLEU lowercased per seed, mean and sd."""
    by_row: dict[str, list[float]] = {}
    for name, scores in rows.items():
        by_row.setdefault(name.split(", seed ")[0], []).append(scores["bleu_lc"])
    print(f"\n| model | test BLEU lc, seeds {' / '.join(map(str, seeds))} | mean (sd) |")
    print("| --- | --- | ---: |")
    for name, bleu in by_row.items():
        if len(bleu) > 1:
            each = " / ".join(f"{b:.2f}" for b in bleu)
            print(
                f"| {name} | {each} | {statistics.mean(bleu):.2f} ({statistics.stdev(bleu):.2f}) |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also the sampled (top-10, unrestricted) and noised back-translations' rows",
    )
    parser.add_argument(
        "--variants-only",
        action="store_true",
        help="the reverse model, beam's untagged row and the --variants rows, without half A, "
        "beam tagged and full: the variants against beam measured on one machine",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        metavar="S",
        help="train.seed of each variant's untagged row (and beam's, with --variants-only): "
        "the variants seed by seed, then beam's; a seed other than the config's trains "
        "RUN_seedS; tagged rows at the first seed only (default: the config's train.seed)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value, given to every training")
    args = parser.parse_args(argv)
    cfg = load_config(ROOT / args.config, args.overrides)  # validated before any stage runs
    stage = Stages()
    with stage("corpus"):
        overrides = [*corpus_overrides("multi30k", cfg), *args.overrides]
    cfg = load_config(ROOT / args.config, overrides)  # reading the corpus found
    k = cfg.checkpoint.keep_last
    data_dir = ROOT / DATA
    tok = f"tokenizer.path={DATA}/bpe8k_bt.model"
    common = ["--config", args.config, tok, *overrides]
    half_a = [f"data.train={DATA}/half_a"]
    rows = {}

    seeds = args.seeds or [cfg.train.seed]

    def row(name: str, run_name: str, data: list[str], seed: int | None = None) -> None:
        if seed is not None and seed != cfg.train.seed:
            name, run_name = f"{name}, seed {seed}", f"{run_name}_seed{seed}"
            data = [*data, f"train.seed={seed}"]
        with stage(name):
            rows[name] = train_and_score(run_name, common, data, k)

    with stage("data"):
        if not (data_dir / "mono.en").is_file():
            pairs = split_halves(ROOT / cfg.data.train, data_dir)
            print(f"{pairs} pairs in half A, {pairs} English sentences in half B")
    with stage("tokenizer"):
        symbols = f"tokenizer.user_symbols=[{TAG}]"
        tokenizer_once(data_dir / "bpe8k_bt.model", [*common, *half_a, symbols])
    row("reverse en->de, half A", "reverse", ["data.src_lang=en", "data.tgt_lang=de", *half_a])
    tags = {"tagged": f", tag: '{TAG}'", "untagged": ""}
    with stage("back-translate"):
        back_translate(data_dir, "bt", [])
    if not args.variants_only:
        row("half A", "half", half_a)
        for name, tag in tags.items():
            row(f"half A + BT, {name}", name, bt_data("bt", tag))
        row("full parallel (A + B)", "full", [])
    variants = VARIANTS if args.variants or args.variants_only else {}
    prefixes = {v: "bt_" + v.replace(" ", "_").replace("-", "") for v in variants}
    for variant, decoding in variants.items():
        with stage(f"back-translate, {variant}"):
            back_translate(data_dir, prefixes[variant], decoding)
    # Every variant untagged, then (--variants-only) beam's untagged row on this machine to
    # compare them with, then the tagged ones: Edunov et al.'s comparison first, as an
    # interrupted run keeps what it finished.
    for seed in seeds:
        for variant, prefix in prefixes.items():
            untagged = bt_data(prefix, "")
            row(f"half A + BT {variant}, untagged", f"{prefix}_untagged", untagged, seed)
    if args.variants_only:
        for seed in seeds:
            row("half A + BT, untagged", "untagged", bt_data("bt", ""), seed)
    for variant, prefix in prefixes.items():
        tagged = bt_data(prefix, tags["tagged"])
        row(f"half A + BT {variant}, tagged", f"{prefix}_tagged", tagged, seeds[0])
    stage.done()

    print(f"\nBack-translation, Multi30k de->en, test_2016_flickr ({args.config})\n")
    print("| model | BLEU lowercased | BLEU cased | chrF | wall time |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        scores = f"{r['bleu_lc']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f}"
        print(f"| {name} | {scores} | {stage.times[name] / 60:.1f} min |")
    if len(seeds) > 1:
        print_seed_means(rows, seeds)
    for name, seconds in stage.times.items():
        if name.startswith("back-translate"):
            print(f"{name} (half B): {seconds / 60:.1f} min")
    print(f"total: {stage.times['total'] / 60:.1f} min (a kept stage counts 0)")
    print(f"cased: {next(iter(rows.values()))['bleu_signature']}")
    return 0


if __name__ == "__main__":
    main_guard("backtranslation", main)
