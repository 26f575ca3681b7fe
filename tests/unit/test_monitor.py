"""What train/ logs: on a GPU, the allocator's reserve and retries beside the peak; in
train.log, the error that stopped a run, and dates."""

import re

import torch

from aiayn.config import load_config
from aiayn.train.monitor import cuda_memory

from fake_cuda import FakeCuda
from helpers import TINY_MODEL, model_overrides  # tests/helpers.py


def test_a_gpu_logs_reserved_memory_and_allocation_retries(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=1)
    cuda.stats = {"reserved_bytes.all.current": 3 * 2**30, "num_alloc_retries": 7}
    assert cuda_memory(torch.device("cuda", 0)) == {
        "memory_reserved_gib": 3.0,
        "alloc_retries": 7.0,
    }


def test_a_cpu_logs_neither():
    assert cuda_memory(torch.device("cpu")) == {}


# ---- train.log: a fatal error in it, ISO dates ----------------------------------------------

ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


def _run_with_fault(tmp_path, corpus, monkeypatch, fault: BaseException):
    """`aiayn train` of a tiny model whose second step raises `fault`: (exit code or the
    exception main let through, train.log's lines)."""
    from aiayn.cli import main
    from aiayn.train import loop

    config = tmp_path / "run.yaml"
    load_config(
        None,
        [
            f"run_dir={tmp_path}/run",
            f"data.train={corpus}/train",
            "data.max_len=40",
            *model_overrides(TINY_MODEL),
            "tokenizer.vocab_size=100",
            "tokenizer.sample_sentences=400",
            "train.max_tokens=300",
            "train.max_steps=4",
            "logging.tensorboard=false",
        ],
    ).save(config)
    original = loop._train_step

    def faulty(run, *args):
        if run.progress.step == 1:
            raise fault
        return original(run, *args)

    monkeypatch.setattr(loop, "_train_step", faulty)
    try:
        result = main(["train", "--config", str(config)])
    except RuntimeError as exc:
        result = exc
    return result, (tmp_path / "run" / "train.log").read_text().splitlines()


def test_an_error_that_stops_training_is_in_train_log_with_its_traceback(
    tmp_path, corpus, monkeypatch
):
    result, lines = _run_with_fault(tmp_path, corpus, monkeypatch, RuntimeError("injected"))
    assert isinstance(result, RuntimeError)  # main lets a bug through: exit 1, a traceback
    stopped = [i for i, line in enumerate(lines) if "training stopped:" in line]
    assert len(stopped) == 1, lines[-5:]
    assert lines[stopped[0]].endswith("ERROR training stopped: RuntimeError: injected")
    assert lines[stopped[0] + 1] == "Traceback (most recent call last):"
    assert any("in faulty" in line for line in lines[stopped[0] :])
    # Every line the logger wrote carries the date (ISO 8601), not the time of day alone.
    stamped = [line for line in lines if ISO_LINE.match(line)]
    assert len(stamped) >= 5 and lines[0] in stamped


def test_an_error_the_user_can_fix_is_in_train_log_without_a_traceback(
    tmp_path, corpus, monkeypatch, capsys
):
    from aiayn.errors import TrainingError

    result, lines = _run_with_fault(tmp_path, corpus, monkeypatch, TrainingError("fix me"))
    assert result == 2
    assert lines[-1].endswith("ERROR training stopped: fix me"), lines[-3:]
    assert "aiayn train: error: fix me" in capsys.readouterr().err
