"""The benchmarks' venv, where transformers lives (it never enters the training venv): the HF
export and import tests run their checkers there (tests/unit/hf_check.py, marian_build.py)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The Makefile's .venv-bench, or another interpreter with transformers: AIAYN_HF_PYTHON.
BENCH_PYTHON = Path(os.environ.get("AIAYN_HF_PYTHON", ROOT / ".venv-bench" / "bin" / "python"))


def require_bench_venv(what: str) -> None:
    """Skip, saying how to make it, where the benchmarks' venv is missing."""
    if not BENCH_PYTHON.is_file():
        pytest.skip(
            f"no {BENCH_PYTHON}: `make .venv-bench/.installed-2.13.0` (make test builds it) "
            f"creates the benchmarks' venv with transformers, to {what}"
        )


def run_in_bench_venv(script: Path, *args: str) -> None:
    """`script ARGS` in the benchmarks' venv; a skip where transformers is missing (exit 3),
    a failure with its stderr where the script fails."""
    proc = subprocess.run(
        [str(BENCH_PYTHON), str(script), *args], capture_output=True, text=True, timeout=600
    )
    if proc.returncode == 3:
        pytest.skip(f"transformers is not installed in {BENCH_PYTHON}: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
