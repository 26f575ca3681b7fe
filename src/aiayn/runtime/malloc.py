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
import threading

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


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        )
    ]


def mallinfo() -> _Mallinfo2 | None:
    """glibc's own accounting of its arenas and mmapped blocks (mallinfo2); None where the C
    library is not glibc 2.33 or later."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2()


def allocated() -> int | None:
    """Bytes of host memory the C library's allocator has handed out and not had back, over
    all its arenas and its mmapped blocks: the host's counterpart of
    torch.cuda.memory_allocated, tensors on the CPU included. None without mallinfo().

    This, not resident memory, is what a measurement of "how much did this call allocate"
    wants: freed blocks stay resident (above, by design), so a call can reuse them without
    its resident size growing; and after malloc_trim the same call's re-use of trimmed free
    pages shows as a resident rise although nothing new was allocated (benchmarks/README.md:
    a ZeRO-3 validation whose allocated memory rose 31 MiB raised its resident size by
    227 MiB).
    """
    info = mallinfo()
    return None if info is None else info.uordblks + info.hblkhd


class AllocatedPeak:
    """How far allocated() rose above its value at entry, at its highest, sampled every
    `interval` seconds by a thread while the block runs: `with AllocatedPeak() as peak: ...`,
    then peak.rise (bytes). A sample is taken at entry and at exit too; a rise shorter than
    the interval can be missed, a whole model held through a forward cannot. rise stays None
    where allocated() is None."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.rise: int | None = None
        self._stop = threading.Event()

    def _sample(self) -> None:
        now = allocated()
        if now is not None:
            self.rise = max(self.rise or 0, now - self._base)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> AllocatedPeak:
        base = allocated()
        if base is not None:
            self._base, self.rise = base, 0
            self._thread = threading.Thread(target=self._watch, name="allocated-peak", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.rise is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
