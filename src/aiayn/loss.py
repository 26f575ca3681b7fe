"""Batch -> loss. Label smoothing (§5.4) and the per-kind forward call live here."""

from __future__ import annotations

import torch
from torch import nn

from aiayn.data.batch import Batch


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy of logits (N, V) against targets (N,), and each row's
    argmax, in one function with a hand-written backward.

    F.cross_entropy(label_smoothing=) keeps the log-softmax (N, V), then builds its gradient
    from a zero-filled one-hot, a broadcast smoothing term, their sum and a log-softmax backward:
    about seven passes over (N, V) and four (N, V) allocations, plus another pass for the
    logged accuracy's argmax. Here the forward takes the row max (with its argmax, which the
    accuracy reuses) and a log-sum-exp; the backward writes softmax - q in one allocation.
    The 8k-vocabulary output is half the FLOPs of the `small` model, so this is ~7% of a CPU
    step (benchmarks/README.md).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
        best, argmax = logits.max(dim=1)  # (N,), (N,)
        lse = (logits - best[:, None]).exp_().sum(dim=1).log_().add_(best)  # log Σ_j e^x_j
        # With q = (1 - eps) one_hot(t) + eps / V, -Σ_j q_j log p_j is
        # lse - (1 - eps) x_t - eps * mean_j x_j.
        picked = logits.gather(1, target[:, None]).squeeze(1)  # x_t (N,)
        loss = (lse - (1.0 - smoothing) * picked - smoothing * logits.mean(dim=1)).sum()
        ctx.save_for_backward(logits, target, lse)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_argmax: torch.Tensor | None):
        logits, target, lse = ctx.saved_tensors
        eps, V = ctx.smoothing, logits.size(1)
        grad = (logits - lse[:, None]).exp_()  # softmax (N, V)
        grad.sub_(eps / V)
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, target] -= 1.0 - eps  # minus q, whose one-hot part sits at the target
        return grad.mul_(grad_loss), None, None


def smoothed_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label-smoothed cross-entropy over rows logits (N, V) against target (N,), and the
    model's prediction (argmax) for each row. Every row counts: the caller leaves out padding
    before the output projection, which then skips it too (see batch_loss).

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
    only at non-pad targets (`keep`), so neither the output layer nor the loss spends work on
    padding.
    """
    if kind == "classifier":
        logits, target = model(batch.src), batch.labels  # (B, C), (B,)
    else:
        keep = batch.tgt_out != pad_id  # (B, T)
        if kind == "seq2seq":
            logits = model(batch.src, batch.tgt_in, keep=keep)  # (N, V)
        else:
            logits = model(batch.tgt_in, keep=keep)  # (N, V)
        target = batch.tgt_out[keep]  # (N,)
    loss, predicted = smoothed_cross_entropy(logits, target, smoothing)
    return loss, (predicted == target).sum()
