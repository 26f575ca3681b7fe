"""`pytest --cpu-kind KIND` (tests/cpu_kinds.py) reaches every library a test runs: a process
started with a kind's caps computes on that kind's kernels, and train.precision=auto decides as
on such a machine."""

import json
import os
import subprocess
import sys

import pytest

from cpu_kinds import CAPS, NEEDS, VARIABLES, can_compute_as

PROBE = """
import json, torch
from aiayn.engine.precision import resolve_precision
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(),
                  "auto": resolve_precision("auto", torch.device("cpu"))}))
"""


@pytest.mark.parametrize("kind", sorted(CAPS))
def test_a_process_with_a_kinds_caps_runs_that_kinds_kernels(kind):
    if not can_compute_as(kind):
        pytest.skip(f"this machine has no {NEEDS[kind]}")
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**env, **CAPS[kind]},
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"aten": kind.upper(), "auto": "fp32"}


def test_the_option_caps_this_process_and_what_it_starts(request):
    kind = request.config.getoption("--cpu-kind")
    if kind is None:
        pytest.skip("the suite runs on this machine's own kernels (no --cpu-kind)")
    assert {k: os.environ.get(k) for k in CAPS[kind]} == CAPS[kind]
    import torch

    assert torch.backends.cpu.get_cpu_capability() == kind.upper()
