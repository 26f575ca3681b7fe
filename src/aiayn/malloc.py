"""How the C library's allocator treats freed host memory (tensors on the CPU).

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and
unmaps it on free, and trims the top of its heap back to the OS. A CPU training step allocates
and frees the same large activations, gradients and logits every step, so each step
page-faults all of them in again: an operation into a fresh large tensor costs several times
one into memory already touched, and training is faster with freed memory kept
(benchmarks/README.md, "Measurements behind defaults"). Intel's PyTorch launcher
gets the same effect by preloading jemalloc or tcmalloc; glibc's own switches need no extra
library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes a C int


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> bool:
    """Keep freed host memory in the process for later allocations: no mmap for large blocks
    (they come from the heap and return to it), and no trimming of the heap unless more than
    2 GiB lies free at its top. Resident memory then stays at the step's peak instead of
    falling between steps, and a little above it: the Multi30k recipe's rose from 1.03 GiB at
    step 100 to 1.15 GiB at step 700 and stayed there to step 1,500 (0.85 GiB with glibc's
    default), because blocks freed between small live objects are not always reused.
    `train.malloc: system` turns this off. Returns False, changing nothing, where the C
    library is not glibc.
    """
    libc = _glibc()
    if libc is None:
        log.info("malloc: not glibc (%s); the allocator keeps its own policy", platform.libc_ver())
        return False
    # Where the heap cannot grow, glibc still falls back to mmap: a large request never fails
    # for want of mmap.
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX)):
        log.warning("malloc: mallopt refused the settings; the allocator keeps its own policy")
        return False
    return True
