"""The start-up line: a new run and a resumed one each log where their start went."""

import re

from aiayn.config import load_config
from aiayn.runtime.startup import PHASES
from aiayn.train import metrics_file, train

import tiny  # tests/e2e/tiny.py, beside this file

LINE = re.compile(r"start-up ([\d.]+) s: (.*)")


def test_a_resumed_run_logs_its_start_up_split_once_its_first_step_is_over(tmp_path, numbers):
    def run(steps: int) -> None:
        extra = (f"train.max_steps={steps}", "checkpoint.every_steps=2", "train.threads=1")
        train(load_config(None, tiny.overrides(tmp_path, numbers, *extra)))

    run(2)
    run(3)  # resumes from step 2

    log = (tmp_path / "train.log").read_text()
    resumed = log[log.index("resuming from") :]
    found = LINE.search(resumed)
    assert found and len(LINE.findall(log)) == 2, log
    assert found.start() < resumed.index("train step 3 |")  # logged when step 3 ends
    parts = dict(part.rsplit(" ", 2)[:2] for part in found.group(2).split(", "))
    assert list(parts) == [*PHASES, "other"]
    # Each figure is rounded to 10 ms.
    assert abs(sum(map(float, parts.values())) - float(found.group(1))) < 0.06
    # The line rounds to 10 ms, which a tiny checkpoint's load can take less than; the
    # scalars (metrics.jsonl, as TensorBoard's) hold the seconds unrounded.
    loads = [
        row["startup_s/checkpoint_load"]
        for row in metrics_file.read(tmp_path / "metrics.jsonl")
        if "startup_s/checkpoint_load" in row
    ]
    assert len(loads) == 2 and loads[0] == 0 < loads[1], loads  # the new run's, the resumed's
