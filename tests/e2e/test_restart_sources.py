"""A restart needs nothing but the run directory and the token cache: the corpus moved away
after the first start, the run resumes, validates on its own copy of the dev set, and ends as
an uninterrupted run does; `aiayn evaluate` of it then scores the test set from the run's copy."""

import re
import shutil

import torch

from aiayn.config import load_config
from aiayn.eval.evaluate import evaluate
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import hub_dataset, weights_at  # tests/helpers.py

VALID = re.compile(r"valid step (\d+) \| loss ([\d.]+) accuracy ([\d.]+)")


def run(run_dir, corpus, steps: int) -> None:
    extra = (
        f"data.valid={corpus}/valid",
        f"data.test={corpus}/test",
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
    a, b = weights_at(tmp_path / "moved", 8), weights_at(tmp_path / "straight", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The test set too: copied at the first start, scored from the copy with the corpus gone.
    assert (tmp_path / "moved" / "data" / "test.jsonl").is_file()
    scores = evaluate(tmp_path / "moved", "test")
    n_test = len((tmp_path / "elsewhere" / "test.en").read_text().splitlines())
    with open(scores["hypotheses_file"]) as fh:
        assert len(fh.readlines()) == n_test
    assert scores["bleu"] == evaluate(tmp_path / "straight", "test")["bleu"]


def test_a_hub_run_resumes_offline_with_its_dataset_gone(tmp_path, numbers, monkeypatch):
    """The same from the Hub path: the dataset folder removed after the first start and
    HF_HUB_OFFLINE=1; the restart reads the token cache and the run's copy of the dev set."""
    folder = hub_dataset(tmp_path / "hub", numbers)  # wmt/wmt14's layout
    hub = ("data.format=hub", f"data.hub_name={folder}", "data.hub_config=de-en",
           "data.train=train", "data.valid=validation", "data.src_field=translation.en",
           "data.tgt_field=translation.de")  # fmt: skip

    def hub_run(steps: int) -> None:
        extra = (*hub, f"train.max_steps={steps}", "checkpoint.every_steps=4",
                 "train.eval_every=4", "train.threads=1")  # fmt: skip
        train(load_config(None, tiny.overrides(tmp_path / "run", folder, *extra)))

    hub_run(4)
    shutil.rmtree(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_run(8)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "resuming from" in log and "training done at step 8" in log
    assert [m[0] for m in VALID.findall(log)] == ["4", "8"]
