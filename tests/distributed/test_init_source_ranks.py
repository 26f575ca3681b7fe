"""init.source with every engine (real processes, gloo): the source's weights are loaded
before the engine wraps the model, so two DDP ranks and two ZeRO-3 ranks starting from one
trained run take the same first step as one process accumulating their two micro-batches."""

import json
import sys

import pytest

from helpers import scalars, torchrun, weights_at  # tests/helpers.py
from procs import assert_close, run, train_runs

pytestmark = pytest.mark.distributed
TUNE = ("train.max_steps=1", "train.eval_every=0")
ZERO3 = ("distributed.backend=deepspeed", "distributed.zero_stage=3")


@pytest.fixture(scope="module")
def tuned(setup, ddp_run) -> dict:
    """One step from the 20-step 2-rank DDP run, four ways, in two launches (train_runs.py):
    one process accumulating 2 micro-batches with fresh Adam moments ("one") and with the
    source's ("keep_one"), then 2 DDP ranks with fresh moments and 2 ZeRO-3 ranks with the
    source's."""
    root, config = setup
    source = (f"init.source={ddp_run}", *TUNE)
    keep = "init.optimizer=keep"
    runs = {name: root / f"init_{name}" for name in ("one", "keep_one", "ddp", "keep_zero3")}
    one = (*source, "train.grad_accum=2")
    run([sys.executable] + train_runs(config, {runs["one"]: one, runs["keep_one"]: (*one, keep)}))
    two = {runs["ddp"]: source, runs["keep_zero3"]: (*source, keep, *ZERO3)}
    run(torchrun(2) + train_runs(config, two), timeout=900)
    return runs


def test_ddp_and_zero3_ranks_start_from_the_source_as_one_process_does(tuned, ddp_run):
    """The first loss comes before any update: the source's weights, whatever the moments."""
    first = {name: scalars(d, "train/loss")[1] for name, d in tuned.items()}
    assert first["ddp"] == pytest.approx(first["one"], rel=1e-5), first
    assert first["keep_zero3"] == pytest.approx(first["one"], rel=1e-4), first
    assert first["keep_one"] == first["one"], first
    # The source's weights, not a new model's: well below the first step of the source run.
    assert first["one"] < 0.9 * scalars(ddp_run, "train/loss")[1], (
        first,
        scalars(ddp_run, "train/loss")[1],
    )
    for run_dir in tuned.values():
        manifest = json.loads(
            (run_dir / "checkpoints" / "step_00000001" / "manifest.json").read_text()
        )
        assert manifest["init"]["step"] == 20 and manifest["step"] == 1


def test_zero3_ranks_keep_the_sources_moments_as_one_process_does(tuned):
    """init.optimizer=keep under ZeRO-3: each rank reads its partition of the source's Adam
    state by parameter name (as a resume on another topology does), so its first update is
    one process's; with fresh moments the update is another."""
    kept = weights_at(tuned["keep_one"], 1)
    assert_close(weights_at(tuned["keep_zero3"], 1), kept, atol=1e-5)
    with pytest.raises(AssertionError):
        assert_close(weights_at(tuned["one"], 1), kept, atol=1e-5)
