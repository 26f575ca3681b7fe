"""Counting host syncs on CPU: the operators that, on a GPU, make the host wait for the device.

A CPU never waits, so the tests count the operators instead: each of these needs a value that
only the device has (a count, a scalar, a yes or no) before the host can go on. DeepSpeed also
waits for the device outright (`get_accelerator().synchronize()`, a no-op on CPU):
`AcceleratorSyncs` counts those calls.
"""

import contextlib
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Each returns a host value or a tensor whose size depends on the values: the host waits.
ALWAYS = {
    aten.nonzero.default,  # how many? (boolean indexing calls it too)
    aten.masked_select.default,
    aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t)
    aten.is_nonzero.default,  # `if t:`
    aten.equal.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,  # without output_size
}
# These wait only when indexed by a mask (bool or uint8), whose True entries must be counted.
BY_MASK = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}

_TORCH = str(Path(torch.__file__).parent)


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def call_site() -> str:
    """Where the value was asked for, outside torch and this file: the innermost caller and its
    own caller, 'caller -> callee', each as 'package/module.py:function' (no line numbers)."""
    frames = []
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_TORCH) or frame.filename == __file__:
            continue
        frames.append(f"{'/'.join(Path(frame.filename).parts[-2:])}:{frame.name}")
        if len(frames) == 2:
            break
    return " -> ".join(reversed(frames))


class SyncCounter(TorchDispatchMode):
    """While active (`with SyncCounter() as c:`), `c.seen` lists, in order, the name of every
    operator that would make the host wait for a GPU, and `c.sites` the code that called each
    (`call_site`). Counts this thread's operators only."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ALWAYS or (func in BY_MASK and any(_is_mask(i) for i in args[1])):
            self.seen.append(str(func))
            self.sites.append(call_site())
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def accelerator_syncs():
    """Count the calls to DeepSpeed's `get_accelerator().synchronize()` (a no-op on CPU, a
    device-wide wait on a GPU) while active: yields the list of their call sites."""
    from deepspeed.accelerator import get_accelerator

    accelerator, sites = get_accelerator(), []
    real = accelerator.synchronize

    def synchronize(*args, **kwargs):
        sites.append(call_site())
        return real(*args, **kwargs)

    accelerator.synchronize = synchronize
    try:
        yield sites
    finally:
        del accelerator.synchronize  # the class's method again
