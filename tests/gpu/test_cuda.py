"""The trainer on a CUDA device: each engine learns, fp16's loss scaler acts, a killed run
resumes bit for bit. Skipped where torch sees no CUDA device (CI); on a GPU machine:
`pytest -m gpu -n 8 tests/gpu`.

200 steps of the distributed tests' model on their numbers corpus, bf16 unless the case says
otherwise. "Learns": the mean loss of the last 20 logged steps is under half that of the
first 20 (a run that does not learn stays near log(vocab))."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import scalars, torchrun, weights_at  # tests/helpers.py
from processes import kill_tree, logged, wait_until  # tests/processes.py
from procs import ENV, aiayn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device; on a GPU machine: pytest -m gpu tests/gpu (docs/gpu.md)",
    ),
]

STEPS = 200
ON_CUDA = (
    "train.device=cuda",
    f"train.max_steps={STEPS}",
    "train.eval_every=100",
    "checkpoint.every_steps=100",
    "logging.every_steps=1",
)
DS = ("distributed.backend=deepspeed",)
ONE = [sys.executable]  # one process, no launcher

CASES = {
    "one_process": (ONE, ["train.precision=bf16"]),
    "one_process_fp32": (ONE, ["train.precision=fp32"]),
    "one_process_compile": (ONE, ["train.precision=bf16", "train.compile=true"]),
    "torchrun_1": (None, ["train.precision=bf16"]),
    "zero1_bf16": (None, [*DS, "distributed.zero_stage=1", "train.precision=bf16"]),
    "zero2_bf16": (None, [*DS, "distributed.zero_stage=2", "train.precision=bf16"]),
    "zero3_bf16": (None, [*DS, "distributed.zero_stage=3", "train.precision=bf16"]),
    # Started at 2^24, fp16's first steps overflow for certain: the scaler must halve its
    # scale and skip those steps, and training go on.
    "zero2_fp16": (
        None,
        [*DS, "distributed.zero_stage=2", "train.precision=fp16", f"train.loss_scale_init={2**24}"],
    ),
    "zero3_offload": (
        None,
        [*DS, "distributed.zero_stage=3", "distributed.offload_optimizer=true"]
        + ["train.precision=bf16"],
    ),
}


def train(launcher: list[str] | None, config: Path, run_dir: Path, *options: str) -> str:
    """Run to the end, or fail with what the run said: a stall shows where it stopped."""
    cmd = (launcher or torchrun(1)) + aiayn(config, run_dir, *ON_CUDA, *options)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV)
    except subprocess.TimeoutExpired as exc:
        log = run_dir / "train.log"
        said = exc.stderr or ""
        said = (said.decode(errors="replace") if isinstance(said, bytes) else said)[-3000:]
        tail = log.read_text()[-2000:] if log.is_file() else "(no train.log)"
        pytest.fail(f"no end within {exc.timeout:.0f} s; train.log ends:\n{tail}\nstderr:\n{said}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.parametrize("name", list(CASES))
def test_engine_learns_on_cuda(setup, name):
    root, config = setup
    launcher, options = CASES[name]
    run_dir = root / name
    train(launcher, config, run_dir, *options)
    log = (run_dir / "train.log").read_text()
    assert " on cuda:0 |" in log, log[:2000]
    loss = scalars(run_dir, "train/loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    first, last = mean(loss[s] for s in range(1, 21)), mean(loss[s] for s in range(181, 201))
    print(f"{name}: mean loss, steps 1-20 {first:.3f}, steps 181-200 {last:.3f}")
    assert last < 0.5 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors").is_file()
    if name == "zero2_fp16":
        scale, skipped = (
            scalars(run_dir, "train/loss_scale"),
            scalars(run_dir, "train/skipped_steps"),
        )
        print(f"loss scale {scale[1]:g} -> {scale[STEPS]:g}; {skipped[STEPS]:g} steps skipped")
        # Dynamic loss scaling: it halves on overflow, skipping that step.
        assert skipped[STEPS] >= 1 and scale[STEPS] < 2.0**24


def test_two_ranks_on_one_gpu_are_refused_with_the_fix(setup):
    """NCCL refuses two ranks of one communicator on the same GPU; the run says so first, with
    what to change, rather than failing inside NCCL's set-up."""
    if torch.cuda.device_count() > 1:
        pytest.skip("this machine has a GPU for each rank")
    root, config = setup
    cmd = torchrun(2) + aiayn(config, root / "two_on_one", *ON_CUDA)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "LOCAL_RANK=1 but this process sees 1 CUDA device(s)" in out, out[-3000:]


def test_killed_run_resumes_bitwise_on_cuda(setup):
    """train.deterministic=true, dropout on, asynchronous saves: SIGKILL at a random step, the
    same command again; the final weights equal an uninterrupted run's bit for bit."""
    root, config = setup
    options = (
        "train.precision=bf16",
        "train.deterministic=true",
        "model.dropout=0.1",
        "checkpoint.every_steps=20",
        "checkpoint.async_save=true",  # the copies run beside the next step (staging.py)
        "train.eval_every=0",
    )
    straight, killed = root / "straight", root / "killed"
    train(ONE, config, straight, *options)
    kill_at = random.Random(os.getpid()).randrange(25, 175)
    print(f"SIGKILL after step {kill_at}")
    cmd = ONE + aiayn(config, killed, *ON_CUDA, *options)
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        wait_until(job, logged(killed / "train.log", f"train step {kill_at} |"), 600, "the step")
    finally:
        kill_tree(job)
    assert not (killed / "checkpoints" / f"step_{STEPS:08d}").exists()
    train(ONE, config, killed, *options)
    assert "resuming from" in (killed / "train.log").read_text()
    a, b = weights_at(killed, STEPS), weights_at(straight, STEPS)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ after the resume: {differ[:5]}"
