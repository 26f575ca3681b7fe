"""Position information added to the token embeddings (§3.5).

Both kinds map (T, start) to the (T, D) encodings of positions start .. start + T - 1; `start`
is the number of positions already decoded when decoding incrementally.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class _Positions(nn.Module):
    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len

    def _check(self, T: int, start: int) -> None:
        if start + T > self.max_len:
            raise ValueError(
                f"sequence of {start + T} tokens is longer than model.max_len ({self.max_len}); "
                "shorten the input or raise model.max_len"
            )


class SinusoidalPositions(_Positions):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)) (§3.5).
    concat: the same sines in the first half of the dimensions and the cosines in the second
    (tensor2tensor's, fairseq's and Marian's layout; an imported model's)."""

    def __init__(self, d_model: int, max_len: int, concat: bool = False):
        super().__init__(d_model, max_len)
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]  # (max_len, 1)
        inv_freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model)
        )  # (ceil(D/2),) = 1 / 10000^(2i/d)
        pe = torch.zeros(max_len, d_model)
        sines, cosines = torch.sin(pos * inv_freq), torch.cos(pos * inv_freq)[:, : d_model // 2]
        if concat:
            pe[:, : sines.size(1)], pe[:, sines.size(1) :] = sines, cosines
        else:
            pe[:, 0::2], pe[:, 1::2] = sines, cosines
        # A pure function of the config: not saved in checkpoints, rebuilt on load.
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, T: int, start: int = 0) -> torch.Tensor:
        self._check(T, start)
        return self.pe[start : start + T]  # (T, D)


class LearnedPositions(_Positions):
    """One learned vector per position (the alternative of §3.5, Table 3 row E)."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__(d_model, max_len)
        # Per-entry variance 1/2 matches the sinusoids they replace (mean of sin^2 is 1/2).
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.5**0.5)

    def forward(self, T: int, start: int = 0) -> torch.Tensor:
        self._check(T, start)
        return self.weight[start : start + T]  # (T, D)


def make_positions(kind: str, d_model: int, max_len: int) -> _Positions:
    if kind in ("sinusoidal", "sinusoidal_concat"):
        return SinusoidalPositions(d_model, max_len, concat=kind == "sinusoidal_concat")
    if kind == "learned":
        return LearnedPositions(d_model, max_len)
    raise ValueError(
        f"model.positions must be sinusoidal, sinusoidal_concat or learned, got {kind!r}"
    )
