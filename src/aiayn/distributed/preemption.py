"""Preemption: a signal asks the run to stop; all ranks stop after the same step and save.

Slurm (`--signal=B:USR1@N`, or SIGTERM at the time limit) and other schedulers warn a job
before killing it. The handler only sets a flag; the ranks agree on it once per step
(StopVote), so every rank stops after the same step, saves, and the process exits with
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


class StopVote:
    """Whether any rank was asked to stop, agreed by every rank without waiting for it: each
    step starts an all-reduce of this rank's flag and reads the one the step before started,
    which has had a whole step to arrive (at 1,024 ranks a small all-reduce takes about a
    step's time: benchmarks/README.md, step_collective.py). A stop is acted on one step after
    the signal. On one process the flag is read directly."""

    def __init__(self, env, flag: StopFlag):
        self.env, self.flag = env, flag
        self._pending = None  # the result of the all-reduce started last step

    def agreed(self) -> bool:
        """Call once per step on every rank, in step."""
        if not self.env.distributed:
            return self.flag.requested
        voted = self._pending() if self._pending is not None else [0.0]
        self._pending = None
        if voted[0] > 0:
            return True
        self._pending = self.env.sum_later([float(self.flag.requested)])
        return False

    def close(self) -> None:
        """Wait for the all-reduce still in flight (every rank started it): before the
        process group goes, and before collectives whose order must not interleave with it."""
        if self._pending is not None:
            self._pending()
            self._pending = None
