"""End to end on one process: real training runs on generated corpora, real checkpoints."""

import json
import math
import subprocess
import sys

import pytest
import torch
import yaml

from aiayn.checkpoint import read_trainer_state
from aiayn.config import load_config
from aiayn.corpora import demo
from aiayn.engine.precision import resolve_precision
from aiayn.errors import CheckpointError, TrainingError
from aiayn.eval.evaluate import evaluate
from aiayn.train import train

from helpers import SMALL_MODEL, events, model_overrides, scalars, weights_at  # tests/helpers.py


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):  # larger than conftest's: these runs must learn visibly
    return demo.write_numbers(
        tmp_path_factory.mktemp("numbers"), n_train=3000, n_valid=200, n_test=100
    )


def numbers_config(run_dir, corpus, *overrides):
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"data.train={corpus}/train",
            f"data.valid={corpus}/valid",
            f"data.test={corpus}/test",
            "data.src_lang=en",
            "data.tgt_lang=de",
            "data.max_len=40",
            "data.shuffle_buffer=1000",
            *model_overrides(SMALL_MODEL),
            "tokenizer.vocab_size=120",
            "tokenizer.sample_sentences=2000",
            "train.max_tokens=1200",
            "schedule.warmup=30",
            "schedule.factor=2.0",
            "logging.every_steps=5",
            "checkpoint.every_steps=10",
            "decode.beam=2",
            "train.eval_bleu=20",
            "decode.max_len_b=10",
            *overrides,
        ],
    )


def test_training_lowers_the_validation_loss_and_evaluates(tmp_path, numbers):
    cfg = numbers_config(tmp_path / "run", numbers, "train.max_steps=60", "train.eval_every=20")
    final = train(cfg)
    valid = scalars(tmp_path / "run", "valid/loss")
    assert list(valid) == [20, 40, 60]
    assert valid[60] < 0.7 * valid[20], valid
    assert final["loss"] == pytest.approx(valid[60], rel=1e-5)
    assert (tmp_path / "run" / "config.yaml").is_file()
    result = evaluate(tmp_path / "run", "test")
    assert {"bleu", "bleu_signature", "exact_match", "hypotheses_file"} <= set(result)
    assert "tok:13a" in result["bleu_signature"]
    assert len(open(result["hypotheses_file"]).read().splitlines()) == 100


def test_resume_after_a_stop_gives_bitwise_identical_weights(tmp_path, numbers):
    """Dropout on: resume must restore RNG, optimizer, schedule and data position exactly."""
    common = ("model.dropout=0.1", "train.eval_every=0", "checkpoint.every_steps=7")
    train(numbers_config(tmp_path / "straight", numbers, "train.max_steps=14", *common))
    train(numbers_config(tmp_path / "stopped", numbers, "train.max_steps=9", *common))
    train(numbers_config(tmp_path / "stopped", numbers, "train.max_steps=14", *common))
    a, b = weights_at(tmp_path / "straight", 14), weights_at(tmp_path / "stopped", 14)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    resumed = scalars(tmp_path / "stopped", "train/lr")
    straight = scalars(tmp_path / "straight", "train/lr")
    assert straight.keys() == {5, 10, 14} and resumed.keys() == {5, 9, 10, 14}
    assert all(resumed[step] == lr for step, lr in straight.items())  # the schedule continues


def test_a_non_finite_loss_stops_the_run_and_is_never_checkpointed(tmp_path, numbers, monkeypatch):
    import aiayn.train.loop as train_module

    real = train_module.batch_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, correct = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 12 else loss), correct

    monkeypatch.setattr(train_module, "batch_loss", poisoned)
    cfg = numbers_config(tmp_path / "run", numbers, "train.max_steps=40", "train.eval_every=0")
    with pytest.raises(TrainingError, match="loss became nan before step 15"):
        train(cfg)
    names = [p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")]
    assert names == ["step_00000010"]


def test_resume_never_refuses_to_overwrite_a_run(tmp_path, numbers):
    train(numbers_config(tmp_path / "run", numbers, "train.max_steps=10", "train.eval_every=0"))
    cfg = numbers_config(tmp_path / "run", numbers, "train.max_steps=10", "checkpoint.resume=never")
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(cfg)


def test_resuming_with_another_model_names_the_fields(tmp_path, numbers):
    train(numbers_config(tmp_path / "run", numbers, "train.max_steps=10", "train.eval_every=0"))
    cfg = numbers_config(tmp_path / "run", numbers, "train.max_steps=20", "model.d_ff=256")
    with pytest.raises(CheckpointError, match="model.d_ff: checkpoint 128, config 256"):
        train(cfg)


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "aiayn", *args], capture_output=True, text=True, cwd=cwd
    )


def test_cli_config_typo_is_a_clear_error(tmp_path, project_root):
    proc = run_cli("train", "--config", "configs/demo.yaml", "train.max_stpes=3", cwd=project_root)
    assert proc.returncode == 2
    assert "unknown key train.max_stpes; did you mean train.max_steps?" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("config", "paper"), [("wmt14_en_de_base", 65e6), ("wmt14_en_de_big", 213e6)]
)
def test_params_of_base_and_big_are_the_papers(project_root, config, paper):
    proc = run_cli(
        "params", "--config", f"configs/{config}.yaml", "--vocab-size", "37000", cwd=project_root
    )
    assert proc.returncode == 0, proc.stderr
    count = int(proc.stdout.split("parameters: ")[1].split()[0].replace(",", ""))
    assert abs(count - paper) / paper < 0.04, count


def test_translate_cli_reads_stdin(tmp_path, numbers, project_root):
    train(numbers_config(tmp_path / "run", numbers, "train.max_steps=5", "train.eval_every=0"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            "translate",
            "--checkpoint",
            str(tmp_path / "run"),
            "decode.beam=1",
        ],
        input="twenty-one\nthree hundred\n",
        capture_output=True,
        text=True,
        cwd=project_root,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2


def small_model(*overrides):
    return [
        *model_overrides(SMALL_MODEL),
        "tokenizer.vocab_size=100",
        "tokenizer.sample_sentences=3000",
        "train.max_tokens=1500",
        "schedule.warmup=20",
        "schedule.factor=2.0",
        "logging.every_steps=10",
        "train.eval_every=10",
        "checkpoint.every_steps=100",
        *overrides,
    ]


def test_the_language_model_learns_to_count(tmp_path):
    corpus = demo.write_lm(tmp_path / "lm", n_train=1500, n_valid=50, n_test=50)
    cfg = load_config(
        None,
        small_model(
            f"run_dir={tmp_path}/run",
            "model.kind=lm",
            "data.format=text",
            "data.max_len=48",
            f"data.train={corpus}/train.txt",
            f"data.valid={corpus}/valid.txt",
            "train.max_steps=40",
        ),
    )
    train(cfg)
    valid = list(scalars(tmp_path / "run", "valid/ppl").values())
    assert valid[-1] < 0.5 * valid[0], valid
    proc = run_cli(
        "generate",
        "--checkpoint",
        str(tmp_path / "run"),
        "--prompt",
        "forty-one",
        "--prompt",
        "seven",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("forty-one ") and lines[1].startswith("seven ")


def test_a_running_text_lm_reports_bits_per_character_and_samples_line_breaks(tmp_path):
    """data.lm_order stream with data.unit characters: validation and `aiayn evaluate` score
    every character of the text (line breaks included) and agree; generation keeps going
    through line breaks and prints them."""
    corpus = demo.write_lm(tmp_path / "lm", n_train=400, n_valid=20, n_test=20)
    text = [line for line in (corpus / "valid.txt").read_text().split("\n")[:-1]]
    text[3:3] = ["", ""]  # empty lines are line breaks too
    (corpus / "valid_text.txt").write_text("".join(line + "\n" for line in text))
    cfg = load_config(
        None,
        small_model(
            f"run_dir={tmp_path}/run", "model.kind=lm", "data.format=text", "data.max_len=48",
            f"data.train={corpus}/train.txt", f"data.valid={corpus}/valid_text.txt",
            f"data.test={corpus}/valid_text.txt", "data.lm_order=stream", "data.unit=characters",
            "tokenizer.normalization=identity", "tokenizer.remove_extra_whitespaces=false",
            "train.max_steps=40", "logging.samples=2",
        ),
    )  # fmt: skip
    train(cfg)
    bpc = list(scalars(tmp_path / "run", "valid/bpc").values())
    assert bpc[-1] < 0.7 * bpc[0], bpc  # 0.82 -> 0.52 seen
    chars = sum(len(line) + 1 for line in text)
    results = {}
    for stride in (None, 12):
        extra = [] if stride is None else [f"train.eval_stride={stride}"]
        proc = run_cli(
            "evaluate", "--checkpoint", str(tmp_path / "run"), "--split", "test", "--json", *extra
        )
        assert proc.returncode == 0, proc.stderr
        results[stride] = r = json.loads(proc.stdout)
        assert r["characters"] == chars
        assert r["bpc"] == pytest.approx(r["loss"] * r["tokens"] / (chars * math.log(2)), rel=1e-6)
    assert results[None]["bpc"] == pytest.approx(bpc[-1], rel=1e-4)  # validation's scoring
    assert results[12]["tokens"] == results[None]["tokens"]  # every token once, more context
    assert events(tmp_path / "run").Tensors("valid/samples/text_summary")
    proc = run_cli(
        "generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "forty-one\\nforty",
        "--max-new-tokens", "60", "--temperature", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # The prompt's line break is kept, and sampling runs to its 60 tokens (eos would have
    # stopped it): the eos-to-newline decoding itself is test_lm_scores'.
    assert proc.stdout.startswith("forty-one\nforty") and len(proc.stdout) > 100


def test_the_classifier_learns_parity_and_reports_accuracy(tmp_path):
    corpus = demo.write_classify(tmp_path / "cls", n_train=3000, n_valid=200, n_test=200)
    cfg = load_config(
        None,
        small_model(
            f"run_dir={tmp_path}/run",
            "model.kind=classifier",
            "data.format=jsonl",
            "data.max_len=40",
            f"data.train={corpus}/train.jsonl",
            f"data.valid={corpus}/valid.jsonl",
            f"data.test={corpus}/test.jsonl",
            "train.max_steps=60",
            "train.label_smoothing=0",
        ),
    )
    train(cfg)
    valid = list(scalars(tmp_path / "run", "valid/loss").values())
    assert valid[-1] < valid[0] - 0.05, valid
    result = evaluate(tmp_path / "run", "test")
    assert 0.0 <= result["accuracy"] <= 1.0 and "ppl" not in result


def test_bf16_autocast_trains(tmp_path, numbers):
    # A given peak: measuring one (a 2048^3 bf16 matmul, several times) takes minutes where bf16
    # is emulated (a CPU without AVX512-BF16), and is not what this test is about.
    cfg = numbers_config(
        tmp_path / "run",
        numbers,
        "train.max_steps=6",
        "train.precision=bf16",
        "train.eval_every=3",
        "logging.peak_tflops=1",
    )
    result = train(cfg)
    assert 0 < result["loss"] < 10


def test_precision_auto_runs_and_records_what_it_chose(tmp_path, numbers):
    cfg = numbers_config(tmp_path / "run", numbers, "train.max_steps=2", "train.precision=auto")
    train(cfg)
    chosen = resolve_precision("auto", torch.device("cpu"))
    assert chosen in ("fp32", "bf16")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["precision"] == chosen


def test_a_fraction_cooldown_is_recorded_as_the_steps_it_came_to(tmp_path, numbers):
    run_dir = tmp_path / "run"
    cfg = numbers_config(
        run_dir,
        numbers,
        "train.max_steps=10",
        "train.eval_every=0",
        "schedule.cooldown_fraction=0.3",
    )
    train(cfg)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["schedule"]
    assert (saved["cooldown"], saved["cooldown_fraction"]) == (3, None)
    assert "noam schedule, warmup 30, cooldown 3 of 10 steps" in (run_dir / "train.log").read_text()
    # The checkpoints record the same config, and the rate that fell to 0 at the end.
    manifest = json.loads((run_dir / "checkpoints" / "step_00000010" / "manifest.json").read_text())
    assert manifest["config"]["schedule"]["cooldown"] == 3
    state = read_trainer_state(run_dir / "checkpoints" / "step_00000010")
    assert state["engine"]["optimizer"]["param_groups"][0]["lr"] == 0.0
