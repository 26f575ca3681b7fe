"""Models that leave the trainer: `aiayn export CHECKPOINT --format FORMAT --output PATH`.

    safetensors   FILE.safetensors, the config and tokenizer beside it (checkpoint/average.py);
                  loaded back by `aiayn translate --checkpoint FILE.safetensors`
    ctranslate2   a CTranslate2 model directory (ct2.py): OpenNMT's C++ engine, int8/int16/fp16
    hf            a Hugging Face transformers directory (hf.py): MarianMT for translation, OPT for
                  the language model; written without importing transformers

Each writes the model exactly: the exported model's log-probabilities equal the project's within
1e-4 (tests/unit/test_export_*.py). What a format cannot express exactly is refused with an
ExportError naming the route that can.
"""

from __future__ import annotations

from pathlib import Path

from aiayn.errors import ExportError

FORMATS = ("safetensors", "ctranslate2", "hf")


def export_model(
    checkpoint: str | Path,
    output: str | Path,
    fmt: str = "safetensors",
    *,
    dtype: str = "fp32",
    quantization: str | None = None,
) -> Path:
    """Write `checkpoint` (a run_dir, a step or averaged checkpoint dir) as `fmt` to `output`;
    returns what was written (the weights file, or the model directory)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: choose from {', '.join(FORMATS)}")
    if quantization is not None and fmt != "ctranslate2":
        raise ExportError("--quantization is for --format ctranslate2")
    if fmt == "safetensors":
        from aiayn.checkpoint.average import export

        return export(checkpoint, output, dtype)
    if Path(output).exists():
        raise ExportError(f"{output} exists: choose another --output, or delete it first")
    if fmt == "ctranslate2":
        from aiayn.export.ct2 import export_ctranslate2

        return export_ctranslate2(checkpoint, output, quantization=quantization)
    from aiayn.export.hf import export_hf

    return export_hf(checkpoint, output, dtype=dtype)
