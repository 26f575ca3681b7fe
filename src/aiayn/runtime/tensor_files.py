"""safetensors files that every rank writes together, each its own byte range, hashed as written.

Under DDP every rank holds the same weights and the same optimizer state (DeepSpeed stages 1 and
2 hold the same weights), so a save's bytes need not all pass through one rank. A safetensors
file is an 8-byte header length, a JSON header, and each tensor's bytes at the offsets the header
gives: every rank computes the same layout from names, dtypes and shapes alone, and rank r
writes bytes [size * r / W, size * (r + 1) / W) of the file, cutting through a tensor where its
range ends, with pwrite into the one file, hashing its bytes as it writes them. A save is then
written and hashed at W ranks' bandwidth, each rank copies 1/W of the state to the host, and
the file reads as one that safetensors wrote: evaluate, average, export and outside tools read
model.safetensors as before. The manifest records each range's sha256
(`{"sha256_ranges": [[start, end, hex], ...]}`); a file written by one rank has its `sha256`.

Why not torch.distributed.checkpoint, which also spreads a save over the ranks: its files are
its own (`.distcp` shards and a `.metadata`), so model.safetensors would have to be made again
from them after every save, by one rank (the serial write this avoids), and it records no
checksums, which a start verifies (checkpoint/format.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' names of the dtypes it stores.
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Slices = list[tuple[int, torch.Tensor | bytes]]
"""(offset in the file, bytes to write there): one rank's range, copied to the host."""


@dataclass(frozen=True)
class TensorFile:
    """The layout of a safetensors file: its header, and where each tensor's bytes lie."""

    head: bytes
    spans: dict[str, tuple[int, int]]  # name -> [start, end) in the file
    size: int

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> TensorFile:
        header: dict = {"__metadata__": metadata} if metadata else {}
        offsets, at = {}, 0
        for name in sorted(tensors):
            t = tensors[name]
            nbytes = t.numel() * t.element_size()
            header[name] = {
                "dtype": DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [at, at + nbytes],
            }
            offsets[name] = (at, at + nbytes)
            at += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
        head = struct.pack("<Q", len(raw)) + raw
        spans = {name: (len(head) + a, len(head) + b) for name, (a, b) in offsets.items()}
        return cls(head, spans, len(head) + at)

    def share(self, rank: int, world_size: int) -> tuple[int, int]:
        """Rank `rank`'s byte range: 1/W of the file, the header included in rank 0's."""
        return self.size * rank // world_size, self.size * (rank + 1) // world_size

    @property
    def names(self) -> list[str]:
        """The tensors in the file's order."""
        return list(self.spans)

    def slices(
        self,
        items: Iterable[tuple[str, torch.Tensor]],
        lo: int,
        hi: int,
        copy: Callable[[torch.Tensor], torch.Tensor],
    ) -> Slices:
        """The bytes of [lo, hi), from `items`: every tensor of the file, in its order (a
        ZeRO-3 source gathers each as it is reached, every rank taking part). `copy` keeps the
        part of a tensor that falls in the range: a host copy made now, for a write after the
        state changes or the tensor is gone; or the part itself, which write_slices brings to
        the host one part at a time."""
        out: Slices = []
        if lo < len(self.head):
            out.append((lo, self.head[lo : min(hi, len(self.head))]))
        for name, tensor in items:
            a, b = self.spans[name]
            start, end = max(a, lo), min(b, hi)
            if start >= end:
                continue
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            out.append((start, copy(raw[start - a : end - a])))
        return out


def write_slices(path: Path, slices: Slices, lo: int, hi: int) -> list:
    """Write a rank's range into `path` (made if missing; other ranks write the rest of it)
    and sync it; return [lo, hi, sha256 of the range]."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        at = lo
        for offset, data in slices:
            view = memoryview(data if isinstance(data, bytes) else data.cpu().numpy()).cast("B")
            assert offset == at, "the slices of a range are contiguous"
            digest.update(view)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            at = offset
        assert at == hi, "the slices cover the range"
        os.fsync(fd)
    finally:
        os.close(fd)
    return [lo, hi, digest.hexdigest()]


def slice_bytes(slices: Slices) -> int:
    return sum(len(d) if isinstance(d, bytes) else d.numel() for _, d in slices)
