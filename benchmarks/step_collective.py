"""What the training loop's one collective per step costs, at W = 2, 4, 8 processes (gloo, CPU).

    python benchmarks/step_collective.py                  # W = 2 4 8, 2,000 calls each
    python benchmarks/step_collective.py --world 2 4 --calls 500

Before each optimizer step every rank all-reduced three host numbers over a gloo group (the
step's target tokens, which the loss is divided by before backward; whether a rank was asked
to stop; whether a rank's step reached train.max_epochs), before the loader gave each round's
totals on every path (data/loader.py) and the stop request became a vote. This times that
call, `DistEnv.sum` of three floats, as the loop makes it: each rank alone in a loop of
calls, torchrun on this machine. A small all-reduce on gloo is latency, not bandwidth: its
time grows with the hops between the ranks, so the table gives the time per call and per
rank, from which the cost at 1,024 ranks is extrapolated (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, markdown_table, torchrun

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def worker(out: Path, calls: int, step_ms: float) -> None:
    from aiayn.distributed.env import setup, teardown

    env = setup("cpu")
    for _ in range(50):  # the group's connections, made on first use
        env.sum([1.0, 0.0, 0.0])
    env.barrier()
    waits, later = [], []
    for _ in range(calls):  # the loop before: every step waits for its all-reduce
        started = time.perf_counter()
        env.sum([600.0, 0.0, 0.0])
        waits.append(time.perf_counter() - started)
    env.barrier()
    pending = env.sum_later([0.0])
    for _ in range(calls // 10):  # StopVote: started by a step, read by the next
        time.sleep(step_ms / 1000)  # the step's work
        started = time.perf_counter()
        pending()
        later.append(time.perf_counter() - started)
        pending = env.sum_later([0.0])
    pending()
    if env.is_main:
        out.write_text(json.dumps({"waits": waits, "later": later}))
    teardown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=20.0, help="a step's work between votes")
    args = p.parse_args(argv)
    print(f"Machine: {machine()}\n")
    header = [
        "W",
        "median µs per call",
        "p90 µs",
        "median µs / (2 (W - 1))",
        f"µs waited when started a {args.step_ms:g} ms step before: median / p90",
    ]
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "times.json"
            cmd = [
                *torchrun(world),
                __file__,
                "--worker",
                str(out),
                str(args.calls),
                str(args.step_ms),
            ]
            subprocess.run(cmd, check=True, env=env, capture_output=True)
            got = json.loads(out.read_text())
        times, later = sorted(got["waits"]), sorted(got["later"])
        median = statistics.median(times) * 1e6
        p90 = times[int(0.9 * len(times))] * 1e6
        waited = f"{statistics.median(later) * 1e6:.0f} / {later[int(0.9 * len(later))] * 1e6:.0f}"
        per_hop = f"{median / (2 * (world - 1)):.0f}"
        rows.append([str(world), f"{median:.0f}", f"{p90:.0f}", per_hop, waited])
        print(markdown_table(header, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(header, rows))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
