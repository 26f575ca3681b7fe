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

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def to(self, device: torch.device | str) -> Batch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device, non_blocking=True) if torch.is_tensor(value) else value
        return Batch(**moved)


def target_positions(tgt_out: torch.Tensor, pad: int) -> torch.Tensor:
    """Batch.keep: the flat positions of tgt_out's non-pad entries, in row-major order, as
    boolean indexing by tgt_out != pad would take them. It runs where tgt_out is: the loaders
    call it on the host, as they build the batch."""
    return (tgt_out.reshape(-1) != pad).nonzero().squeeze(1)  # (N,)


def padded_rows(
    flat: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    pad: int,
    bos: int | None = None,
    eos: int | None = None,
) -> torch.Tensor:
    """(B, L) int64 tensor of rows flat[start[i]:start[i] + length[i]], right-padded, optionally
    bos-prefixed and eos-suffixed. `flat` may be a memory map: only these rows are read."""
    off = int(bos is not None)
    width = int(length.max()) + off + int(eos is not None)
    pos = np.arange(width)[None, :] - off  # position of each column inside the ids
    mask = (pos >= 0) & (pos < length[:, None])
    out = np.full((len(length), width), pad, dtype=np.int64)
    out[mask] = flat[(start[:, None] + pos)[mask]]
    if bos is not None:
        out[:, 0] = bos
    if eos is not None:
        out[np.arange(len(length)), length + off] = eos
    return torch.from_numpy(out)
