"""Fine-tuning an imported MarianMT model: init.source names the Hugging Face directory itself,
which the first start imports into the run. It trains (the loss falls), resumes bitwise after a
kill -9, is scored by `aiayn evaluate` with beam search, and exports to CTranslate2 with the
same greedy output. The directory is built by tests/unit/marian_build.py in the benchmarks'
venv (transformers never enters this one)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_venv import ROOT, require_bench_venv, run_in_bench_venv  # tests/
from test_init_source import kill_at_step, start  # tests/e2e, beside this file

from aiayn.checkpoint.inference import load_for_inference
from aiayn.eval.evaluate import evaluate
from aiayn.export import export_model
from aiayn.infer.translate import translate

from helpers import scalars, weights_at  # tests/helpers.py

BUILDER = ROOT / "tests" / "unit" / "marian_build.py"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def marian_dir(numbers, tmp_path_factory) -> Path:
    """A random swish MarianMT with tied embeddings, tokenizers trained on the corpus (de, en)."""
    require_bench_venv("build a MarianMT directory")
    root = tmp_path_factory.mktemp("marian")
    spec = {
        "corpus": str(numbers),
        "root": str(root),
        "variants": [
            {"name": "opus", "activation": "swish", "tie": True, "weights": "safetensors"}
        ],
        "src_texts": ["zwei"],
        "tgt_texts": ["two"],
        "max_len_b": 2,
    }
    (root / "spec.json").write_text(json.dumps(spec))
    run_in_bench_venv(BUILDER, "build", str(root / "spec.json"), str(root / "r.json"))
    return root / "opus"


def tune(run_dir: Path, corpus: Path, source: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"init.source={source}",
        f"data.train={corpus}/train",
        "data.src_lang=de",
        "data.tgt_lang=en",
        "data.max_len=40",
        "train.max_tokens=800",
        "train.threads=1",
        "train.label_smoothing=0.0",
        "logging.every_steps=1",
        "logging.peak_tflops=0.1",
        "schedule.warmup=10",
        "train.deterministic=true",
        *extra,
    ]


def test_an_imported_marian_model_fine_tunes_resumes_and_serves(marian_dir, numbers, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    extra = ("train.max_steps=30", "checkpoint.every_steps=10")
    start(tune(straight, numbers, marian_dir, *extra))
    assert (straight / "init_source" / "imported.safetensors").is_file()
    loss = scalars(straight, "train/loss")
    assert sum(loss[s] for s in range(26, 31)) / 5 < 0.7 * loss[1]  # seen: 5.17 -> 3.1

    overrides = tune(killed, numbers, marian_dir, *extra)
    kill_at_step(overrides, tmp_path, killed, 14)
    start(overrides)
    a, b = weights_at(straight, 30), weights_at(killed, 30)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    scores = evaluate(straight, "test", [f"data.test={numbers}/test", "decode.beam=4"])
    assert 0 <= scores["bleu"] <= 100

    ct2 = pytest.importorskip("ctranslate2")
    from aiayn.export.ct2_runtime import translate_ct2

    out = export_model(straight, tmp_path / "ct2", "ctranslate2")
    lines = (numbers / "test.de").read_text().splitlines()[:8]
    cfg, model, tok, _ = load_for_inference(straight, ["decode.beam=1"], "cpu")
    ours = translate(model, tok, lines, cfg.decode, torch.device("cpu"))
    assert ours == translate_ct2(out, lines, ["decode.beam=1"], threads=1)
    assert ct2 is not None and any(ours)


def test_the_import_command_then_init_source_is_the_same_start(marian_dir, numbers, tmp_path):
    imported = tmp_path / "opus.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "aiayn", "import-hf", str(marian_dir), "--output", str(imported)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    one, two = tmp_path / "one", tmp_path / "two"
    start(tune(one, numbers, marian_dir, "train.max_steps=2"))
    start(tune(two, numbers, imported, "train.max_steps=2"))
    assert scalars(one, "train/loss")[1] == scalars(two, "train/loss")[1]
