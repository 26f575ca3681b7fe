"""A checkpoint loaded for inference: the model rebuilt from the checkpoint's own config (plus
overrides), its weights loaded and checked against the tokenizer's contract. What translate,
evaluate, generate and the exports read a checkpoint with."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from aiayn.checkpoint.format import check_architecture
from aiayn.checkpoint.init_from import load_weights
from aiayn.checkpoint.locate import Located, locate
from aiayn.config import Config, apply_override, config_from_dict
from aiayn.model import build_model
from aiayn.tokenizer import Tokenizer, check_contract


def load_for_inference(
    checkpoint: str | Path | Located,
    overrides: list[str] = (),
    device: str | torch.device = "auto",
) -> tuple[Config, nn.Module, Tokenizer, Path]:
    """Rebuild a model from a checkpoint's own config (plus overrides) and load its weights.

    `checkpoint`: a run_dir (its latest valid checkpoint), a step or averaged checkpoint
    directory, or a FILE.safetensors written by `aiayn export`; or what `locate` found of one
    (verified by one rank for all: `aiayn translate --input` on W ranks).
    """
    from aiayn.distributed.env import pick_device

    found = checkpoint if isinstance(checkpoint, Located) else locate(checkpoint)
    raw, where, ckpt = copy.deepcopy(found.config), found.where, found.checkpoint
    for item in overrides:
        apply_override(raw, item)
    cfg = config_from_dict(raw, source=where)
    tok_path = found.tokenizer
    if tok_path is None or any(o.startswith("tokenizer.path=") for o in overrides):
        tok_path = cfg.tokenizer_path
    tok = Tokenizer(tok_path)
    check_contract(found.contract, tok, where=where)
    check_architecture(found.config["model"], dataclasses.asdict(cfg.model), where)
    model = build_model(cfg.model, tok.vocab_size, tok.pad_id)
    load_weights(model, found)
    where = device if isinstance(device, torch.device) else pick_device(device, 0, "--device")
    model.to(where).eval()
    return cfg, model, tok, ckpt
