"""The precision a run computes in: `train.precision=auto` resolved against the device, and
the autocast context each precision means.

bf16 autocast pays only where the hardware multiplies bf16 natively. On a CPU that decides it:
with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake) or AMX (Intel Sapphire Rapids) oneDNN's bf16
matmul runs faster than fp32; without them it is emulated, and runs several times slower
(measured in benchmarks/README.md, cpu_precision.py and "Measurements behind defaults").
The choice reads the CPU's flags, not a timing, so that every rank of a run on identical
machines decides the same; a cap on oneDNN's instruction set below AVX512_CORE_BF16
(`ONEDNN_MAX_CPU_ISA=AVX2`, how a CPU of another kind is reproduced, tests/cpu_kinds.py) counts
as no native bf16, since oneDNN then emulates it whatever the CPU has.

A GPU multiplies bf16 natively from compute capability 8.0 (Ampere); torch's
`is_bf16_supported()` also counts the emulation older GPUs run. Volta and Turing (7.x: V100, T4)
have fp16 tensor cores, eight times their fp32 rate, and train in fp16 with loss scaling.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path

import torch

log = logging.getLogger("aiayn")

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN's instruction-set caps without a bf16 dot product (its names; DNNL_ is the old prefix).
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
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


def onednn_isa_cap(environ: Mapping[str, str] = os.environ) -> str | None:
    """The instruction set oneDNN is capped to by its environment variable, if any."""
    for name in ONEDNN_ISA_VARIABLES:
        if environ.get(name):
            return environ[name].strip().upper()
    return None


def native_bf16(
    device: torch.device, flags: set[str] | None = None, environ: Mapping[str, str] = os.environ
) -> bool:
    """True where bf16 matrix multiplies run in hardware: a CUDA GPU that supports bf16, or a
    CPU with one of CPU_BF16_FLAGS whose oneDNN is not capped below bf16."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        if onednn_isa_cap(environ) in ONEDNN_ISAS_WITHOUT_BF16:
            return False
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
