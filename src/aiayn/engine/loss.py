"""Batch -> loss. Label smoothing (§5.4) and the per-kind forward call live here."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.data.batch import Batch, target_positions


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of logits (N, V) against targets (N,), and whether
    each row's largest logit is its target's, with a hand-written backward.

    F.cross_entropy(label_smoothing=) keeps the log-softmax (N, V), then builds its gradient
    from a zero-filled one-hot, a broadcast smoothing term, their sum and a log-softmax backward:
    about seven passes over (N, V) and four (N, V) allocations, plus an argmax for the logged
    accuracy (itself a slow reduction on CPU). Here the forward runs torch's fused softmax once
    and takes the one-hot part of q from it in place; the backward takes the uniform part and
    scales, in one pass. The log-sum-exp comes from the row max m and the softmax's own
    max: max_j p_j = e^(m - lse), which is never below 1/V, so its log is finite. The logits
    are read by two fast reductions (max, sum) and the softmax, and are not kept for the
    backward. `python benchmarks/kernels.py` times it against F.cross_entropy plus argmax
    (benchmarks/README.md).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
        N, V = logits.shape
        best = logits.amax(dim=1)  # m
        total = logits.sum(dim=1)  # Σ_j x_j
        picked = logits.gather(1, target[:, None]).squeeze(1)  # x_t
        grad = torch.softmax(logits, dim=1)
        lse = best - grad.amax(dim=1).log()
        # With q = (1 - eps) one_hot(t) + eps / V, -Σ_j q_j log p_j is
        # lse - (1 - eps) x_t - eps * mean_j x_j.
        loss = (lse - (1.0 - smoothing) * picked - (smoothing / V) * total).sum()
        grad[torch.arange(N, device=grad.device), target] -= 1.0 - smoothing
        ctx.save_for_backward(grad)
        ctx.uniform = smoothing / V
        # Ties at the max count as right; argmax would pick the first of them.
        correct = picked >= best
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor | None):
        # (grad - eps / V) * g in one pass. Not in place: gradcheck and retain_graph=True run
        # backward more than once.
        (grad,) = ctx.saved_tensors
        return torch.addcmul(-ctx.uniform * grad_loss, grad, grad_loss), None, None


def smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy over rows logits (N, V) against target (N,), and for
    each row whether the model's prediction (its largest logit) is the target. Every row counts:
    the caller leaves out padding before the output projection, which then skips it too (see
    batch_loss).

    Returning the sum, not the mean, lets the caller divide by the tokens of the whole optimizer
    step (all micro-batches, later all ranks), so accumulation does not change the update.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # a stable log-sum-exp under autocast
    return _SmoothedCrossEntropy.apply(logits, target, smoothing)


def batch_loss(
    model: nn.Module, batch: Batch, kind: str, smoothing: float, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward `batch` through `model`; return (summed loss, correct predictions).

    The denominator is `batch.n_tokens`. For sequences the model projects to the vocabulary
    only at the non-pad targets (`batch.keep`), so neither the output layer nor the loss spends
    work on padding. Selecting them by position, which the loader found on the host, makes no
    host sync; a batch built without `keep` has them found here, on its device (a GPU sync).
    """
    if kind == "classifier":
        logits, target = model(batch.src), batch.labels  # (B, C), (B,)
    else:
        keep = batch.keep if batch.keep is not None else target_positions(batch.tgt_out, pad_id)
        if kind == "seq2seq":
            logits = model(batch.src, batch.tgt_in, keep=keep)  # (N, V)
        else:
            logits = model(batch.tgt_in, keep=keep)  # (N, V)
        target = batch.tgt_out.reshape(-1).index_select(0, keep)  # (N,)
    loss, correct = smoothed_cross_entropy(logits, target, smoothing)
    return loss, correct.sum()


def grad_free(partitioned: bool = False):
    """No autograd for an evaluation forward: inference_mode, except on ZeRO-3's partitioned
    model, whose forward gathers parameters that inference mode would mark as inference
    tensors, which the training step then may not touch."""
    return torch.no_grad() if partitioned else torch.inference_mode()
