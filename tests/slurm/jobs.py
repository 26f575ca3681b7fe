"""What the Slurm tests share: the demo run as a batch job, and what to check in it."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import torch

from helpers import weights_at  # tests/helpers.py

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "slurm" / "train.sbatch"
DEMO = ROOT / "configs" / "demo.yaml"
STEPS = 60  # the demo model learns within them (tests/slurm/test_sbatch.py)


def demo_overrides(corpus, run_dir: Path) -> list[str]:
    """configs/demo.yaml, cut to a short run on a smaller corpus."""
    _, data, tokenizer = corpus
    return [
        f"run_dir={run_dir}",
        f"tokenizer.path={tokenizer}",
        f"data.train={data}/train",
        f"data.valid={data}/valid",
        f"data.test={data}/test",
        f"train.max_steps={STEPS}",
        "train.max_tokens=1024",
        "train.eval_bleu=0",
        "logging.every_steps=5",
    ]


def job_env(prefix: list[str] = ()) -> dict[str, str]:
    """The job runs this interpreter and this checkout (sbatch passes the environment on);
    through `prefix` (PYTHON of several words, as a container runtime's) when given."""
    return {
        **os.environ,
        "PYTHON": " ".join([*prefix, sys.executable]),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def wrapper(directory: Path) -> Path:
    """A stand-in for a container runtime (`apptainer exec IMAGE`): it notes on which node it
    ran what, in wrapped.log beside it, then execs its arguments."""
    script = directory / "wrap.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "${{SLURMD_NODENAME:-?}} $*" >> "{directory / "wrapped.log"}"\n'
        'exec "$@"\n'
    )
    script.chmod(0o755)
    return script


def sbatch_args(corpus, run_dir: Path, out: Path) -> list[str]:
    """2 nodes x 1 process, one CPU each: OMP_NUM_THREADS=1 in every run, so runs compare
    bitwise (a matmul over another number of threads sums in another order)."""
    return ["-N2", "--cpus-per-task=1", f"--chdir={ROOT}", f"--output={out}",
            str(SBATCH), str(DEMO), *demo_overrides(corpus, run_dir)]  # fmt: skip


def submit(slurm, corpus, run_dir: Path, prefix: list[str] = ()) -> tuple[int, Path]:
    out = run_dir.parent / f"{run_dir.name}.slurm.out"
    return slurm.sbatch(sbatch_args(corpus, run_dir, out), env=job_env(prefix)), out


def losses(run_dir: Path) -> dict[int, float]:
    text = (run_dir / "train.log").read_text()
    return {int(s): float(v) for s, v in re.findall(r"train step (\d+) \| loss ([\d.]+)", text)}


def describe(job: dict, out: Path, run_dir: Path) -> str:
    """What to read when a job did not do what was expected."""
    log = run_dir / "train.log"
    return (
        f"job: {job}\n--- {out}:\n{out.read_text()[-4000:] if out.is_file() else '(none)'}\n"
        f"--- train.log:\n{log.read_text()[-3000:] if log.is_file() else '(none)'}"
    )


def wait_for_step(slurm, job_id: int, out: Path, run_dir: Path, step: int) -> None:
    log = run_dir / "train.log"
    deadline = time.monotonic() + 180
    while not (log.is_file() and f"train step {step} |" in log.read_text()):
        assert time.monotonic() < deadline, describe(slurm.job(job_id), out, run_dir)
        time.sleep(0.2)


def signal_at_step_20(slurm, job_id: int, out: Path, run_dir: Path) -> None:
    """What Slurm sends before the time limit with --signal=B:USR1@N, sent at step 20."""
    wait_for_step(slurm, job_id, out, run_dir, 20)
    slurm.run(["scancel", "--batch", "--signal=USR1", str(job_id)])


def kill_rank(job_id: int, rank: int) -> str:
    """SIGKILL the training process of `rank` in the job (a worker torchrun started: it has
    RANK in its environment, the launcher has not); returns its node."""
    for d in Path("/proc").iterdir():
        try:
            env = dict(
                kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv
            )
        except (OSError, ValueError):
            continue
        if env.get("SLURM_JOB_ID") == str(job_id) and env.get("RANK") == str(rank):
            if "TORCHELASTIC_RUN_ID" in env:
                os.kill(int(d.name), signal.SIGKILL)
                return env["SLURMD_NODENAME"]
    raise AssertionError(f"no process of rank {rank} in job {job_id}")


def stopped_at(run_dir: Path) -> list[int]:
    text = (run_dir / "train.log").read_text()
    return [int(s) for s in re.findall(r"stop requested: saved step (\d+)", text)]


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    a, b = weights_at(run_dir, STEPS), weights_at(reference, STEPS)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ from the uninterrupted run"
