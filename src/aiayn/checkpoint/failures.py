"""Checkpoint saves that fail: what each rank saw, the one message every rank gives, and when a
run stops trying (checkpoint.max_failed_saves).

A failed save loses nothing: the partial directory is removed and `latest` still names the
previous checkpoint (checkpoint/writer.py). Training goes on and tries again at the next due
save, because the usual cause, a full disk, is often fixed while the run goes on (a person or a
cleanup job frees space), and stopping would idle every GPU of the job until someone restarts
it. Going on without checkpoints puts work at risk, so it is bounded: after max_failed_saves
failures in a row the run stops with a CheckpointError (exit code 2, which the launcher does not
restart), having risked at most max_failed_saves x every_steps steps. The last save of a run
(its end, or a preemption) is never skipped this way: CheckpointManager.wait raises.
"""

from __future__ import annotations

import errno
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiayn.errors import CheckpointError
from aiayn.runtime.durable import size_text

log = logging.getLogger(__name__)

# safetensors (Rust) and torch.save's zip writer turn ENOSPC into their own exception types;
# these are the words they keep from the OS error.
_FULL_WORDS = ("no space left on device", "storagefull", "disk quota exceeded")


@dataclass
class Seen:
    """What one rank knows about a failed save: shared with the others (all_gather_object)."""

    rank: int
    error: str | None = None  # this rank's exception; None when its part succeeded
    disk_full: bool = False  # the exception says the filesystem is full
    tensor_bytes: int = 0  # what this rank was writing: numel * element_size of its tensors
    free_bytes: int | None = None  # the writer's, measured after the partial files went

    @classmethod
    def of(cls, rank: int, exc: BaseException | None, tensor_bytes: int = 0) -> Seen:
        if exc is None:
            return cls(rank, tensor_bytes=tensor_bytes)
        return cls(rank, f"{type(exc).__name__}: {exc}", is_disk_full(exc), tensor_bytes)


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from, says the disk or quota is full."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(word in str(exc).lower() for word in _FULL_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (nested dicts, lists, tuples): what writing it needs."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.elementsize_text()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def size_on_disk(directory: Path | None) -> int:
    """Bytes of the files under `directory` (0 when there is none)."""
    if directory is None or not directory.is_dir():
        return 0
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def free_bytes(path: Path) -> int:
    """Free bytes, for an unprivileged user, on the filesystem that holds `path`."""
    for folder in (path, *path.parents):  # the checkpoints folder may not exist yet
        if folder.exists():
            return shutil.disk_usage(folder).free
    return 0


def message(step: int, seen: list[Seen], root: Path, previous: Path | None) -> tuple[str, bool]:
    """What every rank reports about failed save `step` (the cause, the space it needs and
    the space there is, and that the previous checkpoint is intact), and whether the disk is
    full: an exception says so, or there is less space than the checkpoint needs (torch.save's
    zip writer reports ENOSPC as "file write failed")."""
    failed = [s for s in seen if s.error is not None]
    free = next((s.free_bytes for s in seen if s.free_bytes is not None), None)
    # The previous checkpoint is the best estimate (it holds every rank's shards); the tensors
    # being written, when they are more (the first save, or a model that grew).
    needed = max(size_on_disk(previous), sum(s.tensor_bytes for s in seen))
    where = f" on rank {', '.join(str(s.rank) for s in failed)}" if len(seen) > 1 else ""
    if previous is not None:
        kept = f"The previous checkpoint {previous.name} is intact and is `latest`."
    else:
        kept = "There is no earlier checkpoint: a restart begins from step 0."
    full = any(s.disk_full for s in failed) or (free is not None and free < needed)
    if full:
        space = f"; {size_text(free)} are free on that filesystem" if free is not None else ""
        return (
            f"checkpoint step {step} was not written: no space left on device ({root}){where}. "
            f"It needs about {size_text(needed)}{space}. {kept} Free space, or move run_dir to a "
            "larger disk."
        ), True
    return (
        f"checkpoint step {step} was not written: {failed[0].error}{where}. {kept} Check "
        f"{root} (permissions, disk health)."
    ), False


class FailedSaves:
    """Failed saves in a row. Every rank records the same ones (the ranks agree on each
    outcome), so every rank raises at the same save."""

    def __init__(self, limit: int):
        self.limit = limit
        self.steps: list[int] = []
        self.last: str | None = None  # the newest save's failure; None once one succeeds

    def succeeded(self) -> None:
        self.steps, self.last = [], None

    def failed(self, step: int, text: str) -> None:
        self.steps.append(step)
        self.last = text
        if len(self.steps) >= self.limit:
            raise CheckpointError(
                f"{len(self.steps)} checkpoint saves in a row failed (steps "
                f"{', '.join(map(str, self.steps))}; checkpoint.max_failed_saves={self.limit}): "
                f"stopping, so that no more training goes unsaved. The last: {text}"
            )
        log.error(
            "%s Training goes on and tries again at the next save (%d of "
            "checkpoint.max_failed_saves=%d failed in a row).",
            text,
            len(self.steps),
            self.limit,
        )

    def check_saved(self) -> None:
        """Raise if the newest save failed: a run's last save must not be skipped."""
        if self.last is not None:
            raise CheckpointError(
                f"{self.last} This was the run's last save (its end, or a stop): not reporting "
                "success without it. Re-run the same command once there is space; it resumes "
                "from the latest checkpoint."
            )
