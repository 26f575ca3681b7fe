"""The process environment on a GPU node (torch.cuda faked: fake_cuda.py): one GPU per rank,
NCCL bound to it, the set-up timeout, the allocator configured before CUDA allocates."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from aiayn.distributed import env as env_module
from aiayn.distributed.env import pick_device, setup
from aiayn.errors import ConfigError

from fake_cuda import FakeCuda


def test_a_rank_past_the_visible_gpus_is_refused_naming_the_fix(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    assert pick_device("auto", 1) == torch.device("cuda", 1)
    # Before: LOCAL_RANK 2 % 2 GPUs put a third rank on cuda:0 beside rank 0.
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 .* 2 CUDA device.*--nproc_per_node=2"):
        pick_device("auto", 2)


def test_nccl_joins_with_this_ranks_device_and_the_setup_timeout(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=4)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    stores = []  # the launcher's store, made for this start (a TCPStore needs a live launcher)
    monkeypatch.setattr(env_module, "_attempt_store", lambda *a: stores.append(a) or "store")
    for var, value in {"WORLD_SIZE": "8", "RANK": "7", "LOCAL_RANK": "3"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "-")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    env = setup("auto", timeout_minutes=90)
    assert env.device == torch.device("cuda", 3) and cuda.current == 3
    timeout = timedelta(minutes=90)
    assert stores == [(7, 8, timeout)]
    expected = {"store": "store", "rank": 7, "world_size": 8, "timeout": timeout}
    assert calls == [(("nccl",), {**expected, "device_id": torch.device("cuda", 3)})]
    assert env_module.os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
