"""2 DDP ranks whose checkpoints fill a real disk (a size-limited tmpfs): rank 0's writes fail,
and both ranks agree on each failure at once, go on training, and stop together after
checkpoint.max_failed_saves, instead of one waiting in a barrier for the collective timeout."""

import subprocess
import time

import pytest
from small_disk import small_disk  # tests/small_disk.py

from aiayn.checkpoint.failures import size_on_disk
from aiayn.config import load_config
from aiayn.train import train

import procs  # tests/distributed/procs.py, beside this file
from processes import kill_tree  # tests/processes.py

pytestmark = pytest.mark.distributed

TIMEOUT_MINUTES = 3  # what a rank left waiting in a collective would wait
EVERY = 5


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_both_ranks_agree_on_a_full_disk_and_stop_together(setup, tmp_path, async_save):
    root, config = setup
    disk = tmp_path / "disk"
    settings = [
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=1",
        "checkpoint.max_failed_saves=2",
        f"checkpoint.async_save={str(async_save).lower()}",
        "train.max_steps=20",
        "train.eval_every=0",
        f"distributed.timeout_minutes={TIMEOUT_MINUTES}",
    ]
    # One process measures a checkpoint; the 2-rank run's is a few KiB larger (two RNG states),
    # so a disk of 1.5 of them holds its first checkpoint and not its second.
    probe = tmp_path / "probe"
    train(load_config(config, [f"run_dir={probe}", *settings, f"train.max_steps={EVERY}"]))
    size = size_on_disk(probe / "checkpoints" / f"step_{EVERY:08d}")
    with small_disk(disk, 3 * size // 2048):
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(disk)
        cmd = procs.torchrun(2) + procs.aiayn(config, run_dir, *settings)
        started = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=procs.ENV
        )
        try:
            _, err = proc.communicate(timeout=TIMEOUT_MINUTES * 60 - 30)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            pytest.fail("a rank waited for the others: the run outlived the collective timeout")
        took = time.monotonic() - started
        assert proc.returncode != 0, err[-3000:]
        assert err.count("exitcode  : 2 ") == 2, err[-3000:]  # an error, on both: no restart
        stop = "aiayn train: error: 2 checkpoint saves in a row failed (steps 10, 15;"
        assert err.count(stop) == 2, err[-3000:]  # both ranks, with the same error
        first = "checkpoint step 10 was not written: no space left on device"
        assert f"[rank 1] ERROR {first}" in err, err[-3000:]  # rank 1 learned it too
        assert "on rank 0. It needs about" in err
        log = (run_dir / "train.log").read_text()
        # Both went on training after the first failure; an async write's failure is learned
        # at the next save, so that run stops one save later.
        last = 20 if async_save else 15
        assert f"train step {last} |" in log and f"train step {last + 1} |" not in log
        assert sorted(p.name for p in disk.iterdir()) == ["latest", f"step_{EVERY:08d}"]
        assert took < TIMEOUT_MINUTES * 60 - 30
