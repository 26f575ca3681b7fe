"""Dropout (§5.4) with a mask that is cheap to draw on a CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_INT16_VALUES = 1 << 16


class Dropout(nn.Module):
    """Zero each element with probability p and scale the rest by 1 / (1 - p), as nn.Dropout.

    On a GPU, and under torch.compile, this is F.dropout (a fused kernel). On a CPU, nn.Dropout
    draws one random number per element through bernoulli_, which was 8% of a CPU training
    step; this mask takes 0.3x its time (benchmarks/kernels.py). One 64-bit draw makes four
    16-bit uniforms, each compared with a threshold: p is rounded to a multiple of 2^-16 (0.1
    becomes 0.100006), the mask is the same in distribution, and it is drawn from torch's
    generator, so seeding, checkpointed-layer replay and resumption treat it like any other
    random op.
    """

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        # int16 values are uniform on [-2^15, 2^15); keep those at or above this threshold.
        # At least one value is kept: a p within 2^-17 of 1 would otherwise round to "drop all"
        # and a scale of 1 / 0.
        dropped = min(round(p * _INT16_VALUES), _INT16_VALUES - 1)
        self._threshold = dropped - (1 << 15)
        self._scale = _INT16_VALUES / (_INT16_VALUES - dropped)  # 1 / P(keep), exactly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        # torch.compile (train.compile) fuses F.dropout with its neighbours and draws the mask
        # in the generated kernel; random_ here would break its graph.
        if x.device.type != "cpu" or torch.compiler.is_compiling():
            return F.dropout(x, self.p, training=True)
        n = x.numel()
        draws = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None)
        keep = draws.view(torch.int16)[:n].view(x.shape) >= self._threshold
        return x * keep * self._scale

    def extra_repr(self) -> str:
        return f"p={self.p}"
