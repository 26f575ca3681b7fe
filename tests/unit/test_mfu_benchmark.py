"""benchmarks/mfu.py is the GPU measurement; CI has no GPU, so its CPU path keeps it working."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "mfu.py"


def test_the_mfu_table_reports_every_preset_with_its_tokens_and_utilisation():
    args = ["--device", "cpu", "--precision", "fp32", "--presets", "tiny", "small"]
    args += ["--quick", "--no-compile", "--vocab", "500", "--max-tokens", "600"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    lines = ("| preset |" + out.stdout.split("| preset |")[-1]).splitlines()
    header = [c.strip() for c in lines[0].strip("| ").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("| ").split("|")), strict=True))
        rows[cells["preset"]] = cells
    assert set(rows) == {"tiny", "small"}, out.stdout
    tokens = {p: float(c["target tokens/s (median)"].replace(",", "")) for p, c in rows.items()}
    for preset, cells in rows.items():
        assert cells["mode"] == "eager" and cells["attention kernel"] == "auto"
        mfu = float(cells["MFU"].rstrip("%"))
        assert tokens[preset] > 0 and 0 < mfu < 200, (preset, cells)
    # The larger model does more work per token. FLOP/s over tokens/s is the work per token,
    # whatever the machine's speed at the time: no timing is compared.
    work = {p: float(c["TFLOP/s"]) / tokens[p] for p, c in rows.items()}
    assert work["small"] > 2 * work["tiny"], work
    assert re.search(r"MFU against [\d.]+ TFLOP/s", out.stdout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: this would benchmark it")
def test_asking_for_cuda_without_one_names_the_cpu_option():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "--device cpu" in out.stderr
