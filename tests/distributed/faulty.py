"""`aiayn train` with one fault injected, for the restart tests:

    python faulty.py KIND RANK STEP train --config C [overrides]

On its first start (torchrun's TORCHELASTIC_RESTART_COUNT=0) rank RANK meets fault KIND as it
begins step STEP: sigkill, sigstop and sigusr1 (a preemption) send the signal to itself; raise
raises a RuntimeError, oom a torch.OutOfMemoryError, user an AiaynError (exit 2: not
restartable). A restarted group trains without faults."""

import os
import signal
import sys

import torch

from aiayn import cli, train
from aiayn.errors import TrainingError


def inject(kind: str, step: int) -> None:
    original = train._train_step

    def faulty_step(run, micro, window, n_tokens):
        if run.progress.step + 1 == step:
            print(f"faulty.py: {kind} on rank {run.env.rank} at step {step}", flush=True)
            if kind in ("sigkill", "sigstop", "sigusr1"):
                os.kill(os.getpid(), getattr(signal, kind.upper()))
            elif kind == "raise":
                raise RuntimeError(f"injected fault at step {step}")
            elif kind == "oom":
                raise torch.OutOfMemoryError(f"injected out of memory at step {step}")
            elif kind == "user":
                raise TrainingError(f"injected error a person must fix, at step {step}")
        return original(run, micro, window, n_tokens)

    train._train_step = faulty_step


if __name__ == "__main__":
    kind, rank, step, *argv = sys.argv[1:]
    first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_start and os.environ.get("RANK", "0") == rank:
        inject(kind, int(step))
    sys.exit(cli.main(argv))
