"""Floating-point work: what a training step costs, and what the device can do, for MFU."""

from __future__ import annotations

import logging
import time

import torch

from aiayn.config import ModelConfig
from aiayn.data.batch import Batch

log = logging.getLogger("aiayn")

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s: half their "with
# sparsity" figures), by a fragment of torch.cuda.get_device_name. The longest matching
# fragment wins: "NVIDIA H100 PCIe" is not an SXM H100, "NVIDIA L40" is not an L4.
GPU_BF16_PEAK = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 NVL": 835e12,
    "H100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
    "H200": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
}


def datasheet_bf16_peak(device_name: str) -> float | None:
    """The data-sheet dense bf16 peak of a GPU named `device_name`, or None if not known."""
    matches = [fragment for fragment in GPU_BF16_PEAK if fragment in device_name]
    return GPU_BF16_PEAK[max(matches, key=len)] if matches else None


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


def matmul_dtype(precision: str) -> torch.dtype:
    """The dtype whose matrix multiply bounds a run: bf16 in bf16, else fp32. A CPU without
    native bf16 emulates it, and its bf16 peak is then below fp32's; precision=auto does not
    choose bf16 there (precision.py)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def datasheet_peak(device: torch.device, precision: str) -> float | None:
    """A known GPU's dense bf16 peak from its data sheet (FLOP/s) for a bf16 run; else None."""
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    peak = datasheet_bf16_peak(name)
    if peak is not None:
        return peak
    log.warning(
        "no data-sheet peak for %s: MFU uses a measured matmul peak; set "
        "logging.peak_tflops to the data sheet's figure",
        name,
    )
    return None


def device_peak_flops(device: torch.device, precision: str, configured: float | None) -> float:
    """FLOP/s that MFU is measured against: the configured figure, a GPU's data sheet, or (on
    CPU, or an unknown GPU) a matrix multiply measured now."""
    if configured:
        return configured * 1e12
    sheet = datasheet_peak(device, precision)
    if sheet is not None:
        return sheet
    return measure_matmul_peak(device, matmul_dtype(precision))
