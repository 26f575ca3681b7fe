"""`run_dir/metrics.jsonl`: every scalar TensorBoard gets, as text a script can parse without
TensorBoard (jq, pandas.read_json(lines=True)). Rank 0 writes it, through train/monitor.py.

One JSON object per logged step or validation: `{"step": 12, "time": 1764255600.2,
"train/loss": 2.31, "train/lr": 0.0007, ...}`, its keys TensorBoard's tags (which all hold a
"/", so they never meet "step" and "time"). Each line is flushed as it is written, so a reader
following the file, or a crash, sees every line a log line was printed for; it is fsynced with
each checkpoint.

A restart drops the lines past the step it resumes from, as TensorBoard's purge drops the
events (monitor.Metrics): the resumed run logs those steps again, and no step appears twice.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from aiayn.runtime.durable import write_atomic

NAME = "metrics.jsonl"


class MetricsFile:
    """Appends one object a line to `path`, after dropping the lines past `resume_step`."""

    def __init__(self, path: Path, resume_step: int):
        keep_until(path, resume_step)
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not scalars:
            return
        row: dict[str, object] = {"step": step, "time": round(time.time(), 3)}
        row.update({tag: _number(value) for tag, value in scalars.items()})
        self._fh.write(json.dumps(row, allow_nan=False) + "\n")
        self._fh.flush()

    def sync(self) -> None:
        """Durable up to here: called with each checkpoint, whose step a restart returns to."""
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()


def keep_until(path: Path, step: int) -> None:
    """Drop the lines past `step` (and a last line a kill cut short), atomically: the file holds
    its old lines or the kept ones whenever the process stops. Nothing to do when none is
    dropped, so a restart reads the file once and rewrites it only after a lost stretch."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if (at := _step_of(line)) is not None and at <= step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))


def read(path: Path) -> list[dict]:
    """The file's objects, in order: for tests and for scripts that would rather not parse."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _step_of(line: str) -> int | None:
    if not line.endswith("\n"):  # cut short by a kill mid-write
        return None
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _number(value: float) -> float | int | None:
    """Counts stay exact integers (TensorBoard rounds them to float32); a value that is not
    finite becomes null, which every JSON parser reads (NaN is not JSON)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    value = float(value)
    return value if math.isfinite(value) else None
