import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# DeepSpeed compiles its C++ ops into TORCH_EXTENSIONS_DIR on first use. A directory of the
# checkout's own keeps the tests off ~/.cache, where a user's killed build may have left a lock
# that the runs would refuse (aiayn/distributed/op_builds.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))


@pytest.fixture
def project_root():
    return ROOT
