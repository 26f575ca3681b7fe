"""The CPU kinds these machines come with, and how to compute as each on any x86 machine.

CI and development machines are drawn from several kinds: AVX2 only; AVX-512 without bf16;
AVX512-BF16 (with AMX on some). Each library picks its kernels by instruction set, and sums in
another order, or saturates, or emulates bf16, on each; a bound calibrated on one kind can fail
on another. Each library also takes a cap on its instruction set from the environment, so a
machine of the newest kind runs the kernels of an older one: `pytest --cpu-kind avx2` runs the
suite so (tests/conftest.py sets these variables before any kernel runs; every process a test
starts inherits them). The kernels are the older kind's; the timings are not.

An AVX2-only machine measured CTranslate2's int8 log-probability gap on the int8 export test at
0.4798; this machine with --cpu-kind avx2 measured 0.4798 too.
"""

import sys

CAPS = {
    # torch's vectorized kernels, oneDNN (torch's bf16 matmul), MKL (torch's fp32 matmul),
    # CTranslate2's own dispatch (its int8 products run in oneDNN or MKL), and the -march
    # TorchInductor compiles its C++ with: it follows ATEN_CPU_CAPABILITY for its vector width
    # but compiles for -march=native, and AVX2-wide loops built for an AVX-512 target computed
    # nan (measured).
    # aiayn.engine.precision reads ONEDNN_MAX_CPU_ISA: bf16 capped away is emulated, and
    # train.precision=auto picks fp32, as on such a machine.
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "CT2_FORCE_CPU_ISA": "AVX2",
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3",
    },
    # Skylake-X: AVX-512 without VNNI or bf16 (oneDNN's AVX512_CORE).
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "CT2_FORCE_CPU_ISA": "AVX512",
        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v4",
    },
}
VARIABLES = sorted({name for caps in CAPS.values() for name in caps})
# A cap only lowers: a machine computes as a kind whose instructions it has.
NEEDS = {"avx2": "avx2", "avx512": "avx512f"}


def cpu_flags() -> set[str]:
    """This machine's vector flags (Linux): which kinds it can compute as, and the report header.

    aiayn.engine.precision.cpu_flags reads the same line, but importing it imports torch, and
    conftest.py asks this before it sets the caps and OMP_NUM_THREADS: libgomp reads its
    thread count when torch loads it, so torch must not be loaded yet."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return {f for f in value.split() if f.startswith(("avx", "amx", "fma"))}
    except OSError:
        pass
    return set()


def can_compute_as(kind: str) -> bool:
    return NEEDS[kind] in cpu_flags()


def describe(kind: str | None) -> str:
    flags = cpu_flags()
    kinds = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in flags]
    this = f"this machine has {' '.join(kinds) or 'none of avx2, avx512f, avx512_bf16'}"
    if kind is None:
        return f"cpu kind: this machine's ({this})"
    caps = " ".join(f"{k}={v}" for k, v in CAPS[kind].items())
    return f"cpu kind: {kind}, by capping the kernels ({caps}); {this}"


if __name__ == "__main__":  # `env $(python tests/cpu_kinds.py avx2) CMD` runs CMD as that kind
    print(" ".join(f"{k}={v}" for k, v in CAPS[sys.argv[1]].items()))
