"""Counting host syncs on CPU: the operators that, on a GPU, make the host wait for the device.

A CPU never waits, so the tests count the operators instead: each of these needs a value that
only the device has (a count, a scalar, a yes or no) before the host can go on.
"""

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


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class SyncCounter(TorchDispatchMode):
    """While active (`with SyncCounter() as c:`), `c.seen` lists, in order, the name of every
    operator that would make the host wait for a GPU. Counts this thread's operators only."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ALWAYS or (func in BY_MASK and any(_is_mask(i) for i in args[1])):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))
