"""The process environment on a GPU node (torch.cuda faked: fake_cuda.py): one GPU per rank,
NCCL bound to it, the set-up timeout, the allocator configured before CUDA allocates."""

import resource
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
    monkeypatch.setattr(env_module, "raise_open_file_limit", lambda world_size: None)
    env = setup("auto", timeout_minutes=90)
    assert env.device == torch.device("cuda", 3) and cuda.current == 3
    timeout = timedelta(minutes=90)
    assert stores == [(7, 8, timeout)]
    expected = {"store": "store", "rank": 7, "world_size": 8, "timeout": timeout}
    assert calls == [(("nccl",), {**expected, "device_id": torch.device("cuda", 3)})]
    assert env_module.os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.parametrize(
    "limits, world_size, expect",
    [
        ((4096, 524288), 8, 4096),  # enough already: untouched
        ((1024, 524288), 1024, 3 * 1024 + 1024),  # raised to the need, below the hard limit
        ((1024, resource.RLIM_INFINITY), 2048, 3 * 2048 + 1024),
        ((resource.RLIM_INFINITY, resource.RLIM_INFINITY), 4096, resource.RLIM_INFINITY),
    ],
)
def test_the_open_file_limit_is_raised_to_what_the_gloo_groups_need(
    monkeypatch, limits, world_size, expect
):
    state = {"limits": limits}
    monkeypatch.setattr(resource, "getrlimit", lambda which: state["limits"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, new: state.update(limits=new))
    assert env_module.raise_open_file_limit(world_size) == expect
    assert state["limits"][0] == expect and state["limits"][1] == limits[1]


def test_a_hard_open_file_limit_below_the_need_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4000))
    monkeypatch.setattr(resource, "setrlimit", lambda *a: pytest.fail("nothing to raise to"))
    with pytest.raises(
        ConfigError, match=r"1024 ranks may need 4,096 .* at most 4,000 .*ulimit -n 4096"
    ):
        env_module.raise_open_file_limit(1024)
