"""benchmarks/cpu_precision.py: both precisions measured on the same batches, fp32 the base."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "cpu_precision.py"


def test_the_table_gives_each_precision_and_the_ratio_to_fp32():
    args = ["--presets", "tiny", "--vocab", "500", "--max-tokens", "600"]
    # A 256^3 peak: at the default 2048^3, emulated bf16 (no AVX512-BF16) takes minutes.
    args += ["--batches", "1", "--repeats", "2", "--warmup", "1", "--matmul-size", "256"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    assert "train.precision=auto chooses" in out.stdout
    assert "matmul peak (256^3): fp32 " in out.stdout
    rows = {}
    for line in out.stdout.split("| preset |")[-1].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("| ").split("|")]
        rows[cells[1]] = cells
    assert set(rows) == {"fp32", "bf16"}, out.stdout
    assert rows["fp32"][4] == "1.00x"
    assert float(rows["bf16"][4].rstrip("x")) > 0
    assert all(float(c[2].replace(",", "")) > 0 for c in rows.values())
