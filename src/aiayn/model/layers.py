"""Encoder and decoder layers (§3.1): attention and feed-forward sublayers with residuals."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.config import ModelConfig
from aiayn.model.attention import CrossAttention, KVCache, SelfAttention
from aiayn.model.dropout import Dropout

ACTIVATIONS = {"relu": torch.relu, "swish": F.silu}  # swish: x * sigmoid(x) (Marian's)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position alike (§3.3); with
    activation swish, x W_1 + b_1 goes through x * sigmoid(x) instead."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu"):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.activation(self.w_1(x)))  # (B, T, d_ff) -> (B, T, D)


class Residual(nn.Module):
    """A sublayer with its residual connection, dropout (§5.4) and layer norm.

    post (the paper, §3.1): LayerNorm(x + Dropout(Sublayer(x)))
    pre:                    x + Dropout(Sublayer(LayerNorm(x))); the stack ends in a LayerNorm.
    """

    def __init__(self, d_model: int, dropout: float, norm: str):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre = norm == "pre"

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]):
        if self.pre:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class EncoderLayer(nn.Module):
    """Self-attention over the whole source, then the FFN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, drop, norm = cfg.d_model, cfg.dropout, cfg.norm
        self.self_attn = SelfAttention(d, cfg.h, cfg.attention_dropout, cfg.attention_bias)
        self.ffn = FeedForward(d, cfg.d_ff, cfg.activation)
        self.res_attn = Residual(d, drop, norm)
        self.res_ffn = Residual(d, drop, norm)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.res_attn(x, lambda y: self.self_attn(y, mask=mask))  # (B, S, D)
        return self.res_ffn(x, self.ffn)  # (B, S, D)


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder output, then the FFN (§3.1).

    With cross=False (the decoder-only LM) the middle sublayer is left out.
    """

    def __init__(self, cfg: ModelConfig, cross: bool = True):
        super().__init__()
        d, drop, norm = cfg.d_model, cfg.dropout, cfg.norm
        att = (cfg.h, cfg.attention_dropout, cfg.attention_bias)
        self.self_attn = SelfAttention(d, *att)
        self.res_self = Residual(d, drop, norm)
        self.cross_attn = CrossAttention(d, *att) if cross else None
        self.res_cross = Residual(d, drop, norm) if cross else None
        self.ffn = FeedForward(d, cfg.d_ff, cfg.activation)
        self.res_ffn = Residual(d, drop, norm)

    def forward(
        self,
        x: torch.Tensor,
        self_mask: torch.Tensor | None,
        is_causal: bool,
        memory: torch.Tensor | None = None,
        src_mask: torch.Tensor | None = None,
        self_cache: KVCache | None = None,
        cross_cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = self.res_self(x, lambda y: self.self_attn(y, self_mask, is_causal, self_cache))
        if self.cross_attn is not None:
            x = self.res_cross(x, lambda y: self.cross_attn(y, memory, src_mask, cross_cache))
        return self.res_ffn(x, self.ffn)  # (B, T, D)
