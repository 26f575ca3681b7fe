"""Process-wide PyTorch settings a run makes before its first kernel: the CUDA allocator, TF32,
and deterministic kernels. One owner, so that the trainer and the benchmarks run alike.

Environment variables here are read once, by the library that owns them, at its first use:
the allocator's at CUDA's first allocation, cuBLAS's at its first handle. Each is set only
where the user has not set it.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("aiayn")

# torch reads PYTORCH_ALLOC_CONF, and the older name where that is not set.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# One of the two settings cuBLAS documents as deterministic; PyTorch's reproducibility notes use it.
CUBLAS_WORKSPACE = ":4096:8"


def use_expandable_segments() -> bool:
    """Let the CUDA caching allocator grow its segments in place, unless the user configured it.

    Token-budget batches come in hundreds of shapes; fixed-size segments fragment under them
    until a step fails for memory that is free but split (allocation retries, then an
    out-of-memory error hours into a run). Must run before CUDA's first allocation. Returns
    whether it set the variable.
    """
    if any(var in os.environ for var in ALLOC_CONF_VARS):
        return False
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    return True


def use_tf32(enabled: bool) -> None:
    """fp32 matrix multiplies and convolutions on CUDA in TF32 (or not).

    Through the CUDA-only switches: torch.set_float32_matmul_precision("high") would also let
    oneDNN multiply fp32 in lower precision on a CPU, and CPU results must not change. The
    newer `fp32_precision` switches are not mixed in: torch refuses to read a state set
    through both, and Inductor reads it through the old one.
    """
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def use_deterministic_kernels() -> None:
    """What PyTorch's reproducibility notes list, for every kernel this run launches.

    warn_only=False: with warn_only=True, torch warns but keeps the fused attention kernels'
    non-deterministic backward, so the setting would promise what it does not do. With it,
    flash attention and the memory-efficient kernel run their deterministic backward (the
    latter without splitting keys) and cuDNN attention is not used; an operation with no
    deterministic kernel raises, naming itself, at the first step.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False  # it picks kernels by timing them
    torch.backends.cuda.enable_cudnn_sdp(False)
    import torch._inductor.config as inductor

    inductor.deterministic = True  # no autotuning by timing, no numerics-changing choices


def use_attention_kernel(kernel: str) -> None:
    """The fused kernel scaled_dot_product_attention may pick on CUDA (train.attention_kernel).

    auto is the memory-efficient kernel, with torch's math path where it does not apply:
    measured on an H200 at translation lengths, transformer_big trained at 229k target
    tokens/s with it, 211k with flash attention allowed beside it (torch then picks flash for
    the decoder's causal self-attention), 205k with cuDNN's (which torch 2.11 tries first on
    Hopper) and 182k with flash alone (benchmarks/README.md, "On a GPU"). Any other value allows
    that kernel alone, with the math path where it does not apply (flash attention takes no
    padding mask: the encoder and cross-attention then run the math path). Process-wide
    switches, read at each call, the backward's too.
    """
    torch.backends.cuda.enable_cudnn_sdp(kernel == "cudnn")
    torch.backends.cuda.enable_flash_sdp(kernel == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(kernel in ("auto", "efficient"))
    torch.backends.cuda.enable_math_sdp(True)


def configure(
    device: torch.device, tf32: bool, deterministic: bool, attention_kernel: str = "auto"
) -> None:
    """The settings of a run on `device` (after setup(), before the model is built)."""
    if device.type == "cuda":
        use_tf32(tf32)
        use_attention_kernel(attention_kernel)
    if deterministic:
        use_deterministic_kernels()
        log.info("train.deterministic: deterministic kernels (slower; docs/gpu.md)")
