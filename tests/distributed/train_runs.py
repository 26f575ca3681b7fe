"""Several `aiayn train` runs in one launch, one after another in one process group:

    train_runs.py CONFIG RUN_DIR [OVERRIDES ...] [-- RUN_DIR [OVERRIDES ...]] ...

A launch's start-up (the imports, the process group, DeepSpeed's first engine) is most of a
short run's cost, so the tests whose runs share a launcher and a world size share a launch
(procs.train_runs). Each run is `aiayn train` as the command line runs it, with its own
run_dir, seed and RNG streams; only the group outlives it (test_step_collectives.py's driver
does the same). The first run that fails ends the launch with its exit code."""

import sys

from aiayn import cli
from aiayn.train import loop


def runs_of(args: tuple[str, ...]) -> list[list[str]]:
    """Each run's arguments from ARGS [-- ARGS] ... (procs.one_launch joins them)."""
    runs: list[list[str]] = [[]]
    for arg in args:
        if arg == "--":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def main(config: str, *args: str) -> int:
    runs = runs_of(args)
    # The runs share the process group (and DeepSpeed's groups made from it): torn down once,
    # after the last.
    teardown, loop.teardown = loop.teardown, lambda: None
    try:
        for run_dir, *overrides in runs:
            code = cli.main(["train", "--config", config, f"run_dir={run_dir}", *overrides])
            if code:
                return code
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
