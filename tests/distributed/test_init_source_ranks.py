"""init.source with every engine (real processes, gloo): the source's weights are loaded
before the engine wraps the model, so two DDP ranks and two ZeRO-3 ranks starting from one
trained run take the same first step as one process accumulating their two micro-batches."""

import json
import sys

import pytest

from procs import aiayn, run, scalars, torchrun

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

    first = {name: scalars(d)[1] for name, d in (("one", one), ("ddp", ddp), ("zero3", zero3))}
    assert first["ddp"] == pytest.approx(first["one"], rel=1e-5), first
    assert first["zero3"] == pytest.approx(first["one"], rel=1e-4), first
    # The source's weights, not a new model's: well below the first step of the source run.
    assert first["one"] < 0.9 * scalars(ddp_run)[1], (first, scalars(ddp_run)[1])
    for run_dir in (one, ddp, zero3):
        manifest = json.loads(
            (run_dir / "checkpoints" / "step_00000001" / "manifest.json").read_text()
        )
        assert manifest["init"]["step"] == 20 and manifest["step"] == 1
