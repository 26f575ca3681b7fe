"""launch/multinode.sh prints the command it runs, then runs it to the end (tiny run, CPU); the
other wrappers start test_ddp.py's runs, which check the same of them."""

import re

import pytest

from helpers import free_port  # tests/helpers.py
from procs import launch_wrapper

pytestmark = pytest.mark.distributed


def test_the_multinode_wrapper_prints_its_command_with_this_runs_rendezvous_and_trains(setup):
    """multinode.sh on one node: PYTHON of several words (a container runtime's prefix: `env`
    execs the rest), the node's settings, and a rendezvous id of this run's, not one every run
    shares. (single.sh, torchrun.sh and accelerate.sh start test_ddp.py's runs.)"""
    root, config = setup
    run_dir = root / "multinode"
    env = {"NNODES": "1", "NODE_RANK": "0", "MASTER": f"127.0.0.1:{free_port()}"}
    env["PYTHON"] = "env python"
    args = (str(config), f"run_dir={run_dir}", "train.max_steps=2")
    printed = launch_wrapper("multinode.sh", *args, env=env, timeout=300)
    assert "+ env python -m aiayn.distributed.run --nnodes=1 --node_rank=0" in printed, printed
    assert f"--config {config}" in printed and "train.max_steps=2" in printed
    assert re.search(r" --rdzv-backend=c10d --rdzv-endpoint=127\.0\.0\.1:\d+ "
                     r"--rdzv-id=aiayn-\d+ ", printed), printed  # fmt: skip
    assert "x 1 ranks per step" in (run_dir / "train.log").read_text()
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
