"""benchmarks/serving.py on a tiny model: every engine's row, and greedy output the same in
aiayn and CTranslate2 float32 (the benchmark's own check of the export)."""

import subprocess
import sys
from pathlib import Path

import pytest
from export_models import write_model

pytest.importorskip("ctranslate2")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "serving.py"


def test_the_serving_table_has_every_engine_and_greedy_hypotheses_agree(tok, corpus, tmp_path):
    weights = write_model(tmp_path / "model", tok, "seq2seq", "post", "sinusoidal")
    args = ["--checkpoint", str(weights), "--src", str(corpus / "test.de")]
    args += ["--ref", str(corpus / "test.en"), "--limit", "8", "--repeats", "1"]
    args += [
        "--threads",
        "1",
        "--beam",
        "2",
        "--batch-size",
        "4",
        "--quantizations",
        "float32,int8",
    ]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.split("| engine |")[-1].splitlines()[2:]:
        cells = [c.strip() for c in line.strip("| ").split("|")]
        rows[(cells[0], cells[1])] = cells
    engines = {"aiayn", "ct2 float32", "ct2 int8"}
    assert set(rows) == {(e, b) for e in engines for b in ("2", "1")}, out.stdout
    for cells in rows.values():
        assert float(cells[3].replace(",", "")) > 0  # target tokens/s
        assert 0 <= float(cells[7]) <= 100  # BLEU
    assert rows[("ct2 float32", "1")][8] == "8/8", out.stdout  # greedy: the same hypotheses
    assert rows[("aiayn", "2")][4] == "1.00x"
