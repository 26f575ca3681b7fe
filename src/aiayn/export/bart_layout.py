"""The one table between aiayn's parameter names and the BART-style names of transformers'
MarianMTModel (and OPT's decoder, which shares them), and the d_model permutation between
aiayn's interleaved sinusoid and Marian's [sin | cos]. The HF export (export/hf.py) and the
importer (export/hf_import.py) both read them, one in each direction, so they cannot drift.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Pair(NamedTuple):
    theirs: str  # the BART-style name
    ours: str  # aiayn's name
    part: int  # which of `parts` equal row blocks of ours it is (aiayn fuses q, k, v)
    parts: int


def layer_pairs(ours: str, theirs: str, n: int, cross: bool) -> list[Pair]:
    """Every weight and bias of n layers `ours`.layers.i (encoder, decoder) under the names
    `theirs`.layers.i (model.encoder, model.decoder). Attention biases are listed whether or not
    the model has them (model.attention_bias): BART-style layers always do."""
    pairs: list[Pair] = []

    def linear(t: str, o: str, part: int = 0, parts: int = 1) -> None:
        pairs.extend(Pair(f"{t}.{p}", f"{o}.{p}", part, parts) for p in ("weight", "bias"))

    for i in range(n):
        s, t = f"{ours}.layers.{i}", f"{theirs}.layers.{i}"
        for k, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            linear(f"{t}.self_attn.{proj}", f"{s}.self_attn.qkv", k, 3)
        linear(f"{t}.self_attn.out_proj", f"{s}.self_attn.out")
        linear(
            f"{t}.self_attn_layer_norm", f"{s}.res_{'self' if ours == 'decoder' else 'attn'}.norm"
        )
        if cross:
            linear(f"{t}.encoder_attn.q_proj", f"{s}.cross_attn.q")
            linear(f"{t}.encoder_attn.k_proj", f"{s}.cross_attn.kv", 0, 2)
            linear(f"{t}.encoder_attn.v_proj", f"{s}.cross_attn.kv", 1, 2)
            linear(f"{t}.encoder_attn.out_proj", f"{s}.cross_attn.out")
            linear(f"{t}.encoder_attn_layer_norm", f"{s}.res_cross.norm")
        linear(f"{t}.fc1", f"{s}.ffn.w_1")
        linear(f"{t}.fc2", f"{s}.ffn.w_2")
        linear(f"{t}.final_layer_norm", f"{s}.res_ffn.norm")
    return pairs


def is_attention_bias(pair: Pair) -> bool:
    return pair.ours.endswith(".bias") and (
        ".self_attn." in pair.ours or ".cross_attn." in pair.ours
    )


def to_theirs(w: dict[str, torch.Tensor], pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """The BART-style tensors of `pairs` from aiayn's `w`; an attention bias the model lacks
    is zeros."""
    out = {}
    for p in pairs:
        t = w.get(p.ours)
        if t is None and is_attention_bias(p):
            rows = w[p.ours.removesuffix(".bias") + ".weight"].size(0) // p.parts
            out[p.theirs] = torch.zeros(rows)
        else:
            out[p.theirs] = t.chunk(p.parts)[p.part]
    return out


def to_ours(w: dict[str, torch.Tensor], pairs: list[Pair], attention_bias: bool) -> dict:
    """aiayn's tensors of `pairs` from the BART-style `w` (without the attention biases where
    the aiayn model has none)."""
    parts: dict[str, list] = {}
    for p in pairs:
        if attention_bias or not is_attention_bias(p):
            parts.setdefault(p.ours, [None] * p.parts)[p.part] = w[p.theirs]
    return {
        name: torch.cat(blocks) if len(blocks) > 1 else blocks[0] for name, blocks in parts.items()
    }


# ---- Marian's sinusoid layout ---------------------------------------------------------------


def marian_permutation(d_model: int) -> torch.Tensor:
    """perm with marian[..., k] = project[..., perm[k]]: the even (sin) dimensions, then the
    odd (cos) ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# Which axis of each Marian tensor is the residual stream's (d_model): the columns of what reads
# it, the rows of what writes it, and the LayerNorms. The head dimensions inside attention, the
# FFN's inner dimension and the vocabulary keep their order.
_READ_RESIDUAL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "fc1.weight")
_READ_RESIDUAL += ("embed_tokens.weight", "embed_positions.weight", "shared.weight")
_READ_RESIDUAL += ("lm_head.weight",)
_WRITE_RESIDUAL = ("out_proj.weight", "out_proj.bias", "fc2.weight", "fc2.bias")
_WRITE_RESIDUAL += ("layer_norm.weight", "layer_norm.bias")


def permute_residual(name: str, t: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """The Marian tensor `name` with its residual axis taken in the order `perm` (to Marian's
    layout: marian_permutation; back: its inverse, argsort)."""
    if name.endswith(_READ_RESIDUAL):
        return t[:, perm]
    if name.endswith(_WRITE_RESIDUAL):
        return t[perm]
    return t
