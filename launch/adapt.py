"""Domain adaptation with init.source, measured on the numbers demo, and its table.

    make adapt                                      # or, in the venv:
    python launch/adapt.py [--steps N] [key=value ...]

Domain A is the demo's task on numbers of 4 and 5 digits (and every number below 1000), 40,000
pairs; domain B, numbers of 6 digits, which need "hunderttausend" compositions A never shows,
with little in-domain data: 2,000 pairs (1,000 of them the numbers below 1000). Stages, each
the `aiayn` command a user would type (printed before it runs):
  1. data       `aiayn demo-data numbers --digits 4 5` and `--digits 6 --n-train 2000`
  2. source     `aiayn train` on A: configs/demo.yaml as it is (1,200 steps)
  3. fine-tune  `aiayn train init.source=<source>` on B for --steps steps: the source's
                weights and tokenizer, and a constant rate of 1e-3 (--lr), a fifth of the
                source's last; the demo's own schedule (peak 8.8e-3) wrecks the trained model
  4. scratch    `aiayn train` on B from a new model, as long as the source trained, with
                the same tokenizer and schedule as the source
Then every model is scored on both test sets (`aiayn evaluate`: exact match and character
BLEU, with the config's beam search as in validation), so the table shows what fine-tuning
gains on B and forgets of A, and the dev-set curves of the two B runs say how many steps from
scratch reach the fine-tune's score.

key=value overrides go to every training stage (e.g. train.threads=2), and decode.* ones to
the scoring too.
"""

from __future__ import annotations

import argparse
import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stages import ROOT, Stages, main_guard, run  # launch/stages.py

CONFIG = "configs/demo.yaml"
DIGITS = {"A": ["4", "5"], "B": ["6"]}
PAIRS = {"A": [], "B": ["--n-train", "2000"]}  # B: a small in-domain corpus


def corpus(data_dir: str, domain: str) -> str:
    return f"{data_dir}/numbers_{''.join(DIGITS[domain])}"


def data(data_dir: str, domain: str) -> list[str]:
    path = corpus(data_dir, domain)
    return [f"data.train={path}/train", f"data.valid={path}/valid", f"data.test={path}/test"]


def score(run_dir: str, path: str, decode: list[str]) -> dict:
    """Test-set scores of a run's last checkpoint on a domain's test set (the config's beam
    search, as validation decodes; `decode`: the decode.* overrides given)."""
    out = run(
        [
            "evaluate",
            "--checkpoint",
            run_dir,
            "--split",
            "test",
            "--json",
            f"data.test={path}/test",
            *decode,
        ],
        True,
    )
    return json.loads(out)


def valid_curve(run_dir: str) -> dict[int, float]:
    """Step -> dev-set character BLEU (greedy and beam alike: the validation's own decoding)."""
    acc = EventAccumulator(str(ROOT / run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("valid/bleu")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps on B")
    parser.add_argument("--lr", type=float, default=1e-3, help="the fine-tune's constant rate")
    parser.add_argument("--runs", default="runs/adapt", help="where the three runs go")
    parser.add_argument("--data", default="data/demo", help="where the two corpora go")
    parser.add_argument("overrides", nargs="*", help="key=value, given to every training")
    args = parser.parse_args(argv)
    runs = args.runs
    source, tuned, scratch = f"{runs}/source", f"{runs}/tuned", f"{runs}/scratch"
    every = ["train.eval_every=100", "checkpoint.every_steps=100", "logging.every_steps=100"]
    stage = Stages()
    with stage("data"):
        for domain, digits in DIGITS.items():
            out = corpus(args.data, domain)
            run(["demo-data", "numbers", "--out", out, "--digits", *digits, *PAIRS[domain]])
    with stage("source (A)"):
        run(
            [
                "train",
                "--config",
                CONFIG,
                f"run_dir={source}",
                *data(args.data, "A"),
                *args.overrides,
            ]
        )
    with stage(f"fine-tune (B, {args.steps} steps)"):
        run(
            [
                "train",
                "--config",
                CONFIG,
                f"run_dir={tuned}",
                f"init.source={source}",
                *data(args.data, "B"),
                f"train.max_steps={args.steps}",
                "schedule.kind=constant",
                f"schedule.lr={args.lr}",
                *every,
                *args.overrides,
            ]
        )
    with stage("scratch (B)"):
        run(
            [
                "train",
                "--config",
                CONFIG,
                f"run_dir={scratch}",
                *data(args.data, "B"),
                f"tokenizer.path={source}/tokenizer/spm.model",
                *every,
                *args.overrides,
            ]
        )
    stage.done()

    decode = [o for o in args.overrides if o.startswith("decode.")]
    rows = {
        name: {d: score(r, corpus(args.data, d), decode) for d in DIGITS}
        for name, r in (
            ("source: A only", source),
            (f"fine-tuned on B, {args.steps} steps", tuned),
            ("scratch on B", scratch),
        )
    }
    tuned_best = max(valid_curve(tuned).values())
    reached = [s for s, v in sorted(valid_curve(scratch).items()) if v >= tuned_best]
    print(f"\nDomain adaptation on the numbers demo ({CONFIG}, {runs})\n")
    print("| stage | wall time |\n| --- | ---: |")
    for name, seconds in stage.times.items():
        print(f"| {name} | {seconds / 60:.1f} min |")
    print(
        "\n| model | A test: exact match | A test: BLEU (char) | B test: exact match "
        "| B test: BLEU (char) |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for name, got in rows.items():
        a, b = got["A"], got["B"]
        print(
            f"| {name} | {a['exact_match']:.3f} | {a['bleu']:.2f} | {b['exact_match']:.3f} "
            f"| {b['bleu']:.2f} |"
        )
    print(
        f"\nB dev-set BLEU (char), best of the fine-tune: {tuned_best:.2f}; training from "
        + (
            f"scratch first reached it at step {reached[0]}"
            if reached
            else "scratch did not reach it in its steps"
        )
    )
    return 0


if __name__ == "__main__":
    main_guard("adapt", main)
