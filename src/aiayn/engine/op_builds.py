"""DeepSpeed's C++ ops, compiled on first use: wait for a build in progress, refuse a dead one.

DeepSpeed compiles ops such as its CPU shared-memory all-reduce and CPU Adam with torch's
`cpp_extension` on the first run of each environment. torch marks a build in progress with a
`lock` file in the op's build directory and waits, polling forever, while that file exists.
A build killed half way (Ctrl-C, a preemption, a job's time limit) leaves the file behind,
and every later DeepSpeed launch then hangs in silence. No build takes anywhere near
`STALE_AFTER_S` (one op: about a minute on 2 cores), so an older lock names a dead build.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from aiayn.errors import TrainingError

log = logging.getLogger(__name__)

STALE_AFTER_S = 15 * 60
SHM_ALL_REDUCE = "deepspeed_shm_comm"  # op_builder/cpu/comm.py ShareMemCommBuilder.NAME
POLL_S = 2.0


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else its per-user cache."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    # <root>/<op>/lock with TORCH_EXTENSIONS_DIR set; <root>/<py311_cpu>/<op>/lock without.
    return sorted([*root.glob("*/lock"), *root.glob("*/*/lock")])


def wait_for_op_builds(
    root: Path | None = None, stale_after_s: float = STALE_AFTER_S, poll_s: float = POLL_S
) -> None:
    """Return once no op build holds a lock; raise if a lock is older than any build takes."""
    root = extensions_root() if root is None else root
    waited_on: set[Path] = set()
    while locks := build_locks(root):
        now = time.time()
        for lock in locks:
            try:
                age = now - lock.stat().st_mtime
            except FileNotFoundError:  # the build finished between the glob and the stat
                continue
            if age > stale_after_s:
                raise TrainingError(
                    f"{lock} is {age / 60:.0f} minutes old: a C++ op build (DeepSpeed compiles "
                    "its ops on first use) was killed half way and left its lock, and torch "
                    "waits for that lock forever. If no build is running, delete it "
                    f"(rm {lock}) and launch again; the op is rebuilt on the next run"
                )
            if lock not in waited_on:
                waited_on.add(lock)
                log.info("waiting for the op build that holds %s (%.0f s old)", lock, age)
        time.sleep(poll_s)


def skip_inference_all_reduce() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce, which training never calls.

    DeepSpeed's torch backend compiles that op whenever it wraps a CPU process group (tens of
    seconds, on the first launch of every environment and every fresh container), but
    only `inference_all_reduce` (tensor-parallel inference) calls it; ZeRO's collectives go
    through torch.distributed. Marking it incompatible in DeepSpeed's table of ops, which
    DeepSpeed caches in `deepspeed.ops` for edits like this one, makes the backend skip it.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_ALL_REDUCE] = False
