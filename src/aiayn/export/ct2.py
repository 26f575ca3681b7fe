"""Export to CTranslate2 (OpenNMT's C++ inference engine). Filled in by issue 28."""

from __future__ import annotations

from pathlib import Path


def export_ctranslate2(checkpoint: str | Path, output: str | Path, quantization=None) -> Path:
    raise NotImplementedError
