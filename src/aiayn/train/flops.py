"""Floating-point work: what a training step costs, and what the device can do, for MFU."""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from aiayn.config import ModelConfig
from aiayn.data.batch import Batch
from aiayn.engine.precision import native_bf16
from aiayn.runtime.durable import write_atomic

log = logging.getLogger("aiayn")


# Dense peaks from the vendors' data sheets (TFLOP/s; tensor-core figures are half the "with
# sparsity" ones), by a fragment of the device name, and the SM count of the whole GPU. The
# longest matching fragment wins: "NVIDIA H100 PCIe" is not an SXM H100, "NVIDIA L40" is not
# an L4, "NVIDIA A10" is not an A100. None: the GPU has no such unit (bf16 and TF32 came with
# Ampere).
@dataclass(frozen=True)
class GpuPeaks:
    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float  # no tensor cores
    sms: int


GPU_PEAKS = {
    "H100 PCIe": GpuPeaks(756, 756, 378, 51.2, 114),
    "H100 NVL": GpuPeaks(835, 835, 417.5, 60, 132),
    "H200 NVL": GpuPeaks(835, 835, 417.5, 60, 132),
    "H100": GpuPeaks(989.4, 989.4, 494.7, 66.9, 132),  # SXM ("NVIDIA H100 80GB HBM3")
    "H200": GpuPeaks(989.4, 989.4, 494.7, 66.9, 132),  # SXM
    "A100": GpuPeaks(312, 312, 156, 19.5, 108),
    "A10": GpuPeaks(125, 125, 62.5, 31.2, 72),
    "L40S": GpuPeaks(362, 362, 183, 91.6, 142),
    "L40": GpuPeaks(181, 181, 90.5, 90.5, 142),
    "L4": GpuPeaks(121, 121, 60, 30.3, 58),
    "V100-PCIE": GpuPeaks(None, 112, None, 14, 80),
    "V100": GpuPeaks(None, 125, None, 15.7, 80),  # SXM2
    "T4": GpuPeaks(None, 65, None, 8.1, 40),
}


def matmul_math(precision: str, device_type: str, tf32: bool = True) -> str:
    """The arithmetic a run's matrix multiplies use: bf16, fp16, tf32 or fp32. On CPU fp16
    counts as fp32 (its peak is measured in fp32, as before)."""
    if precision == "bf16" or (precision == "fp16" and device_type == "cuda"):
        return precision
    return "tf32" if device_type == "cuda" and tf32 else "fp32"


def datasheet_gpu_peak(device_name: str, math: str, sms: int | None = None) -> float | None:
    """The data-sheet dense peak (FLOP/s) of `math` on a GPU named `device_name`, or None if
    not known. `sms`: the SMs the device reports; a MIG slice, or a part with fewer SMs than the
    table's, gets that fraction of the whole GPU's peak."""
    matches = [fragment for fragment in GPU_PEAKS if fragment in device_name]
    if not matches:
        return None
    row = GPU_PEAKS[max(matches, key=len)]
    peak = getattr(row, math)
    if peak is None:
        return None
    return peak * 1e12 * (min(sms, row.sms) / row.sms if sms else 1.0)


def training_flops(cfg: ModelConfig, vocab_size: int, batch: Batch) -> int:
    """Matrix-multiply FLOPs of forward + backward (3x forward) for one micro-batch.

    Counted on the shapes the kernels really process: padded, except the output projection,
    which runs on the batch.n_tokens non-pad targets only (loss.batch_loss); attention counts
    the full T x S score matrix even where a causal kernel skips half of it. Embedding lookups,
    norms and softmax are left out, as in the usual 6 * params * tokens estimate.
    """
    d, ff, enc_layers = cfg.d_model, cfg.d_ff, cfg.N
    dec_layers = cfg.decoder_layers or cfg.N
    macs = 0
    if batch.src is not None:
        B, S = batch.src.shape
        per_token = 4 * d * d + 2 * d * ff + 2 * S * d  # QKV + W^O, FFN, QK^T and AV
        macs += enc_layers * B * S * per_token
    if batch.tgt_in is not None:
        B, T = batch.tgt_in.shape
        per_token = 4 * d * d + 2 * d * ff + 2 * T * d
        if cfg.kind == "seq2seq":
            S = batch.src.shape[1]
            per_token += 2 * d * d + 2 * S * d  # cross-attention: W^Q, W^O, QK^T, AV
            macs += dec_layers * B * S * 2 * d * d  # cross-attention K, V of the memory
        macs += dec_layers * B * T * per_token + batch.n_tokens * d * vocab_size  # + output
    if batch.labels is not None:
        macs += batch.size * (d * d + d * cfg.num_classes)
    return 3 * 2 * macs


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int | None = None, seconds: float = 0.5
) -> float:
    """Best FLOP/s of an n x n x n matrix multiply on `device`: the practical ceiling.

    One untimed multiply first (thread-pool start, first touch of the output), then the best
    of repeats over about `seconds`. A CPU's speed wanders from moment to moment on a shared
    machine; four cold samples were sometimes half the speed a training step then reached,
    which put MFU above 1.
    """
    n = n or (8192 if device.type == "cuda" else 2048)
    # Its own generator: drawing from the global one would change dropout after a resume.
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 4 or (spent < seconds and runs < 50):
        elapsed = timed()
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return 2 * n**3 / best


def matmul_dtype(precision: str, device_type: str = "cpu") -> torch.dtype:
    """The dtype whose matrix multiply bounds a run: bf16 in bf16, fp16 in fp16 on a GPU, else
    fp32. A CPU without native bf16 emulates it, and its bf16 peak is then below fp32's;
    precision=auto does not choose bf16 there (precision.py)."""
    math = matmul_math(precision, device_type)
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(math, torch.float32)


def datasheet_peak(device: torch.device, precision: str, tf32: bool = True) -> float | None:
    """A known GPU's data-sheet peak (FLOP/s) in the arithmetic a `precision` run multiplies
    in (TF32 for fp32 where `tf32`, train.tf32), scaled to the SMs it has; None on CPU."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    math = matmul_math(precision, device.type, tf32)
    peak = datasheet_gpu_peak(props.name, math, props.multi_processor_count)
    if peak is not None:
        return peak
    log.warning(
        "no data-sheet %s peak for %s: MFU uses a measured matmul peak; set "
        "logging.peak_tflops to the data sheet's figure",
        math,
        props.name,
    )
    return None


def device_peak_flops(
    device: torch.device,
    precision: str,
    configured: float | None,
    tf32: bool = True,
    kept: Path | None = None,
    keep: bool = True,
) -> float:
    """FLOP/s that MFU is measured against: the configured figure, a GPU's data sheet, or (on
    CPU, or an unknown GPU) a matrix multiply measured now.

    `kept` (run_dir/peak_flops.json): a measured peak is read from there when it was measured
    on the same kind of device, and written there (where `keep`, rank 0): a restarted run
    reuses it instead of measuring again (a part of every start on a CPU), and its MFU
    keeps one denominator across restarts.
    """
    if configured:
        return configured * 1e12
    sheet = datasheet_peak(device, precision, tf32)
    if sheet is not None:
        return sheet
    dtype = matmul_dtype(precision, device.type)
    if dtype == torch.bfloat16 and device.type == "cpu" and not native_bf16(device):
        # Emulated bf16 runs on the fp32 units, which are then the ceiling; and measuring it
        # would cost minutes at start (one 2048^3 bf16 multiply takes over a minute on AVX2).
        dtype = torch.float32
    what = f"{device_name(device)}, {dtype}, {torch.get_num_threads()} threads"
    try:
        saved = json.loads(kept.read_text()) if kept is not None else {}
    except (OSError, ValueError):
        saved = {}
    if isinstance(saved, dict) and saved.get("device") == what:
        return float(saved["flops"])
    peak = measure_matmul_peak(device, dtype)
    if kept is not None and keep:
        write_atomic(kept, json.dumps({"device": what, "flops": peak}) + "\n")
    return peak


def raise_kept_peak(kept: Path, flops: float) -> None:
    """Record a higher measured peak in run_dir/peak_flops.json (see device_peak_flops)."""
    try:
        saved = json.loads(kept.read_text())
    except (OSError, ValueError):
        return
    if isinstance(saved, dict) and float(saved.get("flops", 0)) < flops:
        write_atomic(kept, json.dumps({**saved, "flops": flops}) + "\n")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (from /proc/cpuinfo where there is one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
