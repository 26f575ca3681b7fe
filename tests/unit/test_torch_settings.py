"""Process-wide settings a run makes: deterministic kernels, TF32 on CUDA only, the CUDA
allocator's expandable segments unless the user configured it."""

import os

import pytest
import torch
import torch._inductor.config as inductor

from aiayn.config import Config
from aiayn.runtime.torch_settings import configure, use_expandable_segments

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def SDPA_FLAGS() -> tuple[bool, bool, bool]:  # noqa: N802  (cuDNN's is saved on its own)
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def allowed() -> set[str]:
    b = torch.backends.cuda
    flags = {
        "cudnn": b.cudnn_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }
    return {name for name, on in flags.items() if on}


@pytest.fixture
def clean(monkeypatch):
    """Every setting configure() may touch, restored after the test."""
    for var in ("CUBLAS_WORKSPACE_CONFIG", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(var, "-")  # so that delenv's undo removes what the test sets
        monkeypatch.delenv(var)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        inductor.deterministic,
        *SDPA_FLAGS(),
    )
    yield
    torch.backends.cuda.enable_flash_sdp(saved[8])
    torch.backends.cuda.enable_mem_efficient_sdp(saved[9])
    torch.backends.cuda.enable_math_sdp(saved[10])
    inductor.deterministic = saved[7]
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:4]
    torch.backends.cuda.enable_cudnn_sdp(saved[4])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[5:7]


def test_deterministic_is_off_by_default_and_changes_nothing(clean):
    cfg = Config()
    assert cfg.train.deterministic is False
    configure(CPU, cfg.train.tf32, cfg.train.deterministic)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert torch.backends.cuda.cudnn_sdp_enabled() and not inductor.deterministic


def test_deterministic_sets_what_pytorch_documents(clean):
    configure(CPU, tf32=True, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    # warn_only would keep the fused attention kernels' non-deterministic backward.
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # deterministic under the flag
    assert torch.backends.cuda.mem_efficient_sdp_enabled()  # ditto, keys not split
    assert inductor.deterministic


def test_a_users_cublas_workspace_setting_is_kept(clean, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the other documented setting
    configure(CPU, tf32=True, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_tf32_is_on_for_cuda_by_default_and_never_touches_the_cpu(clean):
    torch.backends.cuda.matmul.allow_tf32 = False
    mkldnn = torch.backends.mkldnn.matmul.fp32_precision
    configure(CPU, Config().train.tf32, deterministic=False)
    assert not torch.backends.cuda.matmul.allow_tf32
    configure(GPU, Config().train.tf32, deterministic=False)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"  # what Inductor reads
    assert torch.backends.mkldnn.matmul.fp32_precision == mkldnn  # CPU matmuls unchanged
    configure(GPU, tf32=False, deterministic=False)
    assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"


def test_expandable_segments_unless_the_user_configured_the_allocator(clean, monkeypatch):
    assert use_expandable_segments()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not use_expandable_segments()
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_attention_kernel_allows_one_fused_kernel_and_math_on_cuda_only(clean):
    assert Config().train.attention_kernel == "auto"
    configure(CPU, tf32=True, deterministic=False, attention_kernel="efficient")
    assert allowed() == {"cudnn", "flash", "efficient", "math"}  # CPU: nothing changes
    for kernel in ("cudnn", "flash", "efficient", "math"):
        configure(GPU, tf32=True, deterministic=False, attention_kernel=kernel)
        assert allowed() == {kernel, "math"}
    # auto: the memory-efficient kernel, the fastest at translation lengths on an H200.
    configure(GPU, tf32=True, deterministic=False, attention_kernel="auto")
    assert allowed() == {"efficient", "math"}
    configure(GPU, tf32=True, deterministic=True, attention_kernel="efficient")
    assert allowed() == {"efficient", "math"}
