"""launch/*.sh: each prints the command it runs, then runs it to the end (tiny run, CPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiayn.data import demo

from helpers import TINY_MODEL, free_port, model_overrides  # tests/helpers.py

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo.write_numbers(tmp_path_factory.mktemp("numbers"), 500, 20, 10)


# (script, its leading arguments, environment, processes it starts, what its command line says)
WRAPPERS = {
    "single": ("single.sh", [], {}, 1, "python -m aiayn train"),
    "torchrun": (
        "torchrun.sh",
        [],
        {"NPROC": "2"},
        2,
        "python -m aiayn.distributed.run --standalone --nproc_per_node=2 --max-restarts=3",
    ),
    "multinode": (
        "multinode.sh",
        [],
        # PYTHON of several words, as a container runtime's prefix: `env` execs the rest.
        {"NNODES": "1", "NODE_RANK": "0", "MASTER": "127.0.0.1:{port}", "PYTHON": "env python"},
        1,
        "+ env python -m aiayn.distributed.run --nnodes=1 --node_rank=0",
    ),
    "accelerate": (
        "accelerate.sh",
        ["{tmp}/accelerate.yaml"],  # configs/accelerate/ddp_2proc.yaml on a free port
        {},
        2,
        "accelerate launch --config_file",
    ),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_a_launch_wrapper_prints_its_command_and_trains(tmp_path, corpus, name):
    script, lead, extra_env, ranks, says = WRAPPERS[name]
    bin_dir = Path(sys.executable).parent
    if name == "accelerate" and not (bin_dir / "accelerate").exists():
        pytest.skip("accelerate is not installed")
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",  # this venv's python, torchrun
        "OMP_NUM_THREADS": "1",
        **{k: v.format(port=port) for k, v in extra_env.items()},
    }
    run_dir = tmp_path / "run"
    overrides = [
        f"run_dir={run_dir}",
        f"data.train={corpus}/train",
        "data.src_lang=en",
        "data.tgt_lang=de",
        *model_overrides(TINY_MODEL, max_len=None),  # max_len: the default
        "tokenizer.vocab_size=100",
        "train.max_tokens=400",
        "train.max_steps=2",
    ]
    if name == "accelerate":  # it ignores MASTER_PORT: the port goes in its config file
        acc = (ROOT / "configs" / "accelerate" / "ddp_2proc.yaml").read_text()
        (tmp_path / "accelerate.yaml").write_text(acc + f"main_process_port: {port}\n")
    lead = [a.format(tmp=tmp_path) for a in lead]
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    proc = subprocess.run(
        [str(ROOT / "launch" / script), *lead, str(empty), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    printed = proc.stderr.splitlines()[0]
    assert printed.startswith("+ ") and says in printed, printed
    assert f"--config {empty}" in printed and "train.max_steps=2" in printed
    assert f"x {ranks} ranks per step" in (run_dir / "train.log").read_text()
    if name == "multinode":  # this run's rendezvous id, not one every run shares
        assert re.search(r" --rdzv-backend=c10d --rdzv-endpoint=127\.0\.0\.1:\d+ "
                         r"--rdzv-id=aiayn-\d+ ", printed), printed  # fmt: skip
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
