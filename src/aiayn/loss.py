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
    about seven passes over (N, V) and four (N, V) allocations in main memory, plus another
    pass for the logged accuracy's argmax. Here the forward takes the row max (with the argmax
    the accuracy reuses) and a log-sum-exp; the backward writes softmax - q into one
    allocation. Both walk the rows in blocks of ROWS (8 MB of fp32 logits at V = 8000), so that
    every pass after a block's first read hits the cache. On a 2-core CPU this is 0.6x the time
    of F.cross_entropy plus argmax, for (3600, 8000) logits (benchmarks/README.md).
    """

    ROWS = 256

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, smoothing: float):
        N, rows = logits.size(0), _SmoothedCrossEntropy.ROWS
        lse = logits.new_empty(N)  # log Σ_j e^x_j per row
        total = logits.new_empty(N)  # Σ_j x_j per row
        argmax = torch.empty(N, dtype=torch.long, device=logits.device)
        blocks = (t.split(rows) for t in (logits, lse, total, argmax))
        for x, x_lse, x_sum, x_argmax in zip(*blocks, strict=True):
            best, index = x.max(dim=1)
            x_argmax.copy_(index)
            torch.sum(torch.sub(x, best[:, None]).exp_(), dim=1, out=x_lse)
            x_lse.log_().add_(best)
            torch.sum(x, dim=1, out=x_sum)
        # With q = (1 - eps) one_hot(t) + eps / V, -Σ_j q_j log p_j is
        # lse - (1 - eps) x_t - eps * mean_j x_j.
        picked = logits.gather(1, target[:, None]).squeeze(1)  # x_t (N,)
        V = logits.size(1)
        loss = (lse - (1.0 - smoothing) * picked - (smoothing / V) * total).sum()
        ctx.save_for_backward(logits, target, lse)
        ctx.smoothing = smoothing
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_argmax: torch.Tensor | None):
        logits, target, lse = ctx.saved_tensors
        eps, V, rows = ctx.smoothing, logits.size(1), _SmoothedCrossEntropy.ROWS
        grad = torch.empty_like(logits)
        blocks = (t.split(rows) for t in (logits, lse, grad))
        for x, x_lse, x_grad in zip(*blocks, strict=True):
            # (softmax - eps / V) * g; the one-hot part of q follows
            torch.sub(x, x_lse[:, None], out=x_grad).exp_().sub_(eps / V).mul_(grad_loss)
        index = torch.arange(grad.size(0), device=grad.device)
        grad[index, target] -= (1.0 - eps) * grad_loss
        return grad, None, None


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
