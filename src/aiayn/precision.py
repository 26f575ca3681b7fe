"""The precision a run computes in: `train.precision=auto` resolved against the device, and
the autocast context each precision means.

bf16 autocast pays only where the hardware multiplies bf16 natively. On a CPU that decides it:
with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake) or AMX (Intel Sapphire Rapids) oneDNN's bf16
matmul runs faster than fp32; without them it is emulated, and runs several times slower
(measured in benchmarks/README.md, cpu_precision.py and "Measurements behind defaults").
The choice reads the CPU's flags, not a timing, so that every rank of a run on identical
machines decides the same.

A GPU multiplies bf16 natively from compute capability 8.0 (Ampere); torch's
`is_bf16_supported()` also counts the emulation older GPUs run. Volta and Turing (7.x: V100, T4)
have fp16 tensor cores, eight times their fp32 rate, and train in fp16 with loss scaling.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path

import torch

log = logging.getLogger("aiayn")

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first processor's feature flags (Linux); empty where /proc/cpuinfo is not there."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(device: torch.device, flags: set[str] | None = None) -> bool:
    """True where bf16 matrix multiplies run in hardware: a CUDA GPU that supports bf16, or a
    CPU with one of CPU_BF16_FLAGS."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return any(f in (cpu_flags() if flags is None else flags) for f in CPU_BF16_FLAGS)
    return False


def fp16_tensor_cores(device: torch.device) -> bool:
    """True on a CUDA GPU with fp16 tensor cores (compute capability 7.0 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (7, 0)


def resolve_precision(precision: str, device: torch.device, flags: set[str] | None = None) -> str:
    """`precision`, with auto replaced by bf16 where the device has native bf16, else fp16 on
    a GPU with fp16 tensor cores, else fp32."""
    if precision != "auto":
        return precision
    if native_bf16(device, flags):
        chosen, why = "bf16", "native bf16"
    elif fp16_tensor_cores(device):
        chosen, why = "fp16", "no native bf16; fp16 tensor cores, with loss scaling"
    else:
        chosen, why = "fp32", "no native bf16: bf16 would be slower"
    log.info("train.precision=auto: %s on %s (%s)", chosen, device, why)
    return chosen


def autocast(device: torch.device, precision: str) -> ContextManager:
    """The forward pass's context: autocast to bf16 or fp16, nothing for fp32 (the weights and
    the optimizer stay fp32 in every precision)."""
    if precision in AUTOCAST:
        return torch.autocast(device.type, dtype=AUTOCAST[precision])
    return contextlib.nullcontext()
