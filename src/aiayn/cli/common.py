"""What every `aiayn` subcommand shares: the config and checkpoint arguments, result printing."""

from __future__ import annotations

import argparse

CONFIG_HELP = "YAML run config (configs/*.yaml)"
OVERRIDES_HELP = "dotted overrides, e.g. train.max_steps=200 model.dropout=0"


def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", help=OVERRIDES_HELP)


def add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        help="run_dir (its latest checkpoint), a step or averaged dir, an exported .safetensors, "
        "or with --engine ctranslate2 a CTranslate2 export directory",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--engine",
        default="torch",
        choices=["torch", "ctranslate2"],
        help="ctranslate2: run a `aiayn export --format ctranslate2` directory (pip install "
        "'aiayn[serve]'); greedy output is the same, but its beam search divides log P by "
        "len^alpha, not GNMT's ((5 + len) / 6)^alpha",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="ctranslate2: CPU threads per batch (default: every core this process may use)",
    )
    p.add_argument(
        "overrides", nargs="*", help="overrides of the checkpoint's config, e.g. decode.beam=1"
    )


def print_result(result: dict, width: int) -> None:
    """One `key: value` line each, keys right-aligned to `width`, floats to 4 decimals."""
    for key, value in result.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:>{width}}: {shown}")
