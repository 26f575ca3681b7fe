"""Host copies of the training state for an asynchronous save, made without holding the loop.

An async save writes from host copies, since the next optimizer update changes the weights and
Adam's moments in place. Copied device to host one tensor at a time into fresh pageable memory,
they held the loop for several steps' time per save (benchmarks/README.md). Here they go into
host buffers kept from save to save (pinned on
CUDA), on a CUDA stream of their own: the loop only queues the copies, the copy engine runs
them beside the next step's forward and backward, and the next update waits for them
(`guard`, which the loop calls before every optimizer step). The writer thread waits for
them before it reads (`wait`).

Reusing the buffers is safe because a save first waits for the previous write (Writer._join,
checkpoint/writer.py): nothing reads last save's copies when this one overwrites them. On a CPU
the copies are plain copies, done when `copy` returns.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class Staging:
    """Kept host buffers, the copy stream, and the event that marks this save's copies done."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []  # the i-th tensor copied in a save uses the i-th
        self._next = 0
        self._stream: torch.cuda.Stream | None = None
        self._device: torch.device | None = None  # the CUDA device of this save's copies
        self._done: torch.cuda.Event | None = None  # recorded by end(), waited on by guard()

    def begin(self) -> None:
        """Start a save's copies."""
        self._next = 0
        self._device = None

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of `tensor` in a kept buffer (queued, on CUDA: read it after wait())."""
        tensor = tensor.detach()
        buffer = self._buffer(tensor)
        if tensor.is_cuda:
            if self._device is None:  # the save's first CUDA tensor
                self._device = tensor.device
                if self._stream is None:
                    self._stream = torch.cuda.Stream(tensor.device)
                # The copies see everything the loop has queued so far (the last update).
                self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._stream):
                buffer.copy_(tensor, non_blocking=True)
            # The source may be freed before the copy runs (ZeRO-3's gathered weights are):
            # its memory is not handed out again until the copy stream has passed this point.
            tensor.record_stream(self._stream)
        else:
            buffer.copy_(tensor)
        return buffer

    def copy_tree(self, obj: Any) -> Any:
        """`obj` with every tensor replaced by its host copy; other values deep-copied."""
        if isinstance(obj, torch.Tensor):
            return self.copy(obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.copy_tree(v) for v in obj)
        return copy.deepcopy(obj)

    def end(self) -> torch.cuda.Event | None:
        """The event after this save's last copy (None on a CPU): the writer waits on it."""
        if self._device is None:
            return None
        self._done = torch.cuda.Event()
        self._done.record(self._stream)
        return self._done

    def guard(self) -> None:
        """Before the loop changes in place what was copied: its later work waits for the
        copies on the device (the host does not wait)."""
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)
            self._done = None

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if i < len(self._buffers):
            kept = self._buffers[i]
            if kept.shape == tensor.shape and kept.dtype == tensor.dtype:
                return kept
        fresh = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda
        )
        if i < len(self._buffers):
            self._buffers[i] = fresh
        else:
            self._buffers.append(fresh)
        return fresh


def wait(done: torch.cuda.Event | None) -> None:
    """In the writer thread, before it reads the copies."""
    if done is not None:
        done.synchronize()
