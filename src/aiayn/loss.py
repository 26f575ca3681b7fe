"""Batch -> loss. Label smoothing (§5.4) and the per-kind forward call live here."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.data.batch import Batch


def smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float, ignore_index: int = -100
) -> tuple[torch.Tensor, int]:
    """Summed label-smoothed cross-entropy and the number of targets it covers.

    Returning the sum, not the mean, lets the caller divide by the tokens of the whole optimizer
    step (all micro-batches, later all ranks), so accumulation does not change the update.
    """
    logits = logits.reshape(-1, logits.size(-1)).float()  # (N, V); fp32 for a stable log-softmax
    target = target.reshape(-1)  # (N,)
    loss = F.cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=smoothing, reduction="sum"
    )
    return loss, int((target != ignore_index).sum())


def batch_loss(
    model: nn.Module, batch: Batch, kind: str, smoothing: float, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward `batch` through `model`; return (summed loss, correct predictions).

    Pads are ignored in the loss; the denominator is `batch.n_tokens`.
    """
    if kind == "seq2seq":
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
        target = batch.tgt_out
    elif kind == "lm":
        logits = model(batch.tgt_in)  # (B, T, V)
        target = batch.tgt_out
    else:
        logits = model(batch.src)  # (B, C)
        target = batch.labels
        pad_id = -100  # every label counts
    loss, _ = smoothed_cross_entropy(logits, target, smoothing, ignore_index=pad_id)
    with torch.no_grad():
        correct = ((logits.argmax(-1) == target) & (target != pad_id)).sum()
    return loss, correct
