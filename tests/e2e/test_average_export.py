"""Retention in a real run, checkpoint averaging, and export to one safetensors file."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from aiayn.checkpoint import load_checkpoint, read_manifest
from aiayn.checkpoint.inference import load_for_inference
from aiayn.config import load_config
from aiayn.errors import CheckpointError
from aiayn.infer.translate import translate
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import scalars, weights_at  # tests/helpers.py

SOURCES = ["one", "twenty-one", "three hundred four", "nine thousand", "fifty-five"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, numbers):
    """15 steps, saved and validated every 3: retention keeps 6 and 12 (every 6th), 12 and 15
    (the last 2) and the one with the lowest validation loss."""
    run_dir = tmp_path_factory.mktemp("avg") / "run"
    cfg = load_config(
        None,
        tiny.overrides(
            run_dir,
            numbers,
            f"data.valid={numbers}/valid",
            "train.max_steps=15",
            "train.eval_every=3",
            "train.eval_bleu=0",
            "train.eval_batches=2",
            "train.threads=1",
            "checkpoint.every_steps=3",
            "checkpoint.keep_last=2",
            "checkpoint.keep_every=6",
            "checkpoint.keep_best=1",
            "logging.peak_tflops=0.1",
            "decode.beam=2",
            "decode.max_len_b=8",
        ),
    )
    train(cfg)
    return run_dir


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True, text=True)
    return proc


def test_retention_keeps_the_last_every_nth_and_the_best_recorded(run):
    valid = scalars(run, "valid/loss")
    assert sorted(valid) == [3, 6, 9, 12, 15]
    best = min(valid, key=valid.get)
    kept = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert kept == sorted({6, 12, 15, best})
    for step in kept:  # the metric each choice was made from, as TensorBoard logged it
        manifest = read_manifest(run / "checkpoints" / f"step_{step:08d}", verify=False)
        assert manifest["metrics"]["valid/loss"] == pytest.approx(valid[step], rel=1e-6)


def test_average_of_the_last_two_is_their_mean_and_translates(run, tmp_path):
    proc = cli("average", str(run), "--last", "2", "--output", str(tmp_path / "avg"))
    assert proc.returncode == 0, proc.stderr
    a, b = weights_at(run, 12), weights_at(run, 15)
    avg = load_file(tmp_path / "avg/model.safetensors")
    assert avg.keys() == a.keys()  # tied matrices still stored once
    for key in a:
        assert torch.equal(avg[key], (a[key] + b[key]) / 2), key
    assert any(not torch.equal(avg[k], a[k]) and not torch.equal(avg[k], b[k]) for k in a)
    manifest = read_manifest(tmp_path / "avg")  # checksums verify
    assert [m["step"] for m in manifest["averaged_from"]] == [12, 15]
    assert set(manifest["files"]) == {"model.safetensors", "tokenizer.model"}
    cfg, model, tok, _ = load_for_inference(tmp_path / "avg", ["decode.beam=1"])
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], avg[k]) for k in avg)
    assert len(translate(model, tok, SOURCES, cfg.decode, torch.device("cpu"))) == len(SOURCES)
    with pytest.raises(CheckpointError, match="holds weights only"):
        load_checkpoint(tmp_path / "avg", model)  # an average is for inference, not resuming
    proc = cli("average", str(run), "--output", str(tmp_path / "avg"))
    assert proc.returncode == 2 and "exists" in proc.stderr


def test_average_of_three_named_checkpoints_sums_in_fp32(run, tmp_path):
    from aiayn.checkpoint.average import average

    names = [run / f"checkpoints/step_{s:08d}" for s in (6, 12, 15)]
    average(names, tmp_path / "avg3")
    tensors = [load_file(n / "model.safetensors") for n in names]
    avg = load_file(tmp_path / "avg3/model.safetensors")
    for key, value in avg.items():
        expected = (tensors[0][key] + tensors[1][key] + tensors[2][key]) / 3
        assert torch.equal(value, expected), key
        exact = sum(t[key].double() for t in tensors) / 3
        assert (value.double() - exact).abs().max() < 1e-6


def test_averaging_other_models_or_too_many_names_what_differs(run, tmp_path):
    other = tmp_path / "other" / "checkpoints" / "step_00000015"
    shutil.copytree(run / "checkpoints/step_00000015", other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["config"]["model"]["d_ff"] = 128
    manifest["tokenizer"]["vocab_size"] = 200
    (other / "manifest.json").write_text(json.dumps(manifest))
    proc = cli("average", str(run / "checkpoints/step_00000012"), str(other), "--output", "x")
    assert proc.returncode == 2
    assert "model.d_ff: 64 in" in proc.stderr and ", 128 in" in proc.stderr
    assert "tokenizer vocab_size: 100 in" in proc.stderr
    proc = cli("average", str(run), "--last", "9", "--output", str(tmp_path / "y"))
    n = len(list((run / "checkpoints").glob("step_*")))
    assert proc.returncode == 2 and f"there are {n} valid checkpoints" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# Loads the export in a process where importing DeepSpeed fails, and translates.
NO_DEEPSPEED = """
import json, sys
sys.modules["deepspeed"] = None  # any import of it raises ImportError
import torch
from aiayn.checkpoint.inference import load_for_inference
from aiayn.infer.translate import translate
cfg, model, tok, _ = load_for_inference(sys.argv[1], ["decode.beam=2"])
print(json.dumps(translate(model, tok, json.loads(sys.argv[2]), cfg.decode, torch.device("cpu"))))
"""


def test_export_translates_identically_to_the_checkpoint_without_deepspeed(run, tmp_path):
    out = tmp_path / "export" / "numbers.safetensors"
    proc = cli("export", str(run), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.parent.iterdir()} == {
        "numbers.safetensors",
        "numbers.config.yaml",
        "numbers.tokenizer.model",
    }
    latest = run / "checkpoints/step_00000015"
    exported, saved = load_file(out), weights_at(run, 15)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    proc = subprocess.run(
        [sys.executable, "-c", NO_DEEPSPEED, str(out), json.dumps(SOURCES)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    cfg, model, tok, _ = load_for_inference(latest, ["decode.beam=2"])
    expected = translate(model, tok, SOURCES, cfg.decode, torch.device("cpu"))
    assert json.loads(proc.stdout) == expected


def test_bf16_export_holds_rounded_weights_and_loads(run, tmp_path):
    out = tmp_path / "bf16.safetensors"
    proc = cli(
        "export", str(run / "checkpoints/step_00000012"), "--output", str(out), "--dtype", "bf16"
    )
    assert proc.returncode == 0, proc.stderr
    exported = load_file(out)
    saved = weights_at(run, 12)
    assert all(torch.equal(exported[k], saved[k].to(torch.bfloat16)) for k in saved)
    assert (
        out.stat().st_size
        < 0.6 * (run / "checkpoints/step_00000012/model.safetensors").stat().st_size
    )
    cfg, model, tok, path = load_for_inference(out, ["decode.beam=1"])
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], exported[k].float()) for k in exported)
    assert len(translate(model, tok, SOURCES, cfg.decode, torch.device("cpu"))) == len(SOURCES)
