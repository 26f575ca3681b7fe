"""What train/ logs of memory: on a GPU, the allocator's reserve and retries beside the peak."""

import torch

from aiayn.train.monitor import cuda_memory

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
