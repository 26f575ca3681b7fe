"""The language-model recipes on real text, end to end, and their tables.

    make tinyshakespeare                  # or, in the venv:
    make wikitext2                        #   python launch/lm_recipe.py NAME [key=value ...]

NAME is tinyshakespeare or wikitext2. Stages, each the `aiayn` command a user would type
(printed before it runs):
  0. corpus     the corpus from ../shared/data where it is there, else `aiayn data download`
                into data/corpora/ (kept once there); wikitext2 gives it to every stage as
                data.train/valid/test overrides
     split      tinyshakespeare only, in place of corpus: the first 90% of the characters of
                input.txt.gz train and the last 10% validate, as nanoGPT's shakespeare_char
                does (written to data/tinyshakespeare/; the corpus is looked up only then)
  1. tokenizer  `aiayn tokenizer train`
  2. train      `aiayn train` (resumes where it stopped)
  3. evaluate   `aiayn evaluate`: the whole scored split, in non-overlapping windows and with a
                sliding window, in the units published figures use

It then prints the wall time of each stage, the scores, the model's parameters and tokens/s,
the validation curve (against minutes of training, from TensorBoard, not counting the time
between the processes of a resumed run) and a sample.

key=value overrides go to every stage (e.g. run_dir=runs/ts_try2 train.max_steps=1000).
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from aiayn.config import load_config
from aiayn.metric_names import tag

from stages import (  # launch/stages.py
    ROOT,
    Stages,
    corpus,
    corpus_overrides,
    main_guard,
    run,
    tokenizer_once,
)


@dataclass(frozen=True)
class Recipe:
    config: str
    corpus: str  # its name in aiayn/corpora/catalog.py
    split: str  # the split the goal is measured on
    metric: str  # valid/<metric> in TensorBoard, <metric> in evaluate's JSON
    goal: float
    prompt: str


RECIPES = {
    "tinyshakespeare": Recipe(
        "configs/tinyshakespeare_lm.yaml", "tinyshakespeare", "valid", "bpc", 2.12, "ROMEO:\\n"
    ),
    "wikitext2": Recipe(
        "configs/wikitext2_lm.yaml", "wikitext-2", "test", "word_ppl", 130.0, " = Robert"
    ),
}


def split_tinyshakespeare(out: Path) -> None:
    """train.txt: the first 90% of the characters; valid.txt: the rest (nanoGPT's split)."""
    if (out / "valid.txt").exists():
        print(f"{out} exists: kept")
        return
    source = ROOT / corpus("tinyshakespeare") / "input.txt.gz"
    text = gzip.open(source, "rt", encoding="utf-8").read()
    cut = int(len(text) * 0.9)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(text[:cut], encoding="utf-8")
    # Written last: its presence means the split is complete.
    (out / "valid.txt").write_text(text[cut:], encoding="utf-8")
    print(f"split {source}: {cut} train and {len(text) - cut} validation characters into {out}")


def validation_curve(run_dir: Path, metric: str) -> list[tuple[float, int, float]]:
    """(minutes of training, step, value) of valid/<metric> in TensorBoard.

    Minutes count each process's time from its writer's start: a run stopped and resumed
    does not count the time between its processes (work repeated after a crash does count)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    points, spent = [], 0.0
    # One file per writer, named by its start time (seconds, ten digits until 2286).
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        events = list(EventFileLoader(str(path)).Load())
        if not events:
            continue
        start = events[0].wall_time  # the file's header, written when the process opened it
        for e in events:
            points += [
                ((spent + e.wall_time - start) / 60, e.step, float(make_ndarray(v.tensor)))
                for v in e.summary.value
                if v.tag == tag(metric)
            ]
        spent += events[-1].wall_time - start
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", choices=sorted(RECIPES))
    parser.add_argument("--config", default=None, help="default: the recipe's config")
    parser.add_argument("--stride", type=int, default=None, help="sliding-window stride")
    parser.add_argument("overrides", nargs="*", help="key=value, given to every stage")
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    config = args.config or recipe.config

    cfg = load_config(ROOT / config, args.overrides)  # validated before any stage runs
    run_dir = ROOT / cfg.run_dir
    stride = args.stride or cfg.data.max_len // 2
    stage = Stages()
    overrides = args.overrides
    if args.recipe == "tinyshakespeare":  # the config reads the split, made from the corpus
        with stage("split"):
            split_tinyshakespeare(ROOT / Path(cfg.data.train).parent)
    else:
        with stage("corpus"):
            overrides = [*corpus_overrides(recipe.corpus, cfg), *args.overrides]
    common = ["--config", config, *overrides]
    with stage("tokenizer"):
        tokenizer_once(ROOT / cfg.tokenizer_path, common)
    with stage("train"):
        run(["train", *common])
    with stage("evaluate"):
        rows = []
        for name, extra in (
            ("non-overlapping windows", []),
            (f"sliding window, stride {stride}", [f"train.eval_stride={stride}"]),
        ):
            out = run(
                ["evaluate", "--checkpoint", str(run_dir), "--split", recipe.split, "--json"]
                + overrides
                + extra,
                capture=True,
            )
            rows.append((name, json.loads(out)))
    stage.done()
    sample = run(
        ["generate", "--checkpoint", str(run_dir), "--prompt", recipe.prompt]
        + ["--max-new-tokens", "300", "--temperature", "0.8"],
        capture=True,
    )
    params = run(["params", *common], capture=True).strip()

    unit = cfg.data.unit
    print(f"\n{args.recipe}: {recipe.split} split ({config}, {run_dir})\n")
    print("| stage | wall time |\n| --- | ---: |")
    for name, seconds in stage.times.items():
        print(f"| {name} | {seconds / 60:.1f} min |")
    print(
        f"\n| scoring (window {cfg.data.max_len} tokens) | loss/token | {recipe.metric} "
        f"| tokens | {unit} |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for name, r in rows:
        print(
            f"| {name} | {r['loss']:.4f} | **{r[recipe.metric]:.3f}** | {r['tokens']} | {r[unit]} |"
        )
    best = min(r[recipe.metric] for _, r in rows)
    verdict = "met" if best <= recipe.goal else f"not met, {best - recipe.goal:+.3f}"
    print(f"\ngoal: {recipe.metric} <= {recipe.goal} ({verdict})")
    print(f"\n{params}\n\nvalidation curve ({recipe.metric}, non-overlapping windows):\n")
    print(f"| minutes | step | {recipe.metric} |\n| ---: | ---: | ---: |")
    for minutes, step, value in validation_curve(run_dir, recipe.metric):
        print(f"| {minutes:.1f} | {step} | {value:.3f} |")
    print(f"\nsample (temperature 0.8):\n\n{sample}")
    return 0


if __name__ == "__main__":
    main_guard("lm_recipe", main)
