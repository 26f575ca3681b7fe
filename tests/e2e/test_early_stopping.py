"""train.patience: a run stops after that many validations without an improvement of
checkpoint.best_metric, saves, says why and exits 0. The count is in the checkpoint: a run
killed -9 after its first validation and resumed stops at the same step, with bitwise-equal
weights. checkpoints/best names the checkpoint with the best recorded metric, and every
command that takes a checkpoint finds it as RUN/best. train.finish leaves the average of the
last checkpoints in RUN/averaged, scored, which evaluate and export accept."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.checkpoint import resolve_checkpoint

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import weights_at  # tests/helpers.py
from processes import kill_tree, logged, wait_until  # tests/processes.py

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# valid/loss cannot fall by 100: the first validation sets the best, the next two count, and
# the run stops at step 30 of 200 whatever the figures are on this CPU.
STOP = 30


def command(run_dir: Path, corpus: Path, config: Path) -> list[str]:
    train = [sys.executable, "-m", "aiayn", "train", "--config", str(config)]
    return train + tiny.overrides(
        run_dir,
        corpus,
        f"data.valid={corpus}/valid",
        "model.dropout=0.1",
        "train.max_steps=200",
        "train.eval_every=10",
        "train.eval_bleu=20",
        "train.patience=2",
        "train.patience_delta=100",
        "checkpoint.every_steps=10",
        "checkpoint.keep_last=5",
        "train.threads=1",
        "train.finish=2",
    )


def run_to_end(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "empty.yaml"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, numbers, config) -> Path:
    run_dir = tmp_path_factory.mktemp("early") / "straight"
    run_to_end(command(run_dir, numbers, config))
    return run_dir


def steps_saved(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


def test_a_run_without_improvement_stops_saves_and_says_why(straight):
    log = (straight / "train.log").read_text()
    assert f"early stop at step {STOP}: valid/loss has not improved by more than 100 in 2 " in log
    assert "its last improvement was to" in log and "at step 10" in log
    assert steps_saved(straight) == [10, 20, STOP]
    assert f"training done at step {STOP}" in log


def test_the_best_pointer_names_the_best_recorded_checkpoint(straight, numbers):
    losses = {
        step: json.loads(
            (straight / "checkpoints" / f"step_{step:08d}" / "manifest.json").read_text()
        )["metrics"]["valid/loss"]
        for step in steps_saved(straight)
    }
    best = min(losses, key=lambda s: (losses[s], -s))
    pointed = (straight / "checkpoints" / "best").read_text().strip()
    assert pointed == f"step_{best:08d}", losses
    assert resolve_checkpoint(straight / "best") == straight / "checkpoints" / pointed
    cli = [sys.executable, "-m", "aiayn", "evaluate", "--checkpoint", str(straight / "best")]
    out = subprocess.run(
        cli + ["--split", "valid", "--json", f"data.valid={numbers}/valid"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["checkpoint"].endswith(pointed)


def test_killed_after_the_first_validation_and_resumed_it_stops_at_the_same_step(
    tmp_path, straight, numbers, config
):
    killed = tmp_path / "killed"
    job = subprocess.Popen(
        command(killed, numbers, config),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )
    try:
        wait_until(job, logged(killed / "train.log", "checkpoint step 10 |"), 300, "step 10")
    finally:
        kill_tree(job)
    assert steps_saved(killed)[-1] < STOP
    run_to_end(command(killed, numbers, config))
    log = (killed / "train.log").read_text()
    assert "resuming from" in log and f"early stop at step {STOP}:" in log
    assert steps_saved(killed)[-1] == STOP
    a, b = weights_at(killed, STOP), weights_at(straight, STOP)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_finished_run_leaves_its_averaged_model_scored(straight, numbers, tmp_path):
    averaged = straight / "averaged"
    summary = json.loads((averaged / "summary.json").read_text())
    assert summary["checkpoints"] == ["step_00000020", f"step_{STOP:08d}"]
    assert {"bleu", "chrf", "ter", "chrf_signature"} <= set(summary["scores"]["valid"])
    a, b = weights_at(straight, 20), weights_at(straight, STOP)
    mean = load_file(averaged / "model.safetensors")
    assert all(torch.equal(mean[k], (a[k] + b[k]) / 2) for k in a)
    cli = [sys.executable, "-m", "aiayn"]
    evaluated = subprocess.run(
        cli + ["evaluate", "--checkpoint", str(averaged), "--split", "valid", "--json"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["chrf"] == pytest.approx(summary["scores"]["valid"]["chrf"])
    out = tmp_path / "averaged.safetensors"
    exported = subprocess.run(
        cli + ["export", str(averaged), "--output", str(out)],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert exported.returncode == 0 and out.is_file(), exported.stderr[-3000:]
