"""The Multi30k German->English recipe, end to end, and its table.

    make multi30k                                   # or, in the venv:
    python launch/multi30k.py [--config FILE] [key=value ...]

Stages, each the `aiayn` command a user would type (printed before it runs):
  0. corpus     ../shared/data/multi30k where it is there, else `aiayn data download multi30k`
                into data/corpora/multi30k (kept once there), given to every stage as
                data.train/valid/test overrides
  1. tokenizer  `aiayn tokenizer train`: one joint SentencePiece BPE vocabulary (§3.4)
  2. train      `aiayn train`: the warmup schedule, label smoothing, Adam 0.9/0.98/1e-9
  3. finish     `aiayn finish RUN --last K`: the last K checkpoints averaged (§6.1) into
                RUN/averaged, scored on the dev and test sets: beam search with a length
                penalty, sacreBLEU's BLEU, chrF and TER

It then prints the wall time of each stage and test_2016_flickr sacreBLEU (BLEU lowercased
and cased, chrF, TER) with signatures, for the averaged model and, as the ablation, for the
last checkpoint alone (beam and greedy). The run resumes where it stopped if interrupted
(`aiayn train` resumes from run_dir); a finished run is only averaged and scored again.

key=value overrides go to every stage (e.g. run_dir=runs/m30_try2 train.max_steps=1000).
"""

from __future__ import annotations

import argparse
import json

from aiayn.config import load_config

from stages import (  # launch/stages.py
    ROOT,
    Stages,
    corpus_overrides,
    main_guard,
    run,
    tokenizer_once,
)


def score(checkpoint: str, overrides: list[str]) -> dict:
    """Test-set scores of one checkpoint (the evaluate command's JSON)."""
    out = run(
        ["evaluate", "--checkpoint", checkpoint, "--split", "test", "--json", *overrides], True
    )
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/multi30k_de_en.yaml")
    parser.add_argument(
        "--average", type=int, default=None, help="K (default: the config's keep_last)"
    )
    parser.add_argument("--no-ablation", action="store_true", help="score only the averaged model")
    parser.add_argument("overrides", nargs="*", help="key=value, given to every stage")
    args = parser.parse_args(argv)

    # The stages run in ROOT, so the config and every relative path in it are ROOT's.
    cfg = load_config(ROOT / args.config, args.overrides)  # validated before any stage runs
    run_dir = ROOT / cfg.run_dir  # an absolute run_dir stays absolute
    k = args.average or cfg.checkpoint.keep_last
    stage = Stages()
    with stage("corpus"):
        common = ["--config", args.config, *corpus_overrides("multi30k", cfg), *args.overrides]
    with stage("tokenizer"):
        tokenizer_once(ROOT / cfg.tokenizer_path, common)
    with stage("train"):
        run(["train", *common])
    with stage("finish"):
        summary = json.loads(run(["finish", str(run_dir), "--last", str(k)], True))
        rows = [(f"average of last {k}, beam", summary["scores"]["test"])]
    stage.done()

    if not args.no_ablation:  # outside the timed recipe: it answers what each part adds
        rows.append(("last checkpoint, beam", score(str(run_dir), [])))
        rows.append(("last checkpoint, greedy", score(str(run_dir), ["decode.beam=1"])))

    print(f"\nMulti30k de->en, test_2016_flickr ({args.config}, {run_dir})\n")
    print("| stage | wall time |\n| --- | ---: |")
    for name, seconds in stage.times.items():
        print(f"| {name} | {seconds / 60:.1f} min |")
    print(
        f"\n| model (beam {cfg.decode.beam}, alpha {cfg.decode.alpha}) "
        "| BLEU lowercased | BLEU cased | chrF | TER |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for name, r in rows:
        print(
            f"| {name} | {r['bleu_lc']:.2f} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['ter']:.2f} |"
        )
    print(f"\nlowercased: {rows[0][1]['bleu_lc_signature']}")
    print(f"cased:      {rows[0][1]['bleu_signature']}")
    print(f"chrF:       {rows[0][1]['chrf_signature']}")
    print(f"TER:        {rows[0][1]['ter_signature']}")
    print(f"hypotheses: {rows[0][1]['hypotheses_file']}")
    return 0


if __name__ == "__main__":
    main_guard("multi30k", main)
