"""aiayn.train.flops: the FLOP count behind MFU, and the peaks it is measured against."""

import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import aiayn.train.flops
from aiayn.config import load_config
from aiayn.engine.loss import batch_loss
from aiayn.model import build_model
from aiayn.train.flops import (
    datasheet_gpu_peak,
    datasheet_peak,
    device_peak_flops,
    measure_matmul_peak,
    training_flops,
)

from batches import padded_batch
from fake_cuda import FakeCuda

VOCAB = 50


@pytest.mark.parametrize("kind", ["seq2seq", "lm", "classifier"])
def test_training_flops_is_what_torch_counts_in_a_forward_and_backward(kind):
    """torch's FLOP counter over a real step, with attention on SDPA's math backend (whose
    matrix multiplies it can see): every multiply the model runs, padding and the output
    projection at non-pad targets only included, and nothing else."""
    fmt = [] if kind == "seq2seq" else ["data.format=text"]
    cfg = load_config(None, ["model.preset=tiny", "data.train=x", f"model.kind={kind}", *fmt])
    model = build_model(cfg.model, VOCAB, 0)
    batch = padded_batch(kind)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        loss, _ = batch_loss(model, batch, kind, 0.1, 0)
        loss.backward()
    assert training_flops(cfg.model, VOCAB, batch) == counter.get_total_flops()


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),  # not the SXM part's 989
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", 181e12),  # not the L4's 121
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),  # not an A100
        ("Tesla V100-SXM2-16GB", None),  # no bf16 units
        ("NVIDIA GeForce RTX 4090", None),  # unknown: MFU falls back to a measured peak
    ],
)
def test_the_data_sheet_peak_is_the_named_gpus_own(name, peak):
    assert datasheet_gpu_peak(name, "bf16") == (None if peak is None else pytest.approx(peak))


@pytest.mark.parametrize(
    "precision, tf32, peak",
    [
        ("bf16", True, 989.4e12),
        ("fp16", True, 989.4e12),
        ("fp32", True, 494.7e12),  # TF32 tensor cores (train.tf32, the default)
        ("fp32", False, 66.9e12),  # fp32 units only
    ],
)
def test_mfu_on_a_gpu_counts_against_the_peak_of_the_runs_arithmetic(
    monkeypatch, precision, tf32, peak
):
    FakeCuda(monkeypatch, count=1, name="NVIDIA H100 80GB HBM3", sms=132)
    h100 = torch.device("cuda", 0)
    assert device_peak_flops(h100, precision, None, tf32=tf32) == pytest.approx(peak)


def test_a_mig_slice_gets_its_share_of_the_gpus_peak(monkeypatch):
    FakeCuda(monkeypatch, count=1, name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", sms=16)
    assert datasheet_peak(torch.device("cuda", 0), "bf16") == pytest.approx(989.4e12 * 16 / 132)
    FakeCuda(monkeypatch, count=1, name="NVIDIA A100-SXM4-40GB MIG 3g.20gb", sms=42)
    assert datasheet_peak(torch.device("cuda", 0), "fp32") == pytest.approx(156e12 * 42 / 108)


def test_a_v100_is_measured_against_its_fp16_tensor_cores(monkeypatch):
    FakeCuda(monkeypatch, count=1, name="Tesla V100-SXM2-16GB", sms=80, cc=(7, 0))
    assert datasheet_peak(torch.device("cuda", 0), "fp16") == pytest.approx(125e12)
    assert datasheet_peak(torch.device("cuda", 0), "fp32") is None  # no TF32: measured


def test_the_matmul_peak_leaves_the_global_random_stream_alone():
    """It runs at startup: drawing from torch's generator would change every dropout mask
    after it, so a resumed run would not replay the run it continues."""
    before = torch.get_rng_state()
    flops = measure_matmul_peak(torch.device("cpu"), torch.float32, n=256, seconds=0.05)
    assert torch.equal(torch.get_rng_state(), before)
    assert math.isfinite(flops) and flops > 1e8  # even a slow CPU does 0.1 GFLOP/s


def test_a_configured_peak_is_used_as_given_and_a_cpu_is_measured():
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "fp32", configured=2.5) == 2.5e12
    assert 1e8 < device_peak_flops(cpu, "fp32", configured=None) < 1e14


def test_a_measured_peak_is_kept_for_the_restarts_of_the_run(tmp_path, monkeypatch):
    """A restart reads the peak its run measured (one MFU denominator, no matmul at start);
    another kind of device, or another thread count, measures its own."""
    measured = []
    monkeypatch.setattr(
        aiayn.train.flops, "measure_matmul_peak", lambda d, dtype: measured.append(dtype) or 1e9 + 1
    )
    cpu, kept = torch.device("cpu"), tmp_path / "peak_flops.json"
    assert device_peak_flops(cpu, "fp32", None, kept=kept, keep=False) == 1e9 + 1
    assert not kept.exists()  # only rank 0 writes
    device_peak_flops(cpu, "fp32", None, kept=kept)
    assert device_peak_flops(cpu, "fp32", None, kept=kept) == 1e9 + 1
    assert len(measured) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        device_peak_flops(cpu, "fp32", None, kept=kept)
    finally:
        torch.set_num_threads(threads)
    assert len(measured) == 3


def test_a_measured_peak_that_training_outruns_is_raised_so_mfu_never_exceeds_1(tmp_path):
    """A CPU's peak is a matmul measured at the run's first start, maybe under load (a run
    logged mfu 1.1): when training outruns it, MFU counts against the rate reached, kept for
    restarts. A data sheet's or a configured peak stays as it is."""
    from types import SimpleNamespace

    from aiayn.train.report import mfu_peak

    kept = tmp_path / "peak_flops.json"
    kept.write_text(json.dumps({"device": "cpu", "flops": 1e11}))
    env = SimpleNamespace(world_size=2, is_main=True)
    run = SimpleNamespace(
        peak_measured=True, peak_flops=1e11, env=env, cfg=SimpleNamespace(run_dir=tmp_path)
    )
    assert mfu_peak(run, 1.5e11) == 1e11  # 0.75e11 per rank: below the peak
    assert mfu_peak(run, 3e11) == 1.5e11 and json.loads(kept.read_text())["flops"] == 1.5e11
    run.peak_measured, run.peak_flops = False, 1e11
    assert mfu_peak(run, 3e11) == 1e11
