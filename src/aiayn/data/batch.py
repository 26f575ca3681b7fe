"""The Batch: what every data path hands the model. One definition, read by all."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass
class Batch:
    """A padded micro-batch. Padding uses the tokenizer's pad id and is always trailing (rows
    are right-padded), which lets the decoder use a fused causal kernel without inspecting the
    tokens; masks are built by the model.

    seq2seq: src (B, S) ends with eos; tgt_in (B, T) = bos + y; tgt_out (B, T) = y + eos.
    lm:      tgt_in (B, T) and tgt_out (B, T) are one packed block shifted by one token.
    classifier: src (B, S) ends with eos; labels (B,).
    """

    ids: torch.Tensor
    """(B,) int64: index of each example in the stream, for tracking what was consumed."""
    n_tokens: int
    """Non-pad target tokens (seq2seq, lm) or examples (classifier): the loss's denominator."""
    src: torch.Tensor | None = None
    tgt_in: torch.Tensor | None = None
    tgt_out: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    """(N,) int64, N = n_tokens: the flat positions in tgt_out (B * T, row-major) of the
    non-pad targets, which the model projects and the loss scores (loss.batch_loss). Made on
    the host with the batch (target_positions): found on the device, the count N would make the
    host wait for the GPU."""
    sources: torch.Tensor | None = None
    """(B,) int64: the data.sources index each example comes from (a mixture; None for
    data.train). With ids, what identifies an example (ids count within each source)."""

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def to(self, device: torch.device | str) -> Batch:
        """The model's tensors on `device`; host-only fields (ids) stay where they are. From
        pinned memory (pin_memory()) a CUDA copy is asynchronous: it overlaps the work already
        queued on the device instead of waiting for it."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """The model's tensors in page-locked host memory (needs CUDA)."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> Batch:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            use = torch.is_tensor(value) and f.name not in HOST_ONLY
            out[f.name] = fn(value) if use else value
        return Batch(**out)


HOST_ONLY = frozenset({"ids", "sources"})
"""Fields the model never reads: they are not copied to the device (`ids` and `sources` only
record what was consumed, and are read on the host)."""


def resolve_pad_to_multiple(setting: int | None, device: torch.device) -> int:
    """data.pad_to_multiple for a run on `device`: auto (None) is 8 on CUDA, where tensor cores
    want it and compiled graphs are worth sparing, and 1 on CPU, whose batches stay as they were."""
    if setting is not None:
        return setting
    return 8 if device.type == "cuda" else 1


def round_width(width, multiple: int, limit: int):
    """Widths (an int or an array) rounded up to a multiple of `multiple`, but never past
    `limit` (the widest row the data allows, which the model's position table has room for) or
    below the width itself. Fewer distinct shapes mean fewer compiled graphs, and tensor cores
    want multiples of 8."""
    if multiple == 1:
        return width
    rounded = -(-width // multiple) * multiple
    return np.maximum(np.minimum(rounded, limit), width)


def target_positions(tgt_out: torch.Tensor, pad: int) -> torch.Tensor:
    """Batch.keep: the flat positions of tgt_out's non-pad entries, in row-major order, as
    boolean indexing by tgt_out != pad would take them. It runs where tgt_out is: the loaders
    call it on the host, as they build the batch."""
    return (tgt_out.reshape(-1) != pad).nonzero().squeeze(1)  # (N,)
