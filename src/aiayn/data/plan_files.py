"""An epoch's plan made once per node and kept beside the token cache, for the node's other
ranks to memory-map.

Every rank needs the whole epoch's plan to find its own batches (plan.py), and making it is
O(N): at 100M pairs, seconds of a core and gigabytes on every rank, at every epoch. Here one
rank per node makes it, the epoch's planner (local rank epoch mod L, so that each of a node's
L ranks plans one epoch in L), an epoch ahead in the loader's background thread, and writes it
beside the cache; the node's other ranks memory-map it when the epoch starts and read the
batches' bounds, their order and the cumulative target tokens (O(N / batch size)) and the rows
of their own batches only. Per node, because a cache may lie on each node's own disk
(data.cache_scope=node); where the cache directory is shared, every node's planner writes the
same folder and the first rename wins.

A plan file is a copy of what a pure function gives, never the only copy: a rank that finds
none (the first epoch of a start whose files are gone, a planner running late, a cache
directory it cannot write) makes the plan itself, the same bits. The folder is named by all
the plan depends on (the loader's fingerprint: the cache's content, seed, token budget,
window, max_len, padding; and plan.PLAN_VERSION), so that a plan of other settings is never
read. The planner of an epoch deletes the files of the epochs before the one before the previous.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import socket
import threading
from dataclasses import fields
from pathlib import Path

import numpy as np

from aiayn.data.plan import PLAN_VERSION, LmPlan, Plan
from aiayn.runtime.durable import fsync_path

log = logging.getLogger(__name__)

MAGIC = b"aiaynpl1"
SUMS = "target_sums"  # cumulative target tokens of the global batches in plan order, 0 first
_ALIGN = 64
_KINDS = {cls.__name__: cls for cls in (Plan, LmPlan)}
_EPOCH = re.compile(r"^\.?epoch_(\d+)\.")


def plans_folder(cache_root: Path, fingerprint: dict) -> Path:
    """Where the plans of a loader with this fingerprint (cache_rows.py's) are kept: beside the
    cache's folder, not in it, so that the cache stays the arrays its manifest lists."""
    key = json.dumps({"plan_version": PLAN_VERSION, **fingerprint}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root.parent / f"{cache_root.name}.plans" / digest


class PlanFiles:
    """The epochs' plans of one loader's settings in `folder`, as rank `local_rank` of the
    `local_world_size` ranks of a node reads and writes them.

    One file per epoch, `epoch_<e>.plan`: MAGIC, the header's length (8 bytes, little-endian),
    a JSON header (the epoch, the plan's kind, its scalars, and each array's dtype, offset and
    length), then the arrays, each at a multiple of 64 bytes. One file and one map, not a .npy
    per array: a rank's share of an epoch can take less time than parsing four .npy headers."""

    def __init__(self, folder: Path, local_rank: int, local_world_size: int):
        self.folder = folder
        self.local_rank, self.local_world_size = local_rank, max(1, local_world_size)
        self.read_count = 0  # plans memory-mapped rather than made: what the tests count
        self._warned = False

    def plans(self, epoch: int) -> bool:
        """Whether this rank is the planner of `epoch` on its node."""
        return epoch % self.local_world_size == self.local_rank

    def path(self, epoch: int) -> Path:
        return self.folder / f"epoch_{epoch}.plan"

    def read(self, epoch: int) -> tuple[Plan | LmPlan, np.ndarray] | None:
        """(plan, cumulative target tokens) of `epoch` as written, memory-mapped; None if
        there is none (yet) or it is not whole."""
        try:
            with open(self.path(epoch), "rb") as fh:
                # The map outlives the file: the arrays below hold it (a deleted file's pages
                # stay readable while mapped).
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if buf[:8] != MAGIC:
                return None
            size = int.from_bytes(buf[8:16], "little")
            meta, start = json.loads(buf[16 : 16 + size]), _aligned(16 + size)
            arrays = {
                name: np.frombuffer(buf, np.dtype(dtype), count, start + offset)
                for name, (dtype, offset, count) in meta["arrays"].items()
            }
            if meta["epoch"] != epoch:
                return None
            sums = arrays.pop(SUMS)
            plan = _KINDS[meta["kind"]](**arrays, **meta["scalars"])
        except (OSError, ValueError, KeyError, TypeError):  # none, torn, or deleted while read
            return None
        if len(sums) != len(plan) + 1:
            return None
        self.read_count += 1
        return plan, sums

    def write(self, epoch: int, plan: Plan | LmPlan, sums: np.ndarray) -> None:
        """Write `epoch`'s plan where the node's ranks find it, whole or not at all; a folder
        that cannot be written is said once and left (every rank then plans for itself)."""
        # Host, process and thread: the planners of several nodes (a shared directory) or of
        # several loaders in one process (tests) never share a temporary file.
        where = self.path(epoch)
        tmp = where.with_name(
            f".{where.name}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
        )
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._prune(epoch)
            if where.is_file():
                return
            values = {f.name: getattr(plan, f.name) for f in fields(plan)}
            scalars = {k: v for k, v in values.items() if not isinstance(v, np.ndarray)}
            arrays = {k: v for k, v in values.items() if k not in scalars} | {SUMS: sums}
            header, at = {}, 0  # offsets from the first array's
            for name, a in arrays.items():
                header[name] = [a.dtype.str, at, len(a)]
                at = _aligned(at + a.nbytes)
            meta = {"epoch": epoch, "kind": type(plan).__name__, "scalars": scalars}
            text = json.dumps({**meta, "arrays": header}).encode()
            start = _aligned(16 + len(text))
            with open(tmp, "wb") as fh:
                fh.write(MAGIC + len(text).to_bytes(8, "little") + text)
                for name, a in arrays.items():
                    fh.seek(start + header[name][1])
                    fh.write(np.ascontiguousarray(a).tobytes())
                fh.flush()
                os.fsync(fh.fileno())  # a rename that outlives a crash names a whole file
            os.replace(tmp, where)
            fsync_path(self.folder)
        except OSError as exc:
            with contextlib.suppress(OSError):  # where the folder cannot be made, neither can tmp
                tmp.unlink(missing_ok=True)
            if not self._warned:  # once per rank, and a warning from one rank of a node
                self._warned = True
                log.log(
                    logging.WARNING if self.local_rank == 0 else logging.DEBUG,
                    "cannot keep the epoch's plan in %s (%s): every rank plans each epoch "
                    "itself (the same batches, more CPU per rank); give data.cache_dir a "
                    "directory this rank can write",
                    self.folder,
                    exc,
                )

    def _prune(self, epoch: int) -> None:
        """Delete the plans (and a killed planner's temporary files) of the epochs before
        epoch - 2. The ranks are in epoch - 1 while `epoch` is planned, and a position saved
        in a round that crossed into it names epoch - 2 (with the batches done past its end):
        a restart from there reads that plan for its length."""
        for path in self.folder.iterdir():
            m = _EPOCH.match(path.name)
            if m and int(m.group(1)) < epoch - 2:
                path.unlink(missing_ok=True)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
