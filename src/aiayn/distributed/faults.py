"""The run's fault log, `<run_dir>/faults.jsonl`: one JSON line per worker that failed, written
by the launcher that saw it fail (aiayn.distributed.run), read by whoever decides what to do
next (the launcher's restart policy, slurm/train.sbatch's node exclusion, a person).

Exit codes tell a fault from a stop (docs/distributed.md, "Faults and restarts"):

| exit code | meaning                                   | what follows                         |
| --------- | ----------------------------------------- | ------------------------------------ |
| 0         | done                                      | nothing                              |
| 75        | preempted: checkpoint saved, requeue me   | no in-job restart; the scheduler     |
| 2         | an error a person must fix (config, data, | no restart: it would fail the same   |
|           | a non-finite loss, a disk that stays full)| way again                            |
| other     | a fault (a signal, an exception, OOM, a   | the group restarts from the latest   |
|           | lost or stalled rank)                     | checkpoint, up to --max-restarts     |
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiayn.distributed.preemption import REQUEUE_EXIT_CODE
from aiayn.errors import AiaynError

FAULTS_FILE = "faults.jsonl"
LAUNCHER_ENV = "AIAYN_LAUNCHER"  # set by aiayn.distributed.run: whose policy restarts a worker
USER_ERROR_EXIT_CODE = AiaynError.exit_code  # the CLI's for an error whose message names a fix
NOT_RESTARTED = (REQUEUE_EXIT_CODE, USER_ERROR_EXIT_CODE)


def node_name() -> str:
    """The node as the scheduler names it (what `--exclude` takes), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def describe_exit(exitcode: int) -> str:
    """`exitcode` as a person reads it: "exit 1", or "SIGKILL" for a process a signal ended
    (negative codes, as subprocess and torchrun report them)."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit {exitcode}"


def should_restart(exitcodes: list[int]) -> bool:
    """Whether a group whose workers failed with `exitcodes` is restarted in place: not when
    any worker was preempted (it saved; the scheduler requeues the job) or stopped on an error a
    restart would only repeat."""
    return not any(code in NOT_RESTARTED for code in exitcodes)


@dataclass
class Fault:
    """One failed worker."""

    rank: int
    exitcode: int
    action: str  # "restart", "stop" (restarts used up, or not restartable), "preempted"
    error: str = ""  # the worker's own message, where it left one (torchrun's error file)
    attempt: int = 0  # torchrun's restart count when it failed: 0 is the first start
    node: str = field(default_factory=node_name)
    time: float = field(default_factory=time.time)
    slurm_job: str | None = field(default_factory=lambda: os.environ.get("SLURM_JOB_ID"))
    slurm_restart: int = field(
        default_factory=lambda: int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    )

    @property
    def how(self) -> str:
        return describe_exit(self.exitcode)


def record(run_dir: str | Path, faults: list[Fault]) -> None:
    """Append `faults` to the run's log."""
    append_jsonl(Path(run_dir) / FAULTS_FILE, [asdict(f) for f in faults])


def read(run_dir: str | Path) -> list[Fault]:
    """Every fault the run has logged, oldest first."""
    known = set(Fault.__dataclass_fields__)
    rows = read_jsonl(Path(run_dir) / FAULTS_FILE)
    return [Fault(**{k: v for k, v in row.items() if k in known}) for row in rows]


def append_jsonl(path: Path, rows: list[dict]) -> None:
    """Append `rows` to a JSON-lines log. One write of whole lines with O_APPEND: lines from
    several nodes sharing the run directory do not interleave."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines log, oldest first; a torn line (a crash mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
