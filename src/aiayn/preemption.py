"""Preemption: a signal asks the run to stop; all ranks stop after the same step and save.

Slurm (`--signal=B:USR1@N`, or SIGTERM at the time limit) and other schedulers warn a job
before killing it. The handler only sets a flag; the training loop reduces the flag over ranks
once per step, so every rank stops after the same step, saves, and the process exits with
REQUEUE_EXIT_CODE, meaning "checkpointed, requeue me".
"""

from __future__ import annotations

import signal
import time

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: try again later
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised after the checkpoint of a preempted run is saved."""

    def __init__(self, step: int, seconds: float):
        super().__init__(
            f"preempted: checkpoint of step {step} saved {seconds:.2f}s after the signal"
        )
        self.step = step


class StopFlag:
    """Set by SIGTERM or SIGUSR1; installed for the duration of a `with` block."""

    def __init__(self):
        self.received_at: float | None = None
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def _handle(self, signum, frame) -> None:
        if self.received_at is None:  # keep the first: the time to save is measured from it
            self.received_at, self.signal = time.monotonic(), signum

    def __enter__(self) -> StopFlag:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
