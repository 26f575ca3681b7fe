"""Run by test_start_share.py under torchrun: every rank asks CheckpointManager.resume_point
where to resume, each looking at the run_dir given for its rank (rank r takes RUN_DIRS[r], the
last for the ranks past the list), and writes what it got, the checkpoint or the error, and the
bytes it hashed to OUT/rank_<r>.json. A run_dir per rank stands for ranks that see a shared
directory differently (a stale cache, a mount missing on one node).

usage: resume_verdict.py OUT RUN_DIR [RUN_DIR ...]
"""

import json
import sys
from pathlib import Path

from aiayn.checkpoint import CheckpointManager
from aiayn.distributed.env import setup, teardown
from aiayn.errors import CheckpointError
from aiayn.runtime.durable import bytes_hashed


def main(out: str, *run_dirs: str) -> None:
    env = setup("cpu")
    run_dir = run_dirs[min(env.rank, len(run_dirs) - 1)]
    ckpts = CheckpointManager(run_dir, every_steps=10, keep_last=5, is_writer=env.is_main)
    try:
        got = {"checkpoint": str(ckpts.resume_point("auto", env))}
    except CheckpointError as exc:
        got = {"error": str(exc)}
    got["hashed"] = bytes_hashed()
    Path(out, f"rank_{env.rank}.json").write_text(json.dumps(got))
    teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])
