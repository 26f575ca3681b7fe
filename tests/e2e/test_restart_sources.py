"""A restart needs nothing but the run directory and the token cache: the corpus moved away
after the first start, the run resumes, validates on its own copy of the dev set, and ends as
an uninterrupted run does."""

import re
import shutil

import torch
from safetensors.torch import load_file

from aiayn.config import load_config
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file

VALID = re.compile(r"valid step (\d+) \| loss ([\d.]+) accuracy ([\d.]+)")


def run(run_dir, corpus, steps: int) -> None:
    extra = (
        f"data.valid={corpus}/valid",
        f"train.max_steps={steps}",
        "checkpoint.every_steps=4",
        "train.eval_every=4",
        "train.threads=1",
    )
    train(load_config(None, tiny.overrides(run_dir, corpus, *extra)))


def test_a_run_whose_corpus_was_moved_away_resumes_validates_and_finishes(tmp_path, numbers):
    corpus = tmp_path / "corpus"
    shutil.copytree(numbers, corpus)
    run(tmp_path / "straight", corpus, 8)
    run(tmp_path / "moved", corpus, 4)
    shutil.move(corpus, tmp_path / "elsewhere")
    run(tmp_path / "moved", corpus, 8)  # the config still names the old place

    log = (tmp_path / "moved" / "train.log").read_text()
    assert "its corpus is no longer where it was built from" in log
    assert "resuming from" in log and "training done at step 8" in log
    # The same validation as the uninterrupted run's, at both steps, on the run's copy.
    assert VALID.findall(log) == VALID.findall((tmp_path / "straight" / "train.log").read_text())
    assert [m[0] for m in VALID.findall(log)] == ["4", "8"]
    final = "checkpoints/step_00000008/model.safetensors"
    a, b = load_file(tmp_path / "moved" / final), load_file(tmp_path / "straight" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)
