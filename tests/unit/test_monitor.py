"""What train/ logs: of memory, on a GPU, the allocator's reserve and retries beside the peak;
metrics.jsonl across a restart."""

import torch

from aiayn.train import metrics_file
from aiayn.train.monitor import Metrics, cuda_memory

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
