"""Time to resume: from a worker's SIGKILL to the end of the first training step after it.

Each case trains under the launcher with one restart allowed (`--max-restarts=1`), saves a
checkpoint, trains on, and at a moment T one training worker gets SIGKILL. The launcher
restarts the group, which resumes from the latest checkpoint; the figure is T to the moment
rank 0's start-up line (aiayn/runtime/startup.py), written when its first step after the restart
ends, appears in train.log. The line's split is shown beside it, with "restart" the rest:
the launcher noticing the death, stopping the other ranks and starting new processes.

    python benchmarks/resume_time.py                 # demo (1 rank), transformer_base (1, 2 ranks)
    python benchmarks/resume_time.py --cases base1 --repeats 3

All on the generated numbers corpus (`aiayn demo-data numbers`), with configs/demo.yaml;
transformer_base at a few hundred tokens per step, so that a step takes about a second.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from _common import machine, markdown_table

ROOT = Path(__file__).resolve().parents[1]
SPLIT = (
    "process start",
    "imports",
    "process group",
    "tokenizer/data",
    "model build",
    "checkpoint verify",
    "checkpoint load",
    "memory probe",
    "data position",
    "first step",
    "other",
)
STARTUP_LINE = re.compile(r"start-up ([\d.]+) s: (.*)")
PARAMS_LINE = re.compile(r"model, ([\d,]+) parameters")


@dataclass
class Case:
    name: str
    ranks: int
    overrides: tuple[str, ...]
    save_every: int


CASES = {
    "demo": Case("demo (tiny)", 1, (), save_every=5),
    "base1": Case(
        "transformer_base", 1, ("model.preset=transformer_base", "train.max_tokens=256"), 2
    ),
    "base2": Case(
        "transformer_base", 2, ("model.preset=transformer_base", "train.max_tokens=256"), 2
    ),
}


def launcher(nproc: int) -> list[str]:
    """The launcher command, restarting a failed group once: aiayn's (docs/distributed.md)."""
    return [
        sys.executable,
        "-m",
        "aiayn.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max-restarts=1",
    ]


def train_command(case: Case, run_dir: Path, corpus: Path) -> list[str]:
    return launcher(case.ranks) + [
        "-m",
        "aiayn",
        "train",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        f"run_dir={run_dir}",
        f"data.train={corpus}/train",
        "data.valid=",  # no validation: it would sit between the resume and its first step
        f"data.test={corpus}/test",
        "train.max_steps=100000",
        "train.eval_every=0",
        "logging.every_steps=1",
        f"checkpoint.every_steps={case.save_every}",
        *case.overrides,
    ]


def environment(ranks: int) -> dict[str, str]:
    threads = max(1, (os.cpu_count() or 1) // ranks)
    src = str(ROOT / "src")
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}


class Log:
    """train.log, read as it grows."""

    def __init__(self, path: Path):
        self.path, self.text = path, ""

    def grow(self) -> str:
        if self.path.is_file():
            with open(self.path) as fh:
                fh.seek(len(self.text.encode()))
                self.text += fh.read()
        return self.text


def wait_for(proc: subprocess.Popen, found, what: str, timeout: float, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (result := found()):
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:.0f} s")
        time.sleep(interval)
    return result


def worker(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The launcher's child that runs `rank`."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except psutil.Error:
            continue
    raise RuntimeError(f"no worker of rank {rank} under the launcher")


def end(proc: subprocess.Popen) -> None:
    """SIGKILL to the launcher and every process under it."""
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def measure(case: Case, run_dir: Path, corpus: Path) -> dict[str, float]:
    """One kill and resume: the seconds from the kill to the first step after it, split."""
    shutil.rmtree(run_dir, ignore_errors=True)
    log = Log(run_dir / "train.log")
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    cmd = train_command(case, run_dir, corpus)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(case.ranks))
    try:
        saved = f"checkpoints/step_{case.save_every:08d} in"
        after = f"train step {case.save_every + 1} |"
        wait_for(proc, lambda: saved in log.grow() and after in log.text, "a checkpoint", 900)
        since = len(log.text)
        victim = worker(proc, case.ranks - 1)  # not rank 0, which writes the log, where 2
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        line = wait_for(
            proc, lambda: STARTUP_LINE.search(log.grow(), since), "a start-up line", 600
        )
        seen = time.time()
    finally:
        end(proc)
        out.close()
    ckpt = max((run_dir / "checkpoints").glob("step_*"))
    parts = (part.rsplit(" ", 2) for part in line.group(2).split(", "))  # "imports 1.31 s"
    split = {name: float(seconds) for name, seconds, _ in parts}
    return {
        "resume": seen - killed_at,
        "restart": seen - killed_at - float(line.group(1)),
        **{name: split[name] for name in SPLIT},
        "params": int(PARAMS_LINE.search(log.text).group(1).replace(",", "")),
        "mib": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**20,
    }


def estimate_64(one: dict[str, float], two: dict[str, float] | None, args) -> list[list[str]]:
    """transformer_base (vocab 37k, DDP) on 64 GPUs, 8 nodes x 8, after one worker's death:
    the per-process figures measured here (`one`: 1 rank; `two`: 2 ranks, for the launcher's
    restart) and the assumptions that benchmarks/README.md states, one argument each."""
    scale = args.ckpt_mib / one["mib"]  # a rank reads, hashes and loads the whole checkpoint
    ckpt_gb, per_node = args.ckpt_mib * 2**20 / 1e9, args.nodes
    hash_s_per_gb = one["checkpoint verify"] / (one["mib"] * 2**20 / 1e9)  # sha256, one core
    restart = (two or one)["restart"] + args.rdzv_s
    rows = [
        ("restart", restart, "measured on 2 ranks + assumed re-rendezvous of the nodes' agents"),
        ("process start + imports", one["process start"] + one["imports"], "measured"),
        ("process group", args.nccl_init_s, "assumed: NCCL communicator of 64 ranks"),
        (
            "tokenizer/data",
            per_node * args.cache_gb / args.fs_gbps + args.cache_gb * hash_s_per_gb,
            f"every rank hashes the {args.cache_gb} GB token cache; FS reads once per node",
        ),
        ("model build", one["model build"], "measured (on the host)"),
        (
            "checkpoint verify",
            per_node * ckpt_gb / args.fs_gbps + ckpt_gb * hash_s_per_gb,
            f"every rank hashes {ckpt_gb:.2f} GB; FS reads once per node",
        ),
        ("checkpoint load", one["checkpoint load"] * scale, "measured, scaled to the size"),
        ("data position", args.plan_s, "the plan of an epoch of 4.5M pairs"),
        ("first step", args.first_step_s, "assumed: CUDA and NCCL warm-up"),
    ]
    total = sum(s for _, s, _ in rows)
    return [[name, f"{s:.1f}", why] for name, s, why in rows] + [["total", f"{total:.1f}", ""]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="demo,base1,base2", help=f"of {','.join(CASES)}")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", default=str(ROOT / "runs" / "bench" / "resume"))
    # The 64-GPU estimate's assumptions (benchmarks/README.md says where each comes from).
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--fs-gbps", type=float, default=2.0, help="shared filesystem, GB/s in all")
    p.add_argument("--ckpt-mib", type=float, default=721, help="base at vocab 37k, with Adam")
    p.add_argument("--cache-gb", type=float, default=0.4, help="WMT14 en-de's token cache")
    p.add_argument("--rdzv-s", type=float, default=2.0, help="the agents' re-rendezvous")
    p.add_argument("--nccl-init-s", type=float, default=5.0, help="NCCL init of 64 ranks")
    p.add_argument("--plan-s", type=float, default=0.5, help="an epoch's plan, 4.5M pairs")
    p.add_argument("--first-step-s", type=float, default=3.0, help="first step on a GPU")
    args = p.parse_args()

    work = Path(args.workdir)
    corpus = work / "numbers"
    if not (corpus / "train.en").is_file():
        subprocess.run(
            [sys.executable, "-m", "aiayn", "demo-data", "numbers", "--out", str(corpus)],
            check=True,
            env=environment(1),
        )
    print(f"Machine: {machine()}\n")
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in CPU_FLAGS})
    print(f"CPU flags: {' '.join(flags) or 'none of ' + ', '.join(CPU_FLAGS)}\n")
    rows, measured = [], {}
    for key in args.cases.split(","):
        case = CASES[key]
        runs = [
            measure(case, work / f"{key}-{r}", corpus) for r in range(args.repeats)
        ]  # fmt: skip
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        measured[key] = med
        spread = f" ({min(r['resume'] for r in runs):.1f}-{max(r['resume'] for r in runs):.1f})"
        rows.append(
            [case.name, str(case.ranks), f"{med['params'] / 1e6:.1f}M", f"{med['mib']:.0f}"]
            + [f"{med['resume']:.2f}" + (spread if args.repeats > 1 else "")]
            + [f"{med[k]:.2f}" for k in ("restart", *SPLIT)]
        )
    header = ["case", "ranks", "parameters", "checkpoint MiB", "time to resume s", "restart"]
    print(f"Median of {args.repeats}; seconds; the split is rank 0's start-up line.\n")
    print(markdown_table(header + list(SPLIT), rows))
    if "base1" in measured:
        print(f"\nEstimate, 64 GPUs ({args.nodes} nodes x 8), transformer_base:\n")
        est = estimate_64(measured["base1"], measured.get("base2"), args)
        print(markdown_table(["phase", "seconds", "from"], est))


CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16")

if __name__ == "__main__":
    main()
