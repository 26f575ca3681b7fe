"""The start-up timer: phases that cover the time, and a process creation read from /proc."""

import subprocess
import sys
import time

import pytest

from aiayn.runtime.startup import PHASES, StartupTimes, process_created


def test_timed_phases_and_the_rest_add_up_to_the_time_since_creation():
    times = StartupTimes.of_this_process()
    for name in ("process group", "model build", "checkpoint load"):
        with times.phase(name):
            time.sleep(0.05)
    times.set_up_done()
    time.sleep(0.05)
    line, split = times.first_step_done(batch_wait=0.02)

    assert list(split) == [*PHASES, "other", "total"]
    assert sum(v for k, v in split.items() if k != "total") == pytest.approx(split["total"])
    # Lower bounds only: a sleep on a busy machine may last longer, never shorter.
    assert split["model build"] >= 0.05
    assert split["data position"] == 0.02
    assert split["first step"] >= 0.03  # the 0.05 s after set-up, less the batch wait
    assert 0 <= split["other"] < min(split["model build"], 0.5)  # nothing ran outside a phase
    assert line.startswith(f"start-up {split['total']:.2f} s: process start ")
    assert times.done


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown start-up phase"):
        StartupTimes.of_this_process().add("imprts", 1.0)


def test_a_new_process_was_created_moments_before_its_first_line():
    code = "import time; t = time.time(); from aiayn.runtime.startup import process_created as c; "
    code += "print(t - c())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 0 <= float(out.stdout) < 5  # the interpreter's start: milliseconds, on a busy machine
    assert process_created() < time.time()
