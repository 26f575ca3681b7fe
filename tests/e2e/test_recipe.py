"""launch/multi30k.py, the recipe script, chains its stages and prints its table. Run here on
the numbers corpus with a tiny model: what is checked is the plumbing (tokenizer, train,
finish, table), not the Multi30k score, which takes 25 minutes (docs/recipes.md)."""

import re
import subprocess
import sys

import pytest

from aiayn.checkpoint import read_manifest

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import TINY_MODEL, model_overrides  # tests/helpers.py


def test_the_recipe_trains_averages_scores_and_prints_its_table(project_root, tmp_path, numbers):
    run_dir = tmp_path / "run"
    overrides = tiny.overrides(
        run_dir,
        numbers,
        f"data.valid={numbers}/valid",
        f"data.test={numbers}/test",
        f"tokenizer.path={tmp_path}/spm.model",
        "tokenizer.type=unigram",
        "train.max_steps=12",
        "train.eval_every=12",
        "train.eval_bleu=0",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=3",
        "decode.bleu_tokenize=char",
        "train.threads=1",
    )
    cmd = [sys.executable, "launch/multi30k.py", "--config", "configs/demo.yaml", *overrides]
    out = subprocess.run(cmd, cwd=project_root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]

    averaged = run_dir / "averaged"  # aiayn finish
    assert [s["step"] for s in read_manifest(averaged)["averaged_from"]] == [4, 8, 12]
    rows = re.findall(
        r"^\| (average of last 3, beam|last checkpoint, \w+) \| ([\d.]+) \|", out.stdout, re.M
    )
    assert [name for name, _ in rows] == [
        "average of last 3, beam",
        "last checkpoint, beam",
        "last checkpoint, greedy",
    ]
    assert all(0 <= float(bleu) <= 100 for _, bleu in rows)
    assert "| train |" in out.stdout and "case:lc" in out.stdout and "nc:6" in out.stdout
    assert (run_dir / "eval" / "test.averaged.hyp").read_text().count("\n") == 50

    # Run again: the tokenizer is kept, training is already done, only scoring runs again.
    again = subprocess.run(cmd, cwd=project_root, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("exists: kept") == 1  # the tokenizer; finish averages again


@pytest.mark.slow  # nine `aiayn` processes: a minute of start-ups
def test_the_fine_tuning_recipe_trains_three_runs_and_prints_its_table(project_root, tmp_path):
    """launch/adapt.py with a tiny model and a few steps: the plumbing (two corpora, a source,
    a fine-tune from it, a run from scratch, six scores, the curve), not the figures."""
    shape = model_overrides(TINY_MODEL, max_len=None)  # max_len: configs/demo.yaml's
    quick = [
        "train.max_steps=8",
        "train.eval_every=4",
        "checkpoint.every_steps=4",
        "train.max_tokens=800",
        "train.threads=1",
        "tokenizer.vocab_size=100",
        "train.eval_bleu=50",
        "decode.max_len_b=4",  # an untrained model's hypotheses end soon
    ]
    runs, data = tmp_path / "runs", tmp_path / "data"
    cmd = [
        sys.executable,
        "launch/adapt.py",
        "--steps",
        "8",
        "--runs",
        str(runs),
        "--data",
        str(data),
        *shape,
        *quick,
    ]
    out = subprocess.run(cmd, cwd=project_root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = re.findall(
        r"^\| (source: A only|fine-tuned on B, 8 steps|scratch on B) \|", out.stdout, re.M
    )
    assert rows == ["source: A only", "fine-tuned on B, 8 steps", "scratch on B"]
    assert "B dev-set BLEU (char), best of the fine-tune" in out.stdout
    manifest = read_manifest(runs / "tuned" / "checkpoints" / "step_00000008")
    assert manifest["init"]["path"] == str(
        (runs / "source" / "checkpoints" / "step_00000008").resolve()
    )
    six = (data / "numbers_6" / "valid.en").read_text().splitlines()
    assert all("hundred thousand" in line or "thousand" in line for line in six[:20])
