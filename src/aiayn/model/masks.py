"""The one place attention masks are built.

Masks are bool and True means "may attend", the convention of
`torch.nn.functional.scaled_dot_product_attention`. They broadcast to (B, h, T_q, T_k).
"""

from __future__ import annotations

import torch


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, S) ids -> (B, 1, 1, S): True where the key is a real token (not padding)."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(T: int, S: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """(T, S): T queries, the last T of S positions, each see keys up to their own (§3.2.3)."""
    S = T if S is None else S
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def self_attention_mask(
    tokens: torch.Tensor, pad_id: int, start: int = 0, right_padded: bool = True
) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for causal self-attention over `tokens` (B, T) after `start` cached ones.

    right_padded=True promises that any padding is trailing, as the loader makes it (Batch):
    then no real query lies after a pad key, causality alone hides the pads, and SDPA can use
    its fused causal kernel with no mask. A promise rather than a check of the tokens: a check
    is a host sync per forward. right_padded=False (left or inner padding) builds the combined
    causal & padding mask.
    """
    T = tokens.size(1)
    if start > 0:
        # Incremental decoding: every cached key is in the past of the new queries, so one new
        # token needs no mask; several need a causal mask shifted by `start`. The tokens fed
        # incrementally must hold no padding (decode.py never feeds any).
        return (None, False) if T == 1 else (causal_mask(T, start + T, tokens.device), False)
    if right_padded:
        return None, True
    # A query may always see itself, so a pad query never has an all-False row (which gives NaN
    # that would then leak into later layers through its value vector).
    eye = torch.eye(T, dtype=torch.bool, device=tokens.device)
    keep = (tokens != pad_id)[:, None, None, :] | eye  # (B, 1, T, T)
    return causal_mask(T, device=tokens.device) & keep, False
