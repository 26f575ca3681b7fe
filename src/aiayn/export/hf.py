"""Export to Hugging Face transformers (MarianMT, OPT). Filled in by issue 28."""

from __future__ import annotations

from pathlib import Path


def export_hf(checkpoint: str | Path, output: str | Path, dtype: str = "fp32") -> Path:
    raise NotImplementedError
