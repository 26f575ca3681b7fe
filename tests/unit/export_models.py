"""Tiny random models of every exportable variant, written as `aiayn export` files
(FILE.safetensors with its .config.yaml and .tokenizer.model beside it), for the export tests.

Every LayerNorm and bias is moved off its initial value (1 or 0), so that an export which drops
or misplaces one of them scores differently."""

from pathlib import Path

import torch

from aiayn.checkpoint.average import export_module
from aiayn.config import load_config
from aiayn.model import build_model
from aiayn.tokenizer import Tokenizer

from helpers import TWO_LAYER_MODEL, model_overrides  # tests/helpers.py

VARIANTS = [
    (kind, norm, positions)
    for kind in ("seq2seq", "lm")
    for norm in ("post", "pre")
    for positions in ("sinusoidal", "learned")
]
"""(model.kind, model.norm, model.positions) of the 8 variants the project trains."""


def variant_id(variant) -> str:
    return "-".join(variant)


def write_model(
    out_dir: Path,
    tok: Tokenizer,
    kind: str = "seq2seq",
    norm: str = "post",
    positions: str = "sinusoidal",
    *overrides: str,
    seed: int = 0,
) -> Path:
    """A random model of this variant (2 layers, d_model 32, 4 heads, max_len 64, embeddings
    shared as share_embeddings=all unless overridden) exported to out_dir/model.safetensors."""
    cfg = load_config(
        None,
        [
            f"run_dir={out_dir}",
            f"model.kind={kind}",
            f"model.norm={norm}",
            f"model.positions={positions}",
            *model_overrides(TWO_LAYER_MODEL, dropout=0),
            "data.train=unused",
            f"data.format={'parallel' if kind == 'seq2seq' else 'text'}",
            "data.max_len=60",
            f"tokenizer.path={tok.path}",
            *overrides,
        ],
    )
    torch.manual_seed(seed)
    model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return export_module(model, cfg.to_dict(), tok, out_dir / "model.safetensors")
