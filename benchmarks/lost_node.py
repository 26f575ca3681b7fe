"""A lost node: how long until the other nodes' launchers give it up.

Two launchers of `python -m aiayn.distributed.run` ("nodes", one rank each, c10d rendezvous)
train configs/demo.yaml on the numbers corpus; at step 8 rank 1's node vanishes: its launcher
and its worker are SIGSTOPped (tests/distributed/faulty.py's sigstop-node), so its sockets stay
open and its heartbeats stop, as when a machine dies. The figure is the seconds from then to
the other launcher's exit: distributed.timeout_minutes for its collective to fail, then the
restart's rendezvous waiting for the lost node (restart_join_timeout; torch's join_timeout,
600 s, before the launcher had one).

    python benchmarks/lost_node.py                          # the defaults: about 105 s
    python benchmarks/lost_node.py --timeout-minutes 0.1 --rdzv-conf restart_join_timeout=3

The rendezvous store is hosted by this script, so that the node that vanishes is never the one
holding it (on a cluster it is the first node's launcher).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import machine
from faults import base_overrides, prepare
from resume_time import ROOT, end, environment
from torch.distributed import TCPStore

FAULTY = ROOT / "tests" / "distributed" / "faulty.py"
LOST_AT_STEP = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-minutes", type=float, default=None, help="default: config's")
    parser.add_argument("--rdzv-conf", default="", help="more --rdzv-conf keys, e.g. join_timeout")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "bench" / "faults")
    args = parser.parse_args()
    print(machine())
    prepare(args.root)
    run_dir = args.root / "lost-node"
    overrides = base_overrides(args.root, run_dir)
    overrides = [o for o in overrides if not o.startswith("train.max_steps=")] + [
        "train.max_steps=100"
    ]
    if args.timeout_minutes is not None:
        overrides.append(f"distributed.timeout_minutes={args.timeout_minutes}")
    port = 20000 + random.randrange(20000)
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    conf = ",".join(c for c in ("is_host=0", args.rdzv_conf) if c)
    cmd = [
        sys.executable, "-m", "aiayn.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=lost-{port}", f"--rdzv-conf={conf}",
        str(FAULTY), "sigstop-node", "1", str(LOST_AT_STEP),
        "train", "--config", "configs/demo.yaml", *overrides,
    ]  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)
    logs = [args.root / f"lost-node.{n}.out" for n in range(2)]
    nodes = []
    for log in logs:
        with open(log, "w") as out:
            nodes.append(
                subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(2), cwd=ROOT
                )
            )
    injected = run_dir / "injected.jsonl"
    try:
        while not (injected.is_file() and injected.read_text().strip()):
            if any(node.poll() is not None for node in nodes):
                raise RuntimeError(f"a launcher ended before the node was lost: {logs}")
            time.sleep(0.05)
        lost = json.loads(injected.read_text().splitlines()[0])["time"]
        while all(node.poll() is None for node in nodes):
            time.sleep(0.05)
        gave_up = time.time()
        code = next(node.returncode for node in nodes if node.returncode is not None)
    finally:
        for node in nodes:
            end(node)  # SIGKILL ends the stopped one too
        del store
    timeout = "the config's" if args.timeout_minutes is None else args.timeout_minutes
    print(
        f"node lost at step {LOST_AT_STEP}; the other launcher exited {code} "
        f"{gave_up - lost:.1f} s later (distributed.timeout_minutes {timeout}, "
        f"--rdzv-conf={conf}; logs: {', '.join(map(str, logs))})"
    )


if __name__ == "__main__":
    main()
