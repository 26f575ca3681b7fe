import os
import sys

import pytest
from prebuild_ops import EXTENSIONS_DIR  # tests/prebuild_ops.py

import cpu_kinds  # tests/cpu_kinds.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest_plugins = ("cpu_seconds",)  # tests/cpu_seconds.py: each test's CPU, listed at the end

# DeepSpeed compiles its C++ ops into TORCH_EXTENSIONS_DIR on first use (`make test` starts the
# one the suite needs early: tests/prebuild_ops.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-kind",
        choices=sorted(cpu_kinds.CAPS),
        help="run every test, and every process a test starts, on the kernels of this CPU kind "
        "(tests/cpu_kinds.py)",
    )


def pytest_configure(config):
    # Before any kernel runs: each library reads its cap once, at its first use.
    kind = config.getoption("--cpu-kind")
    if kind is not None:
        if not cpu_kinds.can_compute_as(kind):
            raise pytest.UsageError(
                f"--cpu-kind {kind}: this machine has no {cpu_kinds.NEEDS[kind]}; a cap only "
                "lowers the instruction set"
            )
        os.environ.update(cpu_kinds.CAPS[kind])
    # Side by side (pytest-xdist, make test) each worker, and every process its tests start,
    # takes its share of the cores: OpenMP threads spinning on a core another worker computes on
    # slow both. One process's default threads are torch's, as before; tests that compare runs
    # bitwise pin the threads of both (OMP_NUM_THREADS=1, train.threads=1) either way.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(workers)))


# Files of many launches each, started first: pytest-xdist hands a file (make test's
# --dist loadfile) to the next free worker in collection order, and these, collected late by
# name, left one worker running for minutes after the other had finished.
LONGEST_FIRST = (
    "test_topology.py",
    "test_restarts.py",
    "test_sharded_resume.py",
    "test_zero3_memory.py",
)


def pytest_collection_modifyitems(config, items):
    def order(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=order)  # stable: every other file keeps its place


def pytest_report_header(config):
    return cpu_kinds.describe(config.getoption("--cpu-kind"))


@pytest.fixture
def project_root():
    return ROOT


def _torch_switches() -> tuple:
    """The process-wide switches a run sets (runtime/torch_settings.py): deterministic
    kernels, TF32, the attention kernels, and TorchInductor's determinism once imported."""
    import torch

    b = torch.backends
    inductor = sys.modules.get("torch._inductor.config")
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        b.cudnn.deterministic,
        b.cudnn.benchmark,
        b.cuda.matmul.allow_tf32,
        b.cudnn.allow_tf32,
        (b.cuda.cudnn_sdp_enabled(), b.cuda.flash_sdp_enabled()),
        (b.cuda.mem_efficient_sdp_enabled(), b.cuda.math_sdp_enabled()),
        getattr(inductor, "deterministic", False),  # its default before it is imported
    )


@pytest.fixture(scope="session", autouse=True)
def torch_switches_at_start() -> tuple:
    """The switches as the session found them: before any module's fixture trained a run."""
    return _torch_switches()


@pytest.fixture(autouse=True)
def torch_switches_restored(torch_switches_at_start):
    """After each test, the switches as the session started: a test or a module's fixture that
    trains in this process (train.deterministic=true, say) must not change what the tests after
    it find. Each run sets what it needs when it starts."""
    yield
    if _torch_switches() == torch_switches_at_start:
        return
    import torch

    b = torch.backends
    det, warn, cudnn_det, bench, tf32, cudnn_tf32, sdp1, sdp2, ind = torch_switches_at_start
    torch.use_deterministic_algorithms(det, warn_only=warn)
    b.cudnn.deterministic, b.cudnn.benchmark = cudnn_det, bench
    b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = tf32, cudnn_tf32
    b.cuda.enable_cudnn_sdp(sdp1[0])
    b.cuda.enable_flash_sdp(sdp1[1])
    b.cuda.enable_mem_efficient_sdp(sdp2[0])
    b.cuda.enable_math_sdp(sdp2[1])
    if (inductor := sys.modules.get("torch._inductor.config")) is not None:
        inductor.deterministic = ind
