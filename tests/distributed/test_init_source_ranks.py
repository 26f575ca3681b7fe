"""init.source with every engine (real processes, gloo): the source's weights are loaded
before the engine wraps the model, so two DDP ranks and two ZeRO-3 ranks starting from one
trained run take the same first step as one process accumulating their two micro-batches."""

import json
import sys

import pytest

from helpers import scalars, torchrun, weights_at  # tests/helpers.py
from procs import aiayn, assert_close, run

pytestmark = pytest.mark.distributed
TUNE = ("train.max_steps=1", "train.eval_every=0")


def test_ddp_and_zero3_ranks_start_from_the_source_as_one_process_does(setup, ddp_run):
    root, config = setup
    source = f"init.source={ddp_run}"  # 20 steps of 2 DDP ranks
    one, ddp, zero3 = root / "init_one", root / "init_ddp", root / "init_zero3"
    run([sys.executable] + aiayn(config, one, source, *TUNE, "train.grad_accum=2"))
    run(torchrun(2) + aiayn(config, ddp, source, *TUNE))
    zero = ("distributed.backend=deepspeed", "distributed.zero_stage=3")
    run(torchrun(2) + aiayn(config, zero3, source, *TUNE, *zero), timeout=900)

    first = {
        name: scalars(d, "train/loss")[1]
        for name, d in (("one", one), ("ddp", ddp), ("zero3", zero3))
    }
    assert first["ddp"] == pytest.approx(first["one"], rel=1e-5), first
    assert first["zero3"] == pytest.approx(first["one"], rel=1e-4), first
    # The source's weights, not a new model's: well below the first step of the source run.
    assert first["one"] < 0.9 * scalars(ddp_run, "train/loss")[1], (
        first,
        scalars(ddp_run, "train/loss")[1],
    )
    for run_dir in (one, ddp, zero3):
        manifest = json.loads(
            (run_dir / "checkpoints" / "step_00000001" / "manifest.json").read_text()
        )
        assert manifest["init"]["step"] == 20 and manifest["step"] == 1


def test_zero3_ranks_keep_the_sources_moments_as_one_process_does(setup, ddp_run):
    """init.optimizer=keep under ZeRO-3: each rank reads its partition of the source's Adam
    state by parameter name (as a resume on another topology does), so its first update is
    one process's; with fresh moments the update is another."""
    root, config = setup
    keep = (f"init.source={ddp_run}", *TUNE, "init.optimizer=keep")
    one, zero3, reset = root / "keep_one", root / "keep_zero3", root / "reset_one"
    run([sys.executable] + aiayn(config, one, *keep, "train.grad_accum=2"))
    zero = ("distributed.backend=deepspeed", "distributed.zero_stage=3")
    run(torchrun(2) + aiayn(config, zero3, *keep, *zero), timeout=900)
    run([sys.executable] + aiayn(config, reset, *keep[:-1], "train.grad_accum=2"))
    kept = weights_at(one, 1)
    assert_close(weights_at(zero3, 1), kept, atol=1e-5)
    with pytest.raises(AssertionError):
        assert_close(weights_at(reset, 1), kept, atol=1e-5)
