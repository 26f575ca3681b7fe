"""2 DDP ranks whose checkpoints fill a real disk (a size-limited tmpfs): their writes fail,
and both ranks agree on each failure at once, go on training, and stop together after
checkpoint.max_failed_saves, instead of one waiting in a barrier for the collective timeout."""

import re
import subprocess

import pytest
from small_disk import small_disk  # tests/small_disk.py

from aiayn.checkpoint.failures import size_on_disk

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file
from processes import kill_tree  # tests/processes.py

pytestmark = pytest.mark.distributed

TIMEOUT_MINUTES = 3  # what a rank left waiting in a collective would wait
EVERY = 5


@pytest.fixture(scope="module")
def checkpoint_size(setup, ddp_run, tmp_path_factory):
    """The bytes on disk of a first checkpoint with these settings, once per engine (a save's
    mode does not change its size): DDP's is the shared 2-rank run's first (other settings
    change it by a few bytes, where the disk below holds 1.5 checkpoints); ZeRO's is measured
    by a run to that checkpoint."""
    root, config = setup
    sizes = {False: size_on_disk(ddp_run / "checkpoints" / "step_00000010")}

    def size(settings: list[str]) -> int:
        deepspeed = "distributed.backend=deepspeed" in settings
        if deepspeed not in sizes:
            probe = tmp_path_factory.mktemp("probe") / "run"
            cmd = procs.aiayn(config, probe, *settings, f"train.max_steps={EVERY}")
            procs.run(helpers.torchrun(2) + cmd)
            sizes[deepspeed] = size_on_disk(probe / "checkpoints" / f"step_{EVERY:08d}")
        return sizes[deepspeed]

    return size


@pytest.mark.parametrize(
    "name, options",
    [
        ("sync", ["checkpoint.async_save=false"]),
        ("async", ["checkpoint.async_save=true"]),
        # Every rank writes its ZeRO shards: whichever fails, DeepSpeed's own barrier included.
        ("zero2", ["distributed.backend=deepspeed", "distributed.zero_stage=2"]),
    ],
)
def test_both_ranks_agree_on_a_full_disk_and_stop_together(
    setup, tmp_path, checkpoint_size, name, options
):
    root, config = setup
    disk = tmp_path / "disk"
    settings = [
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=1",
        "checkpoint.max_failed_saves=2",
        "train.max_steps=20",
        "train.eval_every=0",
        f"distributed.timeout_minutes={TIMEOUT_MINUTES}",
        *options,
    ]
    # A disk of 1.5 checkpoints holds the first checkpoint and not the second.
    with small_disk(disk, 3 * checkpoint_size(settings) // 2048):
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(disk)
        cmd = helpers.torchrun(2) + procs.aiayn(config, run_dir, *settings)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=procs.ENV
        )
        try:
            _, err = proc.communicate(timeout=TIMEOUT_MINUTES * 60 - 30)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            pytest.fail("a rank waited for the others: the run outlived the collective timeout")
        assert proc.returncode != 0, err[-3000:]
        # Exit code 2 (an error a restart would repeat); torchrun ends the other rank with
        # SIGTERM when it has not exited by itself yet.
        codes = set(re.findall(r"exitcode\s+: (-?\d+)", err))
        assert "2" in codes and codes <= {"2", "-15"}, err[-3000:]
        stop = "aiayn train: error: 2 checkpoint saves in a row failed (steps 10, 15;"
        assert stop in err, err[-3000:]
        first = "checkpoint step 10 was not written: no space left on device"
        assert f"[rank 1] ERROR {first}" in err, err[-3000:]  # rank 1 learned it too
        # Every rank writes its share of a save (its byte ranges; ZeRO, its shards too): the
        # message names each rank whose write failed.
        assert re.search(r"on rank (0|1|0, 1)\. It needs about", err), err[-3000:]
        log = (run_dir / "train.log").read_text()
        # Both went on training after the first failure; an async write's failure is learned
        # at the next save, so that run stops one save later.
        last = 20 if name == "async" else 15
        assert f"train step {last} |" in log and f"train step {last + 1} |" not in log
        assert sorted(p.name for p in disk.iterdir()) == ["latest", f"step_{EVERY:08d}"]
