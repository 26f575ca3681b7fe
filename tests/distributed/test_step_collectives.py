"""Collectives per optimizer step, with two real ranks (gloo) on the path a NCCL job takes."""

import json
from pathlib import Path

import pytest

from helpers import torchrun  # tests/helpers.py
from procs import run

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("step_collectives.py")


def test_a_step_waits_for_no_collective_of_host_numbers_and_no_host_sync(setup):
    """Between the starts of two optimizer steps without a log line, each rank makes exactly
    one collective, and does not wait for it: an all-reduce of a host tensor over a gloo group
    of its own (which on a NCCL job waits for nothing queued on the GPU), started by one step
    and read by the next: the stop request (StopVote). The step's tokens and train.max_epochs'
    limit come from the token cache's plan, which every rank knows whole (they were in that
    all-reduce, waited for, and before that each an all-reduce on the default group, through
    the GPU). The DDP step itself makes no host sync."""
    root, config = setup
    out = root / "step_collectives"
    out.mkdir()
    overrides = [
        "train.max_steps=5",
        "train.max_epochs=100",  # the loop checks the epoch limit at every step
        "train.eval_every=0",
        "logging.every_steps=100",  # only the last step logs
        "checkpoint.every_steps=100",
    ]
    run(torchrun(2) + [str(WORKER), str(config), str(out), f"run_dir={out / 'run'}", *overrides])
    for rank in (0, 1):
        seen = json.loads((out / f"rank_{rank}.json").read_text())
        calls, steps = seen["calls"], seen["steps"]
        assert len(steps) == 5
        for before, after in zip(steps, steps[1:], strict=False):
            between = calls[before["first_call"] : after["first_call"]]
            expected = {"op": "all_reduce", "group": "gloo", "devices": ["cpu"], "waits": False}
            assert between == [expected], between
        assert all(step["syncs"] == [] for step in steps), steps
