"""A run stopped by train.max_epochs, resumed with a larger max_epochs, trains on exactly the
batches of a run that was given the larger limit from the start."""

import json

import torch
from safetensors.torch import load_file

from aiayn.checkpoint import CheckpointManager
from aiayn.config import load_config
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file


def config(run_dir, corpus, epochs: int):
    return load_config(
        None,
        tiny.overrides(
            run_dir,
            corpus,
            "model.dropout=0.1",
            "train.max_steps=100000",
            f"train.max_epochs={epochs}",
            "checkpoint.every_steps=1000",
            "logging.record_ids=true",
            "logging.peak_tflops=0.1",  # no matmul benchmark at each start
            "train.threads=1",
            # Two micro-batches a step: the refused step holds the end of one epoch (33 batches
            # here) and the start of the next, and both must be given back.
            "train.grad_accum=2",
        ),
    )


def consumed(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "consumed" / "rank_0.jsonl")]


def test_resuming_with_more_epochs_loses_no_batch(tmp_path, numbers):
    train(config(tmp_path / "straight", numbers, epochs=2))
    train(config(tmp_path / "stopped", numbers, epochs=1))
    first = consumed(tmp_path / "stopped")
    assert {row["epoch"] for row in first} == {0}
    train(config(tmp_path / "stopped", numbers, epochs=2))
    # The batches of the step the first run refused are trained by the resumed run, like by
    # the run that never stopped.
    assert consumed(tmp_path / "stopped") == consumed(tmp_path / "straight")
    ckpts = [CheckpointManager(tmp_path / r, 1, 1, False).latest() for r in ("straight", "stopped")]
    assert ckpts[0].name == ckpts[1].name
    a, b = (load_file(c / "model.safetensors") for c in ckpts)
    assert all(torch.equal(a[k], b[k]) for k in a)
