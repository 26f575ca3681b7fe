import pytest
import torch

import aiayn.engine.precision
import aiayn.train.flops
from aiayn.engine.precision import ONEDNN_ISA_VARIABLES, cpu_flags, native_bf16, resolve_precision
from aiayn.train.flops import matmul_dtype

from fake_cuda import FakeCuda

CPU = torch.device("cpu")


def test_cpu_flags_reads_the_first_processors_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    assert cpu_flags(info) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.fixture
def uncapped(monkeypatch):
    """oneDNN as on a machine of the kind the flags given describe: not capped (tests/cpu_kinds.py
    caps it to reproduce another kind)."""
    for name in ONEDNN_ISA_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_auto_is_bf16_only_on_a_cpu_with_native_bf16(uncapped):
    assert resolve_precision("auto", CPU, {"avx512f", "avx512_bf16"}) == "bf16"
    assert resolve_precision("auto", CPU, {"amx_tile", "amx_bf16"}) == "bf16"
    # AVX-512 without its BF16 extension emulates bf16, slower than fp32.
    assert resolve_precision("auto", CPU, {"avx512f", "avx512bw", "avx2"}) == "fp32"
    assert not native_bf16(CPU, set())


@pytest.mark.parametrize(
    "environ, native",
    [
        ({}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False),
        ({"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    ],
)
def test_onednn_capped_below_bf16_emulates_it_on_any_cpu(environ, native):
    """ONEDNN_MAX_CPU_ISA is how tests/cpu_kinds.py makes this machine compute as another kind."""
    assert native_bf16(CPU, {"avx512f", "avx512_bf16", "amx_bf16"}, environ) is native


def test_a_named_precision_is_kept_whatever_the_device():
    for precision in ("fp32", "bf16", "fp16"):
        assert resolve_precision(precision, CPU, set()) == precision
        assert resolve_precision(precision, CPU, {"avx512_bf16"}) == precision


def test_mfu_counts_a_bf16_run_against_the_bf16_matmul():
    assert matmul_dtype("bf16") == torch.bfloat16
    assert matmul_dtype("fp32") == torch.float32


@pytest.mark.parametrize(
    "flags, measured", [({"avx512_bf16"}, torch.bfloat16), ({"avx2"}, torch.float32)]
)
def test_emulated_bf16_is_measured_against_the_fp32_matmul(monkeypatch, uncapped, flags, measured):
    # Without native bf16 a 2048^3 bf16 multiply takes minutes: the run would wait at start.
    seen = []
    monkeypatch.setattr(aiayn.engine.precision, "cpu_flags", lambda: flags)
    monkeypatch.setattr(
        aiayn.train.flops, "measure_matmul_peak", lambda d, dtype: seen.append(dtype) or 1e9
    )
    assert aiayn.train.flops.device_peak_flops(CPU, "bf16", None) == 1e9
    assert seen == [measured]


@pytest.mark.parametrize(
    "name, cc, chosen",
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), "bf16"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16"),
        # bf16 is emulated below compute capability 8: fp16 tensor cores with loss scaling.
        ("Tesla V100-SXM2-16GB", (7, 0), "fp16"),
        ("Tesla T4", (7, 5), "fp16"),
        ("Tesla P100-PCIE-16GB", (6, 0), "fp32"),  # no tensor cores
    ],
)
def test_auto_on_a_gpu_picks_bf16_only_where_it_is_native(monkeypatch, name, cc, chosen):
    FakeCuda(monkeypatch, count=1, name=name, cc=cc)
    assert resolve_precision("auto", torch.device("cuda", 0)) == chosen
