import os

import pytest

import cpu_kinds  # tests/cpu_kinds.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DeepSpeed compiles its C++ ops into TORCH_EXTENSIONS_DIR on first use. A directory of the
# checkout's own keeps the tests off ~/.cache, where a user's killed build may have left a lock
# that the runs would refuse (aiayn/engine/op_builds.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))


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


def pytest_report_header(config):
    return cpu_kinds.describe(config.getoption("--cpu-kind"))


@pytest.fixture
def project_root():
    return ROOT
