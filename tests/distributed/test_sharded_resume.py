"""A whole sharded job killed (SIGKILL to every process) while its ranks write a checkpoint,
then started again with the same command: it ends bitwise where an uninterrupted run ends."""

import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import scalars, torchrun, weights_at  # tests/helpers.py
from processes import kill_tree, wait_until  # tests/processes.py
from procs import ENV, aiayn, assert_close, run

pytestmark = pytest.mark.distributed
FAULTY = str(Path(__file__).with_name("faulty.py"))
ENGINES = {
    "zero3": ("distributed.backend=deepspeed", "distributed.zero_stage=3"),
    "fsdp": ("distributed.backend=fsdp",),
}


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def saves_in_progress(run_dir: Path) -> set[str]:
    root = run_dir / "checkpoints"
    return {p.name for p in root.glob(".tmp-*")} if root.is_dir() else set()


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_a_killed_sharded_run_resumes_bitwise(setup, engine):
    """SIGKILL to the whole job while every rank writes its shards of its second checkpoint;
    re-run: it resumes from the first, and the final weights equal an uninterrupted run's bit
    for bit, dropout on (each rank's RNG stream is checkpointed). ZeRO-3 and FSDP2, whose saves
    gather the weights one tensor at a time and write every rank's partition; FSDP2's rank
    files (its rows of the weights and of Adam's moments) end bitwise too. Kills between saves,
    and several resumes in one job, are test_restarts.py's (ZeRO-2 and DDP, bitwise to the
    end) and tests/e2e/test_kill_resume.py's; a resume reads the last complete checkpoint
    whichever moment the kill landed.

    Both keep the moving average of the weights (train.ema), each rank its partition's, which
    ends bitwise equal too; the killed run validates that average (train.ema_validate, at its
    last step, before its last save), the uninterrupted one the weights: swapping the EMA in
    and the weights back must leave training as it was, bit for bit."""
    root, config = setup
    steps = 20
    common = (
        *ENGINES[engine],
        "model.dropout=0.1",
        "checkpoint.every_steps=5",
        "train.eval_every=0",
        f"train.max_steps={steps}",
        "train.ema=0.9",
    )
    options = (*common, "train.ema_validate=true")
    straight, killed = root / f"straight_{engine}", root / f"killed_{engine}"
    run(torchrun(2) + aiayn(config, straight, *common))
    # Rank 1 stops inside the save of step 10, its part written (faulty.py's hold-save), and
    # the whole job is killed there: a kill that lands inside a save, every time.
    log, held = killed / "train.log", killed / "injected.jsonl"
    job = start(
        torchrun(2) + [FAULTY, "hold-save", "1", "10"] + aiayn(config, killed, *options)[2:]
    )
    try:
        wait_until(job, held.exists, 300, "the held save")
    finally:
        kill_tree(job)
    assert len(saves_in_progress(killed)) == 1, saves_in_progress(killed)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    run(torchrun(2) + aiayn(config, killed, *options))
    first = killed / "checkpoints" / "step_00000005"
    assert f"resumed from {first} (step 5)" in log.read_text()
    assert_close(weights_at(killed, steps), weights_at(straight, steps), atol=0.0)
    ema = [load_file(run_dir / "checkpoints" / f"step_{steps:08d}" / "ema.safetensors")
           for run_dir in (killed, straight)]  # fmt: skip
    assert_close(*ema, atol=0.0)
    assert ema[0].keys() == weights_at(killed, steps).keys()
    if engine == "fsdp":
        for rank in (0, 1):
            name = f"checkpoints/step_{steps:08d}/fsdp/rank_{rank:05d}.safetensors"
            assert_close(*(load_file(run_dir / name) for run_dir in (killed, straight)), atol=0.0)
    # the killed run validated the EMA, the other the weights: another loss at the last step
    ema_loss, raw_loss = (scalars(r, "valid/loss")[steps] for r in (killed, straight))
    assert ema_loss != raw_loss, (ema_loss, raw_loss)
