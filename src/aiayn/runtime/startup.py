"""How long a start took, from the process's creation to the end of its first training step,
split by phase: the time a restart after a fault costs (benchmarks/resume_time.py).

Wall-clock (`time.time()`) throughout, so that the figures can be set against moments other
processes saw, such as when a launcher restarted the group. Imports nothing heavy: the CLI
marks the start of `main` with it before torch is imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The phases of the start-up line, in the order a start goes through them. Seconds outside
# every timed phase (logging set-up, TensorBoard, the MFU peak, ...) are reported as "other".
PHASES = (
    "process start",  # process creation -> first line of aiayn's main (interpreter, site)
    "imports",  # main -> train() (argument parsing, config, torch and aiayn)
    "process group",  # joining the launcher's group (rendezvous with the other ranks)
    "tokenizer/data",  # tokenizer and token cache opened (built if missing), loader made
    "model build",  # parameters initialised, engine (DDP/DeepSpeed, optimizer) built
    "checkpoint verify",  # finding the checkpoint to resume from: its checksums
    "checkpoint load",  # weights and engine state (optimizer, schedule, scaler) read
    "memory probe",  # a step on the largest batches before the first (train.memory_probe)
    "data position",  # the loader's saved position, and the wait for the first batch
    "first step",  # the rest of the first optimizer step
)

_main_started: float | None = None


def mark_main() -> None:
    """Called first thing in `aiayn.cli.main`: the end of "process start"."""
    global _main_started
    _main_started = time.time()


def process_created() -> float:
    """`time.time()` at this process's creation, from /proc (10 ms resolution); now where
    there is no /proc. /proc/stat's boot time is whole seconds, so the creation is placed
    relative to /proc/uptime instead."""
    try:
        with open("/proc/self/stat") as fh:
            # Field 22, starttime in clock ticks after boot; the name (field 2) may hold spaces.
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        now = time.time()
        return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


@dataclass
class StartupTimes:
    """Seconds per phase of this process's start; `phase()` times one, `summary()` closes."""

    created: float
    main_started: float
    train_started: float = field(default_factory=time.time)
    seconds: dict[str, float] = field(default_factory=dict)
    assembled: float | None = None
    done: bool = False

    @classmethod
    def of_this_process(cls) -> StartupTimes:
        """Started now, in train(): process start and imports are already over. Called without
        `aiayn.cli.main` (from Python), the imports count as process start."""
        main = _main_started if _main_started is not None else time.time()
        return cls(created=min(process_created(), main), main_started=main)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name`; a phase timed twice adds up."""
        started = time.time()
        try:
            yield
        finally:
            self.add(name, time.time() - started)

    def add(self, name: str, seconds: float) -> None:
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r}; phases: {PHASES}")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def set_up_done(self) -> None:
        """The run is assembled: from now until the first step ends is "first step"."""
        self.assembled = time.time()

    def first_step_done(self, batch_wait: float) -> tuple[str, dict[str, float]]:
        """The first step is over; it waited `batch_wait` s for its batches (the loader
        skipping to its position). Returns the start-up line and its split (`summary`)."""
        now = time.time()
        assembled = self.assembled if self.assembled is not None else now
        self.add("data position", batch_wait)
        self.add("first step", max(now - assembled - batch_wait, 0.0))
        return self.summary(now)

    def split(self, now: float | None = None) -> dict[str, float]:
        """Every phase's seconds, "other" (the rest) and "total" (creation -> `now`)."""
        now = time.time() if now is None else now
        split = {
            "process start": self.main_started - self.created,
            "imports": self.train_started - self.main_started,
            **{p: self.seconds.get(p, 0.0) for p in PHASES[2:]},
        }
        total = now - self.created
        split["other"] = total - sum(split.values())
        split["total"] = total
        return split

    def summary(self, now: float | None = None) -> tuple[str, dict[str, float]]:
        """The start-up line and the split it shows; the start is then over (`done`)."""
        self.done = True
        split = self.split(now)
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in split.items() if name != "total")
        return f"start-up {split['total']:.2f} s: {parts}", split
