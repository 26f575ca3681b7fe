"""SIGKILL at random moments, during saves too, then the same command again: the run ends with
parameters, optimizer state and the moving average of the weights (train.ema) bitwise equal to
a run that was never interrupted."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from aiayn.checkpoint import checkpoints_in, read_trainer_state
from aiayn.checkpoint.average import average, export
from aiayn.checkpoint.locate import locate

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import checkpoint_dir, torchrun, weights_at  # tests/helpers.py
from processes import kill_tree, wait_until  # tests/processes.py

STEPS = 40
# One thread per process: the same reduction order in every run, and the runs leave the other
# core to the poller that watches for a save in progress.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def overrides(run_dir: Path, corpus: Path) -> list[str]:
    return tiny.overrides(
        run_dir,
        corpus,
        "model.dropout=0.1",  # resume must restore every rank's dropout stream
        "logging.every_steps=1",
        "checkpoint.every_steps=3",
        "checkpoint.keep_last=2",
        f"train.max_steps={STEPS}",
        "train.threads=1",
        "train.ema=0.99",  # its average is resumed bit for bit too
    )


def final_state(run_dir: Path) -> tuple[dict, dict, dict]:
    ckpt = checkpoint_dir(run_dir, STEPS)
    trainer = read_trainer_state(ckpt)
    return weights_at(run_dir, STEPS), trainer["engine"], load_file(ckpt / "ema.safetensors")


def assert_bitwise_equal(a: Path, b: Path) -> None:
    (weights_a, engine_a, ema_a), (weights_b, engine_b, ema_b) = final_state(a), final_state(b)
    assert weights_a.keys() == weights_b.keys()
    differ = [k for k in weights_a if not torch.equal(weights_a[k], weights_b[k])]
    assert not differ, f"parameters differ: {differ[:5]}"
    assert ema_a.keys() == weights_a.keys() == ema_b.keys()
    differ = [k for k in ema_a if not torch.equal(ema_a[k], ema_b[k])]
    assert not differ, f"the weights' moving averages differ: {differ[:5]}"
    # ... and it is an average, not the weights: 0.99 moves slowly over 40 steps
    assert not torch.equal(ema_a["out.weight"], weights_a["out.weight"])
    moments = [
        (k, name)
        for k, slot in engine_a["optimizer"]["state"].items()
        for name, value in slot.items()
        if not torch.equal(value, engine_b["optimizer"]["state"][k][name])
    ]
    assert not moments, f"optimizer state differs: {moments[:5]}"


def steps_logged(run_dir: Path, since: int) -> int:
    """Training steps this process has logged: lines after byte `since` of train.log."""
    log = run_dir / "train.log"
    if not log.is_file():
        return 0
    with open(log, "rb") as fh:
        fh.seek(since)
        return fh.read().count(b"train step ")


def log_size(run_dir: Path) -> int:
    log = run_dir / "train.log"
    return log.stat().st_size if log.is_file() else 0


def temporary_dirs(run_dir: Path) -> set[str]:
    root = run_dir / "checkpoints"
    return {n for n in os.listdir(root) if n.startswith(".tmp-")} if root.is_dir() else set()


def kill_after_steps(proc: subprocess.Popen, run_dir: Path, since: int, n: int, delay: float):
    wait_until(proc, lambda: steps_logged(run_dir, since) >= n, 180, f"{n} steps logged")
    time.sleep(delay)
    kill_tree(proc)  # torchrun and every rank at once
    return f"killed {delay:.3f}s after its {n}th step was logged"


def kill_during_save(proc: subprocess.Popen, run_dir: Path, stale: set[str]) -> str:
    """Kill when a new temporary checkpoint directory appears. Returns "RETRY" when the save
    finished before the kill landed: only what a kill leaves behind proves it hit a save."""
    # Busy: a tiny save lasts milliseconds.
    new = wait_until(proc, lambda: temporary_dirs(run_dir) - stale, 180, "save", interval=0)
    kill_tree(proc)
    if temporary_dirs(run_dir) - stale:
        return f"killed during a save ({sorted(new)[0]})"
    return "RETRY"


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
    )


def run_to_end(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def kill_and_resume(make_cmd, run_dir: Path, trials: list[tuple]) -> list[str]:
    """Run `trials` (each ("steps", n, delay) or ("save",)), then the command to its end."""
    what = []
    for trial in trials:
        while True:
            since, stale = log_size(run_dir), temporary_dirs(run_dir)
            proc = start(make_cmd())
            if trial[0] == "steps":
                outcome = kill_after_steps(proc, run_dir, since, *trial[1:])
            else:
                outcome = kill_during_save(proc, run_dir, stale)
            if outcome != "RETRY":
                break
        what.append(f"{outcome}; checkpoints: {sorted(os.listdir(run_dir / 'checkpoints'))}")
    run_to_end(make_cmd())
    return what


def random_trials(seed: int, n_steps: int, n_saves: int) -> list[tuple]:
    rng = random.Random(seed)
    # A step takes ~10 ms here: at most ~10 steps a trial, 3 to reach a save, fewer than STEPS.
    assert 10 * n_steps + 3 * n_saves < STEPS
    trials = [("steps", rng.randint(2, 5), rng.uniform(0.0, 0.05)) for _ in range(n_steps)]
    trials += [("save",)] * n_saves
    rng.shuffle(trials)
    return trials


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "empty.yaml"
    path.write_text("")
    return path


def one_process(config_file: Path, run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    train = [sys.executable, "-m", "aiayn", "train", "--config", str(config_file)]
    return train + overrides(run_dir, corpus) + list(extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, numbers, config_file) -> Path:
    """The uninterrupted run, saving synchronously: how a run saves does not change what it
    computes, so both save modes' killed runs end as this one does."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_to_end(one_process(config_file, run_dir, numbers, "checkpoint.async_save=false"))
    return run_dir


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_sigkill_at_random_moments_then_rerun_ends_bitwise_equal(
    tmp_path, numbers, config_file, straight, save_mode
):
    """With checkpoint.async_save the kills during a save land in the background write."""

    def cmd(run_dir):
        mode = f"checkpoint.async_save={save_mode == 'async'}"
        return one_process(config_file, run_dir, numbers, mode)

    killed = tmp_path / "killed"
    what = kill_and_resume(lambda: cmd(killed), killed, random_trials(seed=4, n_steps=3, n_saves=2))
    assert sum("during a save" in w for w in what) == 2, what
    assert_bitwise_equal(killed, straight)
    log = (killed / "train.log").read_text()
    assert log.count("resumed from") >= 1, what  # at least one kill came after a checkpoint


def test_evaluate_and_export_take_the_runs_moving_average_by_the_name_ema(
    tmp_path, numbers, straight
):
    """`aiayn evaluate --checkpoint RUN/ema` scores the EMA's weights, its hypotheses written
    apart from the checkpoint's own; `aiayn export RUN/ema` writes those weights; `aiayn
    average` averages the checkpoints' EMAs beside their weights."""
    cli = [sys.executable, "-m", "aiayn", "evaluate", "--checkpoint", str(straight / "ema")]
    proc = subprocess.run(
        [*cli, "--split", "test", "--json", f"data.test={numbers}/test"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result, step = json.loads(proc.stdout), checkpoint_dir(straight, STEPS)
    assert result["checkpoint"] == str(step / "ema")
    assert Path(result["hypotheses_file"]).name == f"test.{step.name}.ema.hyp"
    assert 0 <= result["bleu"] <= 100

    out = export(straight / "ema", tmp_path / "ema.safetensors")
    exported, ema = load_file(out), load_file(step / "ema.safetensors")
    assert exported.keys() == ema.keys()
    assert all(torch.equal(exported[k], ema[k]) for k in ema)

    # An average of checkpoints with EMAs averages those too: OUTPUT/ema, weights only.
    ckpts = checkpoints_in(straight / "checkpoints")
    assert len(ckpts) == 2
    averaged = average(ckpts, tmp_path / "averaged")
    emas = [load_file(c / "ema.safetensors") for c in ckpts]
    got = load_file(averaged / "ema.safetensors")
    assert got.keys() == emas[0].keys()
    for k, t in got.items():
        assert torch.equal(t, (emas[0][k] + emas[1][k]) / 2), k
    assert not torch.equal(got[k], load_file(averaged / "model.safetensors")[k])
    with safe_open(str(averaged / "ema.safetensors"), framework="pt") as fh:
        assert "aiayn_ema_updates" not in fh.metadata()
    assert locate(averaged / "ema").weights == averaged / "ema.safetensors"


@pytest.mark.distributed
def test_two_ddp_ranks_killed_and_resumed_end_bitwise_equal(tmp_path, numbers, config_file):
    def cmd(run_dir):
        train = ["-m", "aiayn", "train", "--config", str(config_file)]
        return torchrun(2) + train + overrides(run_dir, numbers)

    run_to_end(cmd(tmp_path / "straight"))
    killed = tmp_path / "killed"
    what = kill_and_resume(lambda: cmd(killed), killed, random_trials(seed=7, n_steps=1, n_saves=1))
    assert sum("during a save" in w for w in what) == 1, what
    assert "x 2 ranks per step" in (killed / "train.log").read_text()
    assert_bitwise_equal(killed, tmp_path / "straight")
