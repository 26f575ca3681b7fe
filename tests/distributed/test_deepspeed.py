"""DeepSpeed ZeRO with real processes on CPU (gloo), against the DDP reference run.

Tolerances, stated: with fp32 every ZeRO stage computes DDP's update up to float rounding.
The rounding differs (DeepSpeed sums the gradient norm for clipping over flat partitions, and
with offload runs its CPU Adam where the DDP engine runs torch's fused one), the first bits differ
after a few steps and 20 steps amplify them: the per-step training loss agrees to 1e-4
(relative; measured up to 5e-6) and the final weights to 5e-3 (measured up to 6e-4). bf16
autocasts the same operations in both and reduces in fp32 in both: its loss curve agrees to
1e-3 (measured 5e-5 over 8 steps; bf16's coarse rounding amplifies the first differing bits).
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import scalars, torchrun, weights_at  # tests/helpers.py
from procs import ENV, STEPS, accelerate_launch, aiayn, assert_close, run, train_runs

pytestmark = pytest.mark.distributed
DS = ("distributed.backend=deepspeed",)


def assert_same_curve(
    run_dir: Path, reference: Path, rtol: float, steps: int = STEPS, drop: float = 0.7
) -> None:
    got, ref = scalars(run_dir, "train/loss"), scalars(reference, "train/loss")
    assert sorted(got) == list(range(1, steps + 1)) == sorted(ref)
    worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
    assert worst <= rtol, f"loss curves differ by {worst:.3g} (relative) > {rtol}"
    assert ref[steps] < drop * ref[1]  # and the curve is one of learning


# bf16 sized for CPUs without native bf16, where it is emulated and several times slower than
# fp32: 8 steps of half-size batches, no validation, and no measured matmul peak (it only
# feeds MFU, and a bf16 one takes minutes where bf16 is emulated).
BF16 = (
    "train.precision=bf16",
    "train.max_steps=8",
    "train.max_tokens=300",
    "train.eval_every=0",
    "checkpoint.every_steps=8",
    "logging.peak_tflops=1",
)
# Plain ZeRO 0 to 3 compute DDP's update in test_step_collectives.py's launch (5 steps each, in
# one process group); plain ZeRO-3 follows the curve in test_accelerate_launch_use_deepspeed,
# launched by accelerate. Here the stages with options, over 20 steps, and the bf16 pair: one
# launch of 2 ranks, the runs one after another (train_runs.py).
RUNS = {
    "zero2_offload": (*DS, "distributed.zero_stage=2", "distributed.offload_optimizer=true"),
    "zero3_ckpt": (*DS, "distributed.zero_stage=3", "distributed.activation_checkpointing=true"),
    "ddp_bf16": BF16,
    "zero2_bf16": (*DS, "distributed.zero_stage=2", *BF16),
}


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, Path]:
    root, config = setup
    dirs = {name: root / name for name in RUNS}
    run(torchrun(2) + train_runs(config, {dirs[n]: RUNS[n] for n in RUNS}), timeout=900)
    return dirs


@pytest.mark.parametrize("name", ["zero2_offload", "zero3_ckpt"])
def test_zero_stage_follows_the_ddp_loss_curve(runs, ddp_run, name):
    run_dir = runs[name]
    stage = RUNS[name][1].split("=")[1]
    log = (run_dir / "train.log").read_text()
    assert f"DeepSpeed ZeRO-{stage} on 2 rank(s)" in log
    size = re.search(r"seq2seq model, [\d,]+ parameters", log).group()
    assert size in (ddp_run / "train.log").read_text()  # counted before ZeRO-3 partitions
    assert_same_curve(run_dir, ddp_run, rtol=1e-4)
    assert_close(weights_at(run_dir, STEPS), weights_at(ddp_run, STEPS), atol=5e-3)
    # The norm before clipping (clip_norm 1.0 clips these steps), as DDP reports it: stage 0
    # once reported nan, DeepSpeed computing none for a plain torch optimizer.
    norms, ref = scalars(run_dir, "train/grad_norm"), scalars(ddp_run, "train/grad_norm")
    assert sorted(norms) == sorted(ref)
    worst = max(abs(norms[s] - ref[s]) / ref[s] for s in ref)
    assert worst <= 1e-3, f"gradient norms differ from DDP's by {worst:.3g} (relative)"


def test_bf16_autocast_follows_ddp_bf16(runs):
    assert_same_curve(runs["zero2_bf16"], runs["ddp_bf16"], rtol=1e-3, steps=8, drop=0.9)


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_one_process_accumulating_two_equals_two_ranks(setup, ddp_run, launcher):
    """World size 1 (DeepSpeed gets a process group of its own) with train.grad_accum=2: the
    loop, not DeepSpeed, owns the accumulation boundary and the token normalisation. Started
    by torchrun too, whose agent store once left that group waiting, silent, for a store
    nobody served (distributed/env.py: join_single_process_group)."""
    root, config = setup
    run_dir = root / f"zero2_accum2_{launcher}"
    start = [sys.executable] if launcher == "python" else torchrun(1)
    options = (*DS, "distributed.zero_stage=2", "train.grad_accum=2")
    run(start + aiayn(config, run_dir, *options), timeout=300)
    assert_same_curve(run_dir, ddp_run, rtol=1e-4)
    assert_close(weights_at(run_dir, STEPS), weights_at(ddp_run, STEPS), atol=5e-3)


def test_deepspeed_builds_torch_fused_adam_for_cuda_and_reduces_bf16_runs_in_fp32():
    """From the config generated for CUDA, ZeRO-2 and bf16: torch's fused AdamW with the run's
    hyperparameters, not DeepSpeed's FusedAdam (compiled with nvcc at start, once); every
    gradient reduced in fp32, as DDP's are, not DeepSpeed's bf16 for nn.Linear weights."""
    script = str(Path(__file__).with_name("deepspeed_built.py"))
    out = run([sys.executable, script], timeout=300).splitlines()
    built = json.loads(next(line for line in out if line.startswith('{"optimizer"')))
    assert built["optimizer"] == "torch.optim.adamw.AdamW"
    assert built["defaults"] == {
        "betas": [0.9, 0.98],
        "eps": 1e-9,
        "weight_decay": 0.01,
        "fused": True,
    }
    assert built["reduce_dtypes"] == built["bucket_dtypes"] == ["torch.float32"]


def test_accelerate_launch_use_deepspeed(setup, ddp_run):
    """accelerate's --use_deepspeed/--zero_stage reach the run config (distributed/launcher.py),
    and ZeRO-3 follows the DDP loss curve (the stage missing from the test above)."""
    root, config = setup
    run_dir = root / "accelerate_zero3"
    out = run(accelerate_launch("--use_deepspeed", "--zero_stage", "3") + aiayn(config, run_dir))
    assert "from accelerate launch: distributed.backend=deepspeed distributed.zero_stage=3" in out
    assert "DeepSpeed ZeRO-3 on 2 rank(s)" in (run_dir / "train.log").read_text()
    assert_same_curve(run_dir, ddp_run, rtol=1e-4)


def test_a_dead_op_build_stops_the_launch_with_the_fix_instead_of_hanging(setup, tmp_path):
    """torch waits forever on a lock a killed op build left; the run says which file to delete."""
    root, config = setup
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    proc = subprocess.run(
        [sys.executable, *aiayn(config, root / "dead_build", *DS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**ENV, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
    )
    assert proc.returncode != 0
    assert f"rm {lock}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
