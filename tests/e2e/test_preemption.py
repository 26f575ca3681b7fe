"""A real SIGTERM / SIGUSR1 to a training process: it saves, exits 75, and resumes exactly."""

import signal
import subprocess
import sys

import pytest
import torch

from aiayn.config import load_config
from aiayn.distributed.preemption import REQUEUE_EXIT_CODE
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import weights_at  # tests/helpers.py
from processes import logged, wait_until  # tests/processes.py


def overrides(run_dir, corpus, *extra):
    return tiny.overrides(
        run_dir,
        corpus,
        "model.dropout=0.1",
        "logging.every_steps=1",
        "checkpoint.every_steps=1000",
        *extra,
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_a_signal_saves_exits_75_and_the_resumed_run_ends_bitwise_equal(tmp_path, numbers, signum):
    config = tmp_path / "empty.yaml"
    config.write_text("")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "aiayn",
        "train",
        "--config",
        str(config),
        *overrides(run_dir, numbers, "train.max_steps=100000"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = run_dir / "train.log"
    wait_until(proc, logged(log, "train step 6 |"), 120, "training step 6", interval=0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == REQUEUE_EXIT_CODE, err
    saved = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 1, saved
    stopped_at = int(saved[0].name.split("_")[1])
    assert "stop requested: saved step" in log.read_text()
    # Re-running the same command resumes; compare with a run that never stopped.
    end = stopped_at + 5
    train(load_config(None, overrides(run_dir, numbers, f"train.max_steps={end}")))
    train(load_config(None, overrides(tmp_path / "straight", numbers, f"train.max_steps={end}")))
    a, b = weights_at(run_dir, end), weights_at(tmp_path / "straight", end)
    assert all(torch.equal(a[k], b[k]) for k in a)
