"""The paper's WMT 2014 English->German run, base or big, end to end, and its table.

    make wmt14                 # base; make wmt14-big: big; NPROC=8: 8 GPUs. Or, in the venv:
    python launch/wmt14.py [--big | --config FILE] [--nproc N] [key=value ...]

Stages, each the `aiayn` command a user would type (printed before it runs):
  1. tokenizer  `aiayn tokenizer train`: the Hub revision pinned in the run, the training
                split (4.5M pairs) copied once from the Hub to local parquet files beside the
                token cache, and one BPE vocabulary of 37,000 shared by both sides (§5.1),
                trained once on the copy
  2. prepare    `aiayn data prepare`: the training split's copy (made here if stage 1 did
                not) tokenised into the token cache. CPU work,
                so that no GPU waits for it: on a cluster a CPU job before the GPU job
                (docs/slurm.md#data-first-on-cpus-then-training-on-gpus)
  3. train      `aiayn train`, or N processes as launch/torchrun.sh starts them (--nproc N)
  4. finish     `aiayn finish RUN --last K`: the paper's average (§6.1: base the last 5
                checkpoints, big the last 20) into RUN/averaged, newstest2013 and newstest2014
                translated (beam 4, alpha 0.6) and scored by sacreBLEU
  5. score      `aiayn score --compound-split`: the same newstest2014 output scored as the
                paper scored it (Moses-tokenized, compound-split BLEU; aiayn/eval/paper_bleu.py)

It then prints the wall time of each stage and newstest2014's scores both ways, for the
averaged model and, as the ablation, for the last checkpoint alone. The paper's 27.3 (base) and
28.4 (big) are the compound-split figure; sacreBLEU's reads about a point lower. Interrupted,
the run resumes (`aiayn train` resumes from run_dir); run again, a finished run is only averaged
and scored again.

key=value overrides go to every stage (e.g. run_dir=runs/wmt14_try2 train.max_steps=1000).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

from aiayn.config import load_config

from stages import ROOT, Stages, main_guard, run, tokenizer_once  # launch/stages.py

CONFIGS = {"base": "configs/wmt14_en_de_base.yaml", "big": "configs/wmt14_en_de_big.yaml"}
PAPER = {"transformer_base": ("base", 27.3), "transformer_big": ("big", 28.4)}  # Table 2


def train(common: list[str], nproc: int) -> None:
    """`aiayn train`; with nproc > 1, what launch/torchrun.sh runs: N processes on this machine
    under torchrun with aiayn's restart policy. The recipe averages in a stage of its own, so
    the config's train.finish is off here."""
    args = ["train", *common, "train.finish=0"]
    if nproc == 1:
        run(args)
        return
    launcher = ["-m", "aiayn.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, *launcher, "--max-restarts=3", "-m", "aiayn", *args]
    print("+ " + shlex.join(["python", *cmd[1:]]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def paper_bleu(scores: dict, lang: str) -> dict:
    """`scores` (evaluate's or finish's, with the files it wrote) and the paper's BLEU of the
    same hypotheses."""
    files = ["--hyp", scores["hypotheses_file"], "--ref", scores["references_file"]]
    out = run(["score", *files, "--compound-split", "--lang", lang, "--json"], True)
    return {**scores, **json.loads(out)}


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.2f} h"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--big", action="store_true", help=f"the big model: {CONFIGS['big']}")
    which.add_argument("--config", help=f"another config (default {CONFIGS['base']})")
    parser.add_argument("--nproc", type=int, default=1, help="training processes (GPUs)")
    parser.add_argument(
        "--average", type=int, default=None, help="K (default: the config's train.finish)"
    )
    parser.add_argument("--no-ablation", action="store_true", help="score only the averaged model")
    parser.add_argument("overrides", nargs="*", help="key=value, given to every stage")
    args = parser.parse_args(argv)
    config = args.config or CONFIGS["big" if args.big else "base"]

    # The stages run in ROOT, so the config and every relative path in it are ROOT's.
    cfg = load_config(ROOT / config, args.overrides)  # validated before any stage runs
    run_dir = ROOT / cfg.run_dir  # an absolute run_dir stays absolute
    k = args.average or cfg.train.finish or cfg.checkpoint.keep_last
    lang = cfg.data.tgt_lang
    common = ["--config", config, *args.overrides]
    stage = Stages()
    with stage("tokenizer"):
        tokenizer_once(ROOT / cfg.tokenizer_path, common)
    with stage("prepare"):
        if cfg.data.cache:
            run(["data", "prepare", *common])
        else:
            print("data.cache=false: training streams the corpus, no token cache to prepare")
    with stage("train"):
        train(common, args.nproc)
    with stage("finish"):
        summary = json.loads(run(["finish", str(run_dir), "--last", str(k)], True))
    with stage("score"):
        rows = [(f"average of last {k}, beam", paper_bleu(summary["scores"]["test"], lang))]
    stage.done()

    if not args.no_ablation:  # outside the timed recipe: what the average adds (§6.1)
        last = run(["evaluate", "--checkpoint", str(run_dir), "--split", "test", "--json"], True)
        rows.append(("last checkpoint, beam", paper_bleu(json.loads(last), lang)))
    table(cfg, config, run_dir, stage.times, rows)
    return 0


def table(cfg, config: str, run_dir, times: dict[str, float], rows: list) -> None:
    best = rows[0][1]
    with open(best["references_file"], encoding="utf-8") as fh:
        n = sum(1 for _ in fh)
    print(f"\nWMT 2014 en->de, newstest2014: {n} sentences ({config}, {run_dir})\n")
    print("| stage | wall time |\n| --- | ---: |")
    for name, seconds in times.items():
        print(f"| {name} | {duration(seconds)} |")
    print(
        f"\n| model (beam {cfg.decode.beam}, alpha {cfg.decode.alpha}) "
        "| BLEU tokenized, compound-split (the paper's) | sacreBLEU BLEU | BLEU lowercased "
        "| chrF | TER |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for name, r in rows:
        print(
            f"| {name} | {r['bleu_compound_split']:.2f} | {r['bleu']:.2f} | {r['bleu_lc']:.2f} "
            f"| {r['chrf']:.2f} | {r['ter']:.2f} |"
        )
    size, figure = PAPER.get(cfg.model.preset, (None, None))
    paper = f"its {size} model {figure}" if size else "base 27.3, big 28.4"
    print(
        f"\nThe paper (Table 2): {paper}, newstest2014. That is the first column's BLEU: "
        "Moses-tokenized, hyphenated compounds split, case-sensitive. sacreBLEU's, on the "
        "detokenized output, reads about a point lower; report it with its signature."
    )
    print(f"compound-split: {best['bleu_compound_split_signature']}")
    print(f"sacreBLEU:      {best['bleu_signature']}")
    print(f"lowercased:     {best['bleu_lc_signature']}")
    print(f"chrF:           {best['chrf_signature']}")
    print(f"TER:            {best['ter_signature']}")
    print(f"hypotheses:     {best['hypotheses_file']}")
    print(f"references:     {best['references_file']}")


if __name__ == "__main__":
    main_guard("wmt14", main)
