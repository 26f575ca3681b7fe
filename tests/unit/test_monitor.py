"""What train/ logs: of memory, on a GPU, the allocator's reserve and retries beside the peak;
metrics.jsonl across a restart; in train.log, the error that stopped a run, and dates."""

import re

import torch

from aiayn.train import metrics_file
from aiayn.train.monitor import Metrics, cuda_memory, log_fatal, setup_logging

from fake_cuda import FakeCuda


def test_a_gpu_logs_reserved_memory_and_allocation_retries(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=1)
    cuda.stats = {"reserved_bytes.all.current": 3 * 2**30, "num_alloc_retries": 7}
    assert cuda_memory(torch.device("cuda", 0)) == {
        "memory_reserved_gib": 3.0,
        "alloc_retries": 7.0,
    }


def test_a_cpu_logs_neither():
    assert cuda_memory(torch.device("cpu")) == {}


def test_metrics_jsonl_drops_what_a_restart_logs_again(tmp_path):
    """A run logs steps 1-5 and is killed mid-line after its checkpoint of step 3: the restart
    keeps steps 1-3 and the resumed run's lines follow them, each step once."""
    first = Metrics(tmp_path, enabled=True, tensorboard=False)
    for step in range(1, 6):
        first.log("train", step, {"loss": 1.0 / step, "tokens": 100 * step}, console=False)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "train/lo')  # the kill
    again = Metrics(tmp_path, enabled=True, tensorboard=False, resume_step=3)
    again.log("train", 4, {"loss": float("nan"), "tokens": 400}, console=False)
    again.close()
    rows = metrics_file.read(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[1]["train/loss"] == 0.5 and rows[1]["train/tokens"] == 200
    assert rows[3]["train/loss"] is None  # NaN is not JSON: null
    assert all(isinstance(row["time"], float) for row in rows)


def test_other_ranks_write_no_metrics_file(tmp_path):
    Metrics(tmp_path, enabled=False, tensorboard=False).log("train", 1, {"loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists()


# ---- train.log: a fatal error in it, ISO dates ----------------------------------------------

ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


def test_an_error_that_stops_training_is_in_train_log_with_its_traceback(tmp_path):
    """train() hands every error that stops it to log_fatal (tests/e2e/test_disk_full.py
    checks it on a real run stopped by a full disk)."""
    setup_logging(tmp_path, 0)
    try:
        raise RuntimeError("injected")
    except RuntimeError as exc:
        log_fatal(exc)
    finally:
        setup_logging(None)  # the file handler closed
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert ISO_LINE.match(lines[0]) and lines[0].endswith(
        "ERROR training stopped: RuntimeError: injected"
    )
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: injected"


def test_an_error_the_user_can_fix_is_in_train_log_without_a_traceback(tmp_path):
    """The message alone, as the terminal shows it (`aiayn train: error: ...`); train() calls
    log_fatal for every error (the test above)."""
    from aiayn.errors import TrainingError

    setup_logging(tmp_path, 0)
    try:
        log_fatal(TrainingError("fix me"))
    finally:
        setup_logging(None)  # the file handler closed
    (line,) = (tmp_path / "train.log").read_text().splitlines()
    assert ISO_LINE.match(line) and line.endswith("ERROR training stopped: fix me")
