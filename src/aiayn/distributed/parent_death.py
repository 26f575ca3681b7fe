"""A worker ends when its launcher dies, instead of training on.

torchrun's agent starts each worker with `start_new_session=True` (torch's SubprocessHandler),
so a signal to the launcher's process group, a lost login shell's SIGHUP, or a SIGKILL of the
launcher alone leaves the workers running: they train on and save into the run directory, and
the same command started again trains beside them (the run directory's lock, run_lock.py,
refuses that second start; this ends the first). On Linux each worker asks the kernel for a
signal when its parent dies (prctl(PR_SET_PDEATHSIG)). Its parent is the agent itself: torchrun,
`python -m aiayn.distributed.run` or `accelerate launch`, which start workers from their main
thread (the signal follows the thread that forked the worker, not the process). The CLI asks for it
first thing; a launcher that dies before then (the worker's interpreter start, a fraction of
a second) is missed, and the lock still refuses a second start beside that worker.

The signal is SIGTERM, the preemption signal (preemption.py): the workers agree on a step, save
it and exit 75, so the launcher's death costs no training. When every rank loses its launcher
together (one node, or `scancel` of a step), all of them save. When one node's launcher dies in
a multi-node job, its ranks' stop request reaches every rank by the stop vote, so the whole job
saves the same step and exits 75 (the other nodes' aiayn.distributed.run do not restart a
preempted group; a scheduler requeues it): better than SIGKILL, which would lose the steps
since the last checkpoint and leave the other nodes to fail on a lost peer. A rank that cannot
finish its save (a peer is gone) fails at distributed.timeout_minutes: no rank trains on either
way.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

SIGNAL = signal.SIGTERM
PR_SET_PDEATHSIG = 1  # linux/prctl.h

_launcher: int | None = None  # the parent pid the signal was asked for


def under_launcher(environ: Mapping[str, str]) -> bool:
    """Whether a launcher that starts one process per rank (torchrun and its users) started
    this process: one `aiayn` run from a shell is left alone."""
    return "TORCHELASTIC_RUN_ID" in environ or "LOCAL_RANK" in environ


def end_with_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Under a launcher, on Linux: have the kernel send this process SIGNAL when its parent
    dies, and send it now if the parent died before the request was made. Returns whether the
    request was made (elsewhere nothing is done, and nothing fails). Call it first thing."""
    global _launcher
    if sys.platform != "linux" or not under_launcher(environ):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(SIGNAL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    _launcher = parent
    # Orphaned between getppid() and prctl(): the kernel sends nothing for a death before the
    # request, and this process now has another parent (init, or a subreaper).
    if os.getppid() != parent:
        os.kill(os.getpid(), SIGNAL)
    return True


def launcher_gone() -> int | None:
    """The pid of this process's launcher if it has died since end_with_launcher(), else None:
    what a stop request came from."""
    if _launcher is not None and os.getppid() != _launcher:
        return _launcher
    return None
