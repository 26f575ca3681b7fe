"""A checkpoint save on a real full disk (a size-limited tmpfs under run_dir/checkpoints): the
save fails naming the space it needs, nothing is lost, training goes on until
checkpoint.max_failed_saves saves in a row failed, and once space is freed the same command
resumes from the latest checkpoint and finishes."""

import subprocess
import sys

import pytest
from small_disk import reported_sizes, resize, small_disk, used_kib  # tests/small_disk.py

from aiayn.checkpoint.failures import size_on_disk
from aiayn.checkpoint.inference import load_for_inference
from aiayn.config import load_config
from aiayn.errors import CheckpointError
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file

STEPS = 30
EVERY = 5


def overrides(run_dir, corpus, *extra):
    return tiny.overrides(
        run_dir,
        corpus,
        "logging.every_steps=1",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=1",
        "train.threads=1",
        *extra,
    )


def steps_trained(run_dir) -> int:
    lines = [line for line in (run_dir / "train.log").read_text().splitlines()]
    return max(
        int(line.split("train step ")[1].split()[0]) for line in lines if "train step " in line
    )


@pytest.fixture
def nearly_full(tmp_path, numbers):
    """(run_dir, disk, first, size): a run whose checkpoints live on a tmpfs that holds its
    step-5 checkpoint `first` (of `size` bytes) and half as much again, so the next fails."""
    run_dir, disk = tmp_path / "run", tmp_path / "disk"
    with small_disk(disk, 64 * 1024):
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(disk)
        train(load_config(None, overrides(run_dir, numbers, f"train.max_steps={EVERY}")))
        first = disk / f"step_{EVERY:08d}"
        size = size_on_disk(first)
        assert size > 100 * 1024, size  # weights and Adam state of the tiny model
        resize(disk, used_kib(disk) + size // 2048)
        yield run_dir, disk, first, size


def assert_nothing_lost(disk, first, size, text):
    """The partial directory is gone, `latest` names `first`, which loads, and `text` states
    the space needed (the previous checkpoint's size) and the space free."""
    assert sorted(p.name for p in disk.iterdir()) == ["latest", first.name]
    assert (disk / "latest").read_text().strip() == first.name
    cfg, model, _, path = load_for_inference(disk.parent / "run", device="cpu")
    assert path.name == first.name and sum(p.numel() for p in model.parameters()) > 10_000
    needed, free = reported_sizes(text)
    assert abs(needed - size) <= 0.01 * size, (needed, size)
    assert free < needed
    assert abs(free - size / 2) <= 0.1 * size, (free, size)  # what the fixture left free


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_keeps_the_last_checkpoint_goes_on_then_stops_and_resumes(
    nearly_full, numbers, async_save
):
    run_dir, disk, first, size = nearly_full
    again = overrides(
        run_dir,
        numbers,
        f"train.max_steps={STEPS}",
        "checkpoint.max_failed_saves=2",
        f"checkpoint.async_save={str(async_save).lower()}",
    )
    with pytest.raises(CheckpointError) as raised:
        train(load_config(None, again))
    text = str(raised.value)
    assert "2 checkpoint saves in a row failed (steps 10, 15;" in text, text
    assert "checkpoint step 15 was not written: no space left on device" in text
    assert f"The previous checkpoint {first.name} is intact and is `latest`" in text
    log = (run_dir / "train.log").read_text()
    assert "checkpoint step 10 was not written: no space left on device" in log
    assert "(1 of checkpoint.max_failed_saves=2 failed in a row)" in log
    # The error that stopped the run is in its log too, without a traceback (the user's to fix).
    assert f"ERROR training stopped: {text.splitlines()[0]}" in log
    assert "Traceback" not in log
    # Training went on past the first failure; an async write's failure is learned at the
    # next save, so that run stops one save later.
    assert steps_trained(run_dir) == (20 if async_save else 15)
    assert_nothing_lost(disk, first, size, text)

    resize(disk, used_kib(disk) + 4 * size // 1024)  # space is freed
    train(load_config(None, again))
    log = (run_dir / "train.log").read_text()[len(log) :]
    assert f"resumed from {run_dir / 'checkpoints' / first.name} (step {EVERY})" in log
    assert "was not written" not in log
    assert (disk / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert not [p for p in disk.iterdir() if p.name.startswith(".tmp-")]


def test_a_failed_last_save_is_not_reported_as_success(nearly_full, numbers):
    """The end of training waits for the (async) last save: when it failed, the command exits
    with code 2, which a launcher does not restart, instead of 0."""
    run_dir, disk, first, size = nearly_full
    config = run_dir.parent / "empty.yaml"
    config.write_text("")
    end = 2 * EVERY
    last = overrides(run_dir, numbers, f"train.max_steps={end}", "checkpoint.async_save=true")
    cmd = [sys.executable, "-m", "aiayn", "train", "--config", str(config), *last]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"checkpoint step {end} was not written: no space left on device" in proc.stderr
    assert "This was the run's last save" in proc.stderr
    assert steps_trained(run_dir) == end
    assert_nothing_lost(disk, first, size, proc.stderr)
