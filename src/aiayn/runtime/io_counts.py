"""Counts of what a rank does to shared storage and to the other ranks at a save and a restart:
metadata calls (stat, exists, listing a folder), files opened, and bytes gathered from other
ranks. At W = 1,024 a call each rank makes once per rank of the job is a million calls on the
shared filesystem's metadata server, and a gather to every rank moves W times what a gather to
one rank moves: a rank's counts must not grow with W (rank 0's gathers, which build the one
manifest, excepted). The checkpoint code and DistEnv's gathers count here, as
runtime/durable.py's count_hashed counts hashing, and a run logs the counts of its saves and
restarts (`log_line`), which the tests at W = 2 and 4 compare."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("aiayn")

KINDS = ("stats", "opens", "listings", "gathered_bytes")
_counts = dict.fromkeys(KINDS, 0)
_watched: set[str] = set()  # folders whose files' opens and listings are counted
# Python's audit events for a file opened (open, io.open, os.open) and a folder listed: they
# count what libraries do too (DeepSpeed's torch.save and torch.load, its glob). Stats raise
# no event: the callers count those (`stat`, `exists`). safetensors opens files in Rust: its
# callers count those opens (`opened`).
_EVENTS = {"open": "opens", "os.listdir": "listings", "os.scandir": "listings"}


_thread = threading.local()  # .off: this thread's I/O is not counted (`uncounted`)


def count(kind: str, n: int = 1) -> None:
    if not getattr(_thread, "off", False):
        _counts[kind] += n


@contextmanager
def uncounted() -> Iterator[None]:
    """What this thread does inside is not counted: rank 0's retention reads and deletes old
    checkpoints in a thread of its own, whose I/O would land in whichever save's or restart's
    span it happened to overlap (the W = 2 and 4 counts then differed by timing alone)."""
    before, _thread.off = getattr(_thread, "off", False), True
    try:
        yield
    finally:
        _thread.off = before  # an enclosing `uncounted` stays in force


def counts() -> dict[str, int]:
    """This process's counts so far: take one before and one after to count a span."""
    return dict(_counts)


def watch(folder: Path) -> None:
    """Count opens and listings of what lies under `folder` from now on, in this process."""
    if not _watched:
        sys.addaudithook(_audit)
    _watched.add(os.path.abspath(folder) + os.sep)


def _audit(event: str, args: tuple) -> None:
    kind = _EVENTS.get(event)
    if kind is None or not args or not isinstance(args[0], str | bytes | os.PathLike):
        return
    try:
        path = os.fsdecode(args[0])
        if not os.path.isabs(path):
            path = os.path.abspath(path)
        path += os.sep if kind == "listings" else ""
        if any(path.startswith(folder) for folder in _watched):
            count(kind)
    except Exception:  # noqa: BLE001 (a hook that raises fails the open it audits)
        pass


def opened(n: int = 1) -> None:
    """Count a file opened where no audit event tells (safetensors' own reads)."""
    count("opens", n)


def stat(path: Path) -> os.stat_result:
    """os.stat, counted: one metadata call (where `is_file()` then `stat()` would be two)."""
    count("stats")
    return os.stat(path)


def exists(path: Path) -> bool:
    count("stats")
    return os.path.exists(path)


def since(before: dict[str, int]) -> dict[str, int]:
    """The counts since `before` (a `counts()`)."""
    return {k: _counts[k] - before[k] for k in KINDS}


def log_line(
    env, what: str, before: dict[str, int], earlier: dict[str, int] | None = None
) -> dict[str, int]:
    """Log rank 0's counts since `before` (plus `earlier`, a span counted before) and those of
    the busiest other rank, for `what` ("at the restart", "at the save of step 10"); return
    this rank's. One host reduction, every rank taking part (env: a DistEnv)."""
    mine = since(before)
    for k, v in (earlier or {}).items():
        mine[k] += v
    values = [float(mine[k]) for k in KINDS]
    zeros = [0.0] * len(KINDS)
    top = env.max(values + zeros if env.rank == 0 else zeros + values)
    first, others = top[: len(KINDS)], top[len(KINDS) :]
    text = ", ".join(f"{int(v):,} {k.replace('_', ' ')}" for k, v in zip(KINDS, first, strict=True))
    if env.world_size > 1:
        rest = ", ".join(f"{int(v):,}" for v in others)
        text += f"; the busiest other rank {rest}"
    log.info("checkpoint I/O %s: rank 0 %s", what, text)
    return mine
