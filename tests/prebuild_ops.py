"""Compile DeepSpeed's CPU Adam, the one C++ op the suite builds, ahead of the test that needs it.

The ZeRO-2 offload test (tests/distributed/test_deepspeed.py) steps DeepSpeedCPUAdam, which
DeepSpeed compiles on first use: about 95 s of one core on a fresh clone, spent in the
multi-process pass. `make test` starts this script in the background before it installs the
benchmark environment (pip, mostly waiting on the network and the disk) and runs the first
pass, so that the build uses cycles those leave idle. It builds where the tests look
(EXTENSIONS_DIR, which conftest.py sets for every process a test starts); a build in progress
holds torch's lock, which the test's ranks wait on, so the op is never built twice. A build
that fails here fails again in the test, which reports it.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A directory of the checkout's own keeps the tests off ~/.cache, where a user's killed build
# may have left a lock that the runs would refuse (aiayn/engine/op_builds.py).
EXTENSIONS_DIR = os.path.join(ROOT, ".cache", "torch_extensions")

if __name__ == "__main__":
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", EXTENSIONS_DIR)
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load(verbose=False)
    print(f"cpu_adam built in {os.environ['TORCH_EXTENSIONS_DIR']}", file=sys.stderr)
