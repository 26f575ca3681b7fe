"""Tiny random models of every exportable variant, written as `aiayn export` files
(FILE.safetensors with its .config.yaml and .tokenizer.model beside it), for the export tests.

Every LayerNorm and bias is moved off its initial value (1 or 0), so that an export which drops
or misplaces one of them scores differently."""

import json
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from aiayn.checkpoint.format import FORMAT_VERSION, weights_snapshot
from aiayn.checkpoint.tools import export_paths
from aiayn.config import load_config
from aiayn.model import build_model
from aiayn.tokenizer import Tokenizer

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
            "model.N=2",
            "model.d_model=32",
            "model.d_ff=64",
            "model.h=4",
            "model.max_len=64",
            "model.dropout=0",
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
    tensors, tied = weights_snapshot(model)
    metadata = dict(tied or {})
    metadata.update(
        aiayn_format=str(FORMAT_VERSION),
        aiayn_step="0",
        aiayn_dtype="fp32",
        aiayn_tokenizer=json.dumps(tok.contract()),
        aiayn_source="tests/unit/export_models.py",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    weights, config, tokenizer = export_paths(out_dir / "model.safetensors")
    save_file(tensors, str(weights), metadata=metadata)
    config.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    shutil.copyfile(tok.path, tokenizer)
    return weights
