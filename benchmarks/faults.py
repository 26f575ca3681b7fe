"""Faults a long run survives by itself: each tried several times at a random step, on 2 ranks
(gloo) under `python -m aiayn.distributed.run --max-restarts=2`, and compared with the same run
uninterrupted.

    python benchmarks/faults.py                      # every fault, 3 times each
    python benchmarks/faults.py --faults ddp-sigkill zero2-raise --repeats 5

A fault is injected by tests/distributed/faulty.py on rank 1 as it begins step S, on the
group's first start only. For each try the table counts it as survived when the job ended by
itself (exit 0; a preemption: exit 75, then the same command again, as a scheduler's requeue
would) with final weights and Adam moments bitwise equal to the uninterrupted run's. Steps lost
are the steps done before the fault that the restart had to redo (S - 1 minus the step of the
checkpoint it resumed from: below checkpoint.every_steps). Time to resume is from the fault to
the end of the first step after it (rank 0's start-up line in train.log, aiayn/runtime/startup.py);
for a preemption, from the requeued job's start.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _common import machine, markdown_table
from resume_time import ROOT, STARTUP_LINE, Log, end, environment
from safetensors.torch import load_file

from aiayn.checkpoint import read_trainer_state

FAULTY = ROOT / "tests" / "distributed" / "faulty.py"
STEPS, EVERY = 30, 5
OPTIONS = (
    f"train.max_steps={STEPS}",
    f"checkpoint.every_steps={EVERY}",
    "train.eval_every=0",
    "train.max_tokens=512",
    "logging.every_steps=1",
)
ZERO2 = ("distributed.backend=deepspeed", "distributed.zero_stage=2")
RESUMED = re.compile(r"resuming from .*step_(\d+)")
INJECTED = re.compile(r"faulty\.py: \w+ on rank \d+ at step (\d+)")


@dataclass
class Fault:
    what: str
    kind: str  # faulty.py's KIND
    overrides: tuple[str, ...] = ()
    launcher_options: tuple[str, ...] = ()
    nodes: int = 1  # launchers of 2 / nodes processes each, meeting by c10d rendezvous
    requeue: bool = False  # the job exits 75; the same command again finishes it


FAULTS = {
    "ddp-sigkill": Fault("DDP, one rank SIGKILLed", "sigkill"),
    "ddp-raise": Fault("DDP, an exception on one rank", "raise"),
    "ddp-oom": Fault("DDP, out of memory on one rank", "oom"),
    "ddp-sigstop": Fault(
        "DDP, one rank SIGSTOPped (timeout 6 s)", "sigstop", ("distributed.timeout_minutes=0.1",)
    ),
    "zero2-sigkill": Fault("ZeRO-2, one rank SIGKILLed", "sigkill", ZERO2),
    "zero2-raise": Fault("ZeRO-2, an exception on one rank", "raise", ZERO2),
    "two-nodes-sigkill": Fault("2 nodes x 1 rank, one SIGKILLed", "sigkill", nodes=2),
    "preempted": Fault("DDP, preempted (USR1): exit 75, requeued", "sigusr1", requeue=True),
}


def base_overrides(root: Path, run_dir: Path) -> list[str]:
    corpus = root / "numbers"
    return [
        f"run_dir={run_dir}",
        f"data.train={corpus}/train",
        f"data.valid={corpus}/valid",
        f"data.test={corpus}/test",
        f"tokenizer.path={root}/spm.model",
        *OPTIONS,
    ]


def prepare(root: Path) -> None:
    """The numbers corpus and its tokenizer, made once so no run races to train it."""
    root.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "aiayn"]
    env = environment(1)
    if not (root / "numbers").is_dir():
        subprocess.run([*py, "demo-data", "numbers", "--out", str(root / "numbers")], env=env)
    if not (root / "spm.model").is_file():
        cmd = [*py, "tokenizer", "train", "--config", "configs/demo.yaml"]
        overrides = base_overrides(root, root / "unused")
        subprocess.run(cmd + overrides, env=env, cwd=ROOT, check=True, capture_output=True)


def launcher(fault: Fault, node: int, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "aiayn.distributed.run", "--max-restarts=2"]
    if fault.nodes == 1:
        cmd += ["--standalone", "--nproc-per-node=2"]
    else:
        cmd += [
            f"--nnodes={fault.nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={2 // fault.nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=faults-{port}",
        ]
    return cmd + list(fault.launcher_options)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    state = dict(load_file(ckpt / "model.safetensors"))
    trainer = read_trainer_state(ckpt)
    for key, slot in trainer["engine"].get("optimizer", {}).get("state", {}).items():
        state |= {f"adam/{key}/{name}": v for name, v in slot.items() if v.dim()}
    return state


def uninterrupted(root: Path, fault: Fault) -> Path:
    run_dir = root / ("reference-zero2" if ZERO2[0] in fault.overrides else "reference-ddp")
    if not (run_dir / "checkpoints" / f"step_{STEPS:08d}").is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        cmd += ["-m", "aiayn", "train", "--config", "configs/demo.yaml"]
        cmd += base_overrides(root, run_dir) + [o for o in fault.overrides if o in ZERO2]
        subprocess.run(cmd, env=environment(2), cwd=ROOT, check=True, capture_output=True)
    return run_dir


def attempt(root: Path, fault: Fault, step: int) -> dict:
    """One try: the job with the fault at `step`, watched for its restart."""
    run_dir = root / "try"
    shutil.rmtree(run_dir, ignore_errors=True)
    train = ["train", "--config", "configs/demo.yaml", *base_overrides(root, run_dir)]
    train += list(fault.overrides)
    port = 20000 + random.randrange(20000)
    out_path = root / "try.out"
    log = Log(run_dir / "train.log")
    with open(out_path, "w") as out:
        jobs = [
            subprocess.Popen(
                launcher(fault, node, port) + [str(FAULTY), fault.kind, "1", str(step), *train],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment(2),
                cwd=ROOT,
            )
            for node in range(fault.nodes)
        ]
        fault_at = resumed_at = None
        deadline = time.monotonic() + 600
        try:
            while any(job.poll() is None for job in jobs) and time.monotonic() < deadline:
                if fault_at is None and INJECTED.search(out_path.read_text()):
                    fault_at = time.time()
                elif fault_at is not None and resumed_at is None:
                    if len(STARTUP_LINE.findall(log.grow())) >= 2:  # the restart's first step
                        resumed_at = time.time()
                time.sleep(0.01)
        finally:
            for job in jobs:
                end(job)
    codes = [job.returncode for job in jobs]
    if fault.requeue and codes == [75] * fault.nodes:  # the scheduler's requeue
        again = launcher(fault, 0, port + 1) + ["-m", "aiayn", *train]
        requeued = time.time()
        done = subprocess.run(again, env=environment(2), cwd=ROOT, capture_output=True)
        codes = [done.returncode]
        startups = STARTUP_LINE.findall(log.grow())
        resumed_at = requeued + float(startups[-1][0]) if len(startups) >= 2 else None
    text = log.grow()
    resumed = [int(m) for m in RESUMED.findall(text)]
    return {
        "ok": codes == [0] * len(codes),
        # A preemption saves the step it stopped after: nothing to redo.
        "lost": max((step - 1) - resumed[0], 0) if resumed else step - 1,
        "resume_s": resumed_at - fault_at if resumed_at and fault_at else None,
        "run_dir": run_dir,
        "codes": codes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", nargs="+", choices=sorted(FAULTS), default=list(FAULTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="fault steps (default: random)")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "bench" / "faults")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(machine())
    prepare(args.root)
    rows = []
    for name in args.faults:
        fault = FAULTS[name]
        reference = final_state(uninterrupted(args.root, fault))
        results = []
        for _ in range(args.repeats):
            step = rng.randint(2, STEPS - 1)
            got = attempt(args.root, fault, step)
            if got["ok"]:
                state = final_state(got["run_dir"])
                got["ok"] = state.keys() == reference.keys() and all(
                    torch.equal(state[k], reference[k]) for k in state
                )
            results.append(got)
            print(f"{name}: step {step}, exit {got['codes']}, bitwise {got['ok']}, ", end="")
            print(f"lost {got['lost']}, resume {got['resume_s']}", flush=True)
        times = [r["resume_s"] for r in results if r["resume_s"] is not None]
        rows.append(
            [
                fault.what,
                str(len(results)),
                str(sum(r["ok"] for r in results)),
                f"{max(r['lost'] for r in results)} (every {EVERY})",
                f"{statistics.median(times):.1f} ({min(times):.1f}-{max(times):.1f})"
                if times
                else "-",
            ]
        )
    header = ["fault", "tries", "bitwise-equal", "steps lost, most", "time to resume s (range)"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
