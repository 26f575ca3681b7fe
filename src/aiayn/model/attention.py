"""Multi-head attention (§3.2) on top of fused scaled dot-product attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def split_heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """(B, T, D) -> (B, h, T, d_k) with d_k = D / h (§3.2.2)."""
    B, T, D = x.shape
    return x.view(B, T, h, D // h).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, h, T, d_k) -> (B, T, h * d_k): the Concat(head_1, ..., head_h) of §3.2.2."""
    B, h, T, d_k = x.shape
    return x.transpose(1, 2).reshape(B, T, h * d_k)


@dataclass
class KVCache:
    """Keys and values one attention layer has already computed, for incremental decoding."""

    k: torch.Tensor | None = None  # (B, h, t, d_k)
    v: torch.Tensor | None = None  # (B, h, t, d_k)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` of the batch dimension (beam search follows surviving hypotheses)."""
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)


class _Attention(nn.Module):
    """What self- and cross-attention share: heads, SDPA, and the output projection W^O."""

    def __init__(self, d_model: int, h: int, attention_dropout: float, bias: bool = False):
        super().__init__()
        self.h = h
        self.attention_dropout = attention_dropout
        # No biases on W^Q, W^K, W^V, W^O, as in §3.2.2, unless model.attention_bias (Marian's
        # models have them). A key bias is worse than useless: softmax ignores it, so its
        # gradient is rounding noise that Adam (eps 1e-9) rescales into full-size steps.
        self.bias = bias
        self.out = nn.Linear(d_model, d_model, bias=bias)  # W^O

    def attend(self, q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        # softmax(QK^T / sqrt(d_k)) V (§3.2.1); SDPA picks a fused kernel where it can.
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=is_causal,
        )  # (B, h, T, d_k)
        return self.out(merge_heads(y))  # (B, T, D)

    @staticmethod
    def _xavier_per_matrix(linear: nn.Linear, n: int) -> None:
        # A fused projection is n stacked (D, D) matrices; initialise each as its own Linear
        # would be, rather than by the fan of the (n*D, D) stack.
        for w in linear.weight.chunk(n, dim=0):
            nn.init.xavier_uniform_(w)


class SelfAttention(_Attention):
    """Queries, keys and values all from x, through one fused Linear(D, 3D)."""

    def __init__(self, d_model: int, h: int, attention_dropout: float = 0.0, bias: bool = False):
        super().__init__(d_model, h, attention_dropout, bias)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)  # W^Q, W^K, W^V, stacked

    def reset_fused(self) -> None:
        self._xavier_per_matrix(self.qkv, 3)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (B, T, D)
        q, k, v = (split_heads(t, self.h) for t in (q, k, v))  # (B, h, T, d_k)
        if cache is not None:
            if cache.k is not None:  # append this step's keys/values to the earlier ones
                k = torch.cat([cache.k, k], dim=2)  # (B, h, t + T, d_k)
                v = torch.cat([cache.v, v], dim=2)
            cache.k, cache.v = k, v
        return self.attend(q, k, v, mask, is_causal)


class CrossAttention(_Attention):
    """Queries from the decoder, keys and values from the encoder output (memory, §3.2.3)."""

    def __init__(self, d_model: int, h: int, attention_dropout: float = 0.0, bias: bool = False):
        super().__init__(d_model, h, attention_dropout, bias)
        self.q = nn.Linear(d_model, d_model, bias=bias)  # W^Q
        self.kv = nn.Linear(d_model, 2 * d_model, bias=bias)  # W^K, W^V of the memory

    def reset_fused(self) -> None:
        self._xavier_per_matrix(self.kv, 2)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        if cache is not None and cache.k is not None:
            k, v = cache.k, cache.v  # the memory does not change while decoding: computed once
        else:
            k, v = self.kv(memory).chunk(2, dim=-1)  # 2 x (B, S, D)
            k, v = split_heads(k, self.h), split_heads(v, self.h)  # (B, h, S, d_k)
            if cache is not None:  # contiguous, as they stay when sentences leave the batch
                cache.k, cache.v = k.contiguous(), v.contiguous()
        # Decoding may feed G rows per source sentence (beam search's hypotheses: row b * G + g
        # belongs to sentence b). They share its keys and values, which are then computed and
        # kept once: the G rows attend as G * T queries of it. Training has G = 1 (views only).
        B, T, D = x.shape
        q = split_heads(self.q(x.reshape(k.size(0), -1, D)), self.h)  # (B / G, h, G * T, d_k)
        return self.attend(q, k, v, mask, is_causal=False).view(B, T, D)
