"""Process-group timeouts in real processes (gloo): set-up waits as long as
distributed.setup_timeout_minutes allows, and after it a rank that stops answering makes the
others fail within distributed.timeout_minutes instead of the set-up's."""

import re
import subprocess

import pytest

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file

pytestmark = pytest.mark.distributed

SETUP_WAIT_S = 8  # rank 1 is this late to set-up's first collective
TIMEOUT_S = 3  # training's timeout: shorter than that wait

RANKS = f"""
import os, sys, time
import torch, torch.distributed as dist
from aiayn.distributed.env import setup, use_timeout

env = setup("cpu", timeout_minutes=0.5)
if env.rank == 1:
    time.sleep({SETUP_WAIT_S})  # rank 0 training a tokenizer, as the others wait
dist.all_reduce(torch.ones(1))
print(f"rank {{env.rank}} set-up done", flush=True)
use_timeout({TIMEOUT_S} / 60)
if env.rank == 1:
    time.sleep(120)  # hung: never reaches the next collective
    sys.exit(0)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except Exception as exc:
    print(f"rank 0 failed after {{time.monotonic() - started:.1f}} s: {{exc}}", flush=True)
    os._exit(3)
print("rank 0: the collective returned", flush=True)
"""


def test_a_hung_rank_fails_the_others_within_the_training_timeout(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = subprocess.run(
        [*helpers.torchrun(2), str(script)],
        capture_output=True,
        text=True,
        timeout=100,  # under the hung rank's 120 s: the short timeout must end it
        env=procs.ENV,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 0 set-up done" in out and "rank 1 set-up done" in out, out[-3000:]
    failed = re.search(r"rank 0 failed after ([\d.]+) s: (.*)", out)
    assert failed, out[-3000:]
    assert TIMEOUT_S - 0.5 <= float(failed.group(1)) <= TIMEOUT_S + 10, failed.group(0)
    assert "timed out" in failed.group(2).lower() or "timeout" in failed.group(2).lower()
