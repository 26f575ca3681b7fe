"""What every export format reads: a checkpoint's config, fp32 weights and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.config import Config
from aiayn.errors import ExportError
from aiayn.model.positions import SinusoidalPositions
from aiayn.tokenizer import Tokenizer


@dataclass
class ExportSource:
    cfg: Config
    """The run's resolved config (model.kind is seq2seq or lm)."""
    weights: dict[str, torch.Tensor]
    """Every name of the model's state_dict, fp32 on the CPU; a tied matrix under each name."""
    tokenizer: Tokenizer
    checkpoint: Path
    """The checkpoint read (a step or averaged dir, or an exported .safetensors)."""


def load_source(checkpoint: str | Path) -> ExportSource:
    """Read `checkpoint` as `aiayn translate` would (a run_dir's latest valid checkpoint, a step
    or averaged dir, or FILE.safetensors), verified against its tokenizer's contract."""
    from aiayn.checkpoint.inference import load_for_inference

    cfg, model, tok, ckpt = load_for_inference(checkpoint, (), "cpu")
    if cfg.model.kind not in ("seq2seq", "lm"):
        raise ExportError(
            f"{ckpt} is a {cfg.model.kind} model: the export formats serve translation (seq2seq) "
            "and language models (lm); use --format safetensors for a classifier"
        )
    weights = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return ExportSource(cfg=cfg, weights=weights, tokenizer=tok, checkpoint=ckpt)


def sinusoid_table(d_model: int, rows: int, positions: str = "sinusoidal") -> torch.Tensor:
    """(rows, d_model) encodings of positions 0 .. rows - 1, in the model's layout
    (model.positions: sinusoidal, sin and cos interleaved as in §3.5; sinusoidal_concat, the
    sines then the cosines), for engines whose own table differs."""
    return SinusoidalPositions(d_model, rows, concat=positions == "sinusoidal_concat").pe.clone()
