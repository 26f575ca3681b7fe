"""Preemption: a signal asks the run to stop; all ranks stop after the same step and save.

Slurm (`--signal=B:USR1@N`, or SIGTERM at the time limit) and other schedulers warn a job
before killing it. The handler only sets a flag; the ranks agree on it once per step
(StopVote), so every rank stops after the same step, saves, and the process exits with
REQUEUE_EXIT_CODE, meaning "checkpointed, requeue me".

A second SIGTERM means "now": the process exits at once with NOW_EXIT_CODE, saving nothing,
even where it is blocked in C (a collective whose peer is gone never ends the step that the
first SIGTERM asked to finish).
"""

from __future__ import annotations

import os
import signal
import threading
import time

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: try again later
NOW_EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A SIGTERM this soon after the first is the same request delivered twice: Slurm signals every
# process of a step, the launcher too, and the launcher forwards what it got to its workers.
REPEAT_AFTER_S = 2.0


class Preempted(Exception):
    """Raised after the checkpoint of a preempted run is saved."""

    def __init__(self, step: int, seconds: float):
        super().__init__(
            f"preempted: checkpoint of step {step} saved {seconds:.2f}s after the signal"
        )
        self.step = step


class StopFlag:
    """Set by SIGTERM or SIGUSR1; installed for the duration of a `with` block. A SIGTERM at
    least REPEAT_AFTER_S after a first one exits the process at once (NOW_EXIT_CODE)."""

    def __init__(self):
        self.received_at: float | None = None
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        self._watching = False  # whether a thread reads the wakeup fd (_watch_repeats)

    @property
    def requested(self) -> bool:
        return self.received_at is not None

    def _handle(self, signum, frame) -> None:
        if self.received_at is None:  # keep the first: the time to save is measured from it
            self.received_at, self.signal = time.monotonic(), signum

    def __enter__(self) -> StopFlag:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watch_repeats()
        return self

    def __exit__(self, *exc) -> None:
        global _watched
        if self._watching:
            os.close(signal.set_wakeup_fd(-1))  # the pipe's write end: the thread reads EOF
            self._watching = _watched = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _watch_repeats(self) -> None:
        """Python runs a signal handler in the main thread between bytecodes, so a process
        blocked in C (a collective, a CUDA sync) never runs it; but the C part of the handler
        writes each signal's number to the wakeup fd at once. A thread reads them there."""
        global _watched
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # set_wakeup_fd's requirement
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:  # another user of the wakeup fd (an asyncio loop): leave it theirs
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return
        self._watching = _watched = True
        threading.Thread(
            target=_exit_on_repeated_sigterm, args=(read_end,), name="StopFlag", daemon=True
        ).start()


def _exit_on_repeated_sigterm(read_end: int) -> None:
    """The StopFlag's thread: exit at once on a SIGTERM REPEAT_AFTER_S or more after the first."""
    first = None
    try:
        while data := os.read(read_end, 64):  # a byte per signal; b"" once the flag is gone
            now = time.monotonic()
            for signum in data:
                if signum != signal.SIGTERM:
                    continue
                if first is None:
                    first = now
                elif now - first >= REPEAT_AFTER_S:
                    os.write(2, b"aiayn: a second SIGTERM: exiting now, without saving\n")
                    os._exit(NOW_EXIT_CODE)
    finally:
        os.close(read_end)


_watched = False  # a StopFlag's thread reads this process's wakeup fd


def _no_wakeup_in_child() -> None:
    """A forked child (a data-loading worker) inherits the wakeup fd: its own signals must not
    reach its parent's StopFlag as if they were the parent's."""
    if _watched:
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # forked from a thread Python does not take for the main one
            pass


os.register_at_fork(after_in_child=_no_wakeup_in_child)


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
