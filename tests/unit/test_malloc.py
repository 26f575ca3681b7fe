"""malloc.keep_freed_memory: large tensors come from the heap and their memory is reused;
malloc.AllocatedPeak: the highest allocated host memory while a block runs."""

import json
import platform
import subprocess
import sys
import time

import pytest
import torch

from aiayn.runtime import malloc

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# In a fresh interpreter, so that the setting does not leak into the test process: allocate and
# touch a 64 MiB tensor, free it, allocate it again, and read glibc's own accounting.
_PROBE = """
import json, sys
import torch
from aiayn.runtime.malloc import keep_freed_memory, mallinfo

applied = keep_freed_memory() if sys.argv[1] == "keep" else None
out = {"applied": applied}
x = torch.empty(16 << 20).fill_(1.0)  # 64 MiB
out["held"] = {"mmapped": mallinfo().hblkhd, "heap": mallinfo().arena}
del x
out["freed"] = {"free_in_heap": mallinfo().fordblks}
heaps = []
for i in range(1, 41):  # allocate and free again: the heap settles, it does not keep growing
    y = torch.empty(16 << 20).fill_(2.0)
    del y
    if i in (20, 40):
        heaps.append(mallinfo().arena)
out["again"] = {"heaps": heaps}
print(json.dumps(out))
"""

MiB = 1 << 20


def _probe(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_system_policy_maps_large_tensors_and_keep_serves_them_from_the_heap():
    system, keep = _probe("system"), _probe("keep")
    # glibc's default: the 64 MiB block is its own mmap, which free() unmaps.
    assert system["held"]["mmapped"] >= 64 * MiB
    assert keep["applied"] is True
    assert keep["held"]["mmapped"] < 64 * MiB
    assert keep["held"]["heap"] >= 64 * MiB
    # Freed, the block stays in the process. Allocated and freed again and again, the heap
    # settles: no growth between round 20 and round 40. (It may grow by a few blocks first:
    # torch asks for 64-byte-aligned memory, which a freed block of exactly the size cannot
    # always give, and small objects allocated between can keep it from merging.)
    assert keep["freed"]["free_in_heap"] >= 64 * MiB
    at_20, at_40 = keep["again"]["heaps"]
    assert at_40 == at_20, (at_20, at_40)


def test_other_c_libraries_are_left_alone(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda: ("musl", "1.2"))
    assert malloc.keep_freed_memory() is False


def test_allocated_peak_sees_a_block_freed_before_the_block_ends():
    with malloc.AllocatedPeak() as peak:
        x = torch.empty(16 << 20).fill_(1.0)  # 64 MiB, held for 20 samples
        time.sleep(0.02)
        del x
    assert 64 * MiB <= peak.rise < 68 * MiB
    assert malloc.allocated() < peak._base + 4 * MiB  # gone again
    with malloc.AllocatedPeak() as idle:
        time.sleep(0.01)
    assert 0 <= idle.rise < MiB
