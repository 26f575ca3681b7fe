"""`aiayn train` with faults injected, for the restart tests:

    python faulty.py KINDS RANK STEPS train --config C [overrides]

KINDS and STEPS are comma-separated lists of the same length: on the group's i-th start
(torchrun's TORCHELASTIC_RESTART_COUNT=i) rank RANK meets fault KINDS[i] as it begins step
STEPS[i]. sigkill, sigstop and sigusr1 (a preemption) send the signal to itself;
sigterm-launcher sends SIGTERM to its launcher (a scheduler's preemption, which the launcher
forwards); sigstop-node stops its launcher and itself (a node that vanished: its sockets stay
open, its heartbeats stop); sigkill-node kills its launcher and itself (a node that died);
raise raises a RuntimeError, oom a torch.OutOfMemoryError, user an AiaynError (exit 2: not
restartable); hold-save stops the rank inside the save of step STEPS[i] (0: its first save),
its part written, until it is killed. A start past the last fault trains without one.
Several faults in one job let one launch check several kinds of restart, each from the
checkpoint the previous one left.
Each fault is logged with its time (time.time()) to run_dir/injected.jsonl just before, and
fault i fires only after i faults are logged there."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from aiayn import cli
from aiayn.errors import TrainingError
from aiayn.train import loop


def inject(kind: str, step: int, index: int) -> None:
    if kind == "hold-save":  # in the save of `step`, not as the step begins
        return hold_save(step, index)
    original = loop._train_step

    def faulty_step(run, *args):
        log = Path(run.cfg.run_dir) / "injected.jsonl"
        # Fault `index` once: after an elastic membership change a node keeps its restart
        # count, so a start can be the index-th on one node and a later one on another.
        done = len(log.read_text().splitlines()) if log.exists() else 0
        if run.progress.step + 1 == step and done == index:
            print(f"faulty.py: {kind} on rank {run.env.rank} at step {step}", flush=True)
            row = {"kind": kind, "rank": run.env.rank, "step": step, "time": time.time()}
            with open(log, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            if kind in ("sigkill", "sigstop", "sigusr1"):
                os.kill(os.getpid(), getattr(signal, kind.upper()))
            elif kind == "sigterm-launcher":
                os.kill(os.getppid(), signal.SIGTERM)
            elif kind == "sigstop-node":
                os.kill(os.getppid(), signal.SIGSTOP)
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "sigkill-node":
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "raise":
                raise RuntimeError(f"injected fault at step {step}")
            elif kind == "oom":
                raise torch.OutOfMemoryError(f"injected out of memory at step {step}")
            elif kind == "user":
                raise TrainingError(f"injected error a person must fix, at step {step}")
        return original(run, *args)

    loop._train_step = faulty_step


def hold_save(step: int, index: int) -> None:
    """In the save of `step`, once this rank's part is written: log the fault and wait to be
    killed, so that a test kills the job inside a save, every time."""
    from aiayn.checkpoint import writer

    original = writer.Writer._write

    def held(self, saved, tmp, *args):
        log = tmp.parent.parent / "injected.jsonl"
        done = len(log.read_text().splitlines()) if log.exists() else 0
        if (step and saved != step) or done != index:
            return original(self, saved, tmp, *args)
        shares = args[0]
        for name, (slices, lo, hi) in shares.items():  # this rank's ranges, as _write does
            writer.write_slices(tmp / name, slices, lo, hi)
        with open(log, "a") as fh:
            fh.write(json.dumps({"kind": "hold-save", "step": step, "time": time.time()}) + "\n")
        time.sleep(3600)

    writer.Writer._write = held


if __name__ == "__main__":
    kinds, rank, steps, *argv = sys.argv[1:]
    faults = list(zip(kinds.split(","), map(int, steps.split(",")), strict=True))
    start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if start < len(faults) and os.environ.get("RANK", "0") == rank:
        inject(*faults[start], start)
    sys.exit(cli.main(argv))
