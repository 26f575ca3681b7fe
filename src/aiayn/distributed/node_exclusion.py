"""After a failed Slurm job start: which nodes the run's next jobs avoid, and whether it goes on.

slurm/train.sbatch asks `python -m aiayn.distributed.node_exclusion at-start|after-failure ...`
(main() below) and acts on the answer; the policy is here, where tests reach it without a
cluster. It reads the run's fault log (distributed/faults.py) and keeps two files in the run
directory: `excluded_nodes` (the nodes to avoid) and `slurm_failures.jsonl` (each failed start).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiayn.distributed.faults import (
    FAULTS_FILE,
    USER_ERROR_EXIT_CODE,
    Fault,
    append_jsonl,
    read_jsonl,
)
from aiayn.distributed.faults import read as read_faults
from aiayn.errors import AiaynError
from aiayn.runtime.durable import write_atomic

EXCLUDED_FILE = "excluded_nodes"  # one node name a line: nodes this run's jobs avoid
FAILURES_FILE = "slurm_failures.jsonl"  # one line per failed Slurm job attempt
# A worker whose collective failed is a witness, not a culprit: another rank died or stalled
# (train/peers.py's PeerError). So is one whose rendezvous or store lost its peers.
LOST_PEER = re.compile(
    r"a collective failed|connection (closed|reset|refused)|broken pipe|rendezvous", re.I
)
# What a node's hardware or drivers say when they fail. A signal (the kernel's OOM killer, a
# SIGSEGV or SIGBUS, a node going down) is the node's too. An exception otherwise (a bug, a
# corpus, the Hub, out of memory for the batch) would fail the same way on any node.
NODE_ERROR = re.compile(
    r"CUDA error|cudaError|CUBLAS_STATUS|CUDNN_STATUS|NCCL|\bECC\b|\bXid\b|uncorrectable|"
    r"device (lost|not ready|unavailable)|no CUDA-capable device|Input/output error",
    re.I,
)


@dataclass
class Decision:
    """What the batch script does next: "requeue" (avoiding `exclude`), "stop" or "run"."""

    action: str
    exclude: list[str]
    message: str

    def shell(self) -> str:
        """key=value lines for bash's `read` (one line each: newlines become spaces)."""
        rows = {"action": self.action, "exclude": ",".join(self.exclude), "message": self.message}
        return "".join(f"{k}={' '.join(v.split())}\n" for k, v in rows.items())


def attempt_faults(faults: list[Fault], job: str, restart: int) -> list[Fault]:
    """The faults logged by one start of a Slurm job (its SLURM_RESTART_COUNT)."""
    return [f for f in faults if f.slurm_job == job and f.slurm_restart == restart]


def _lost_peer(fault: Fault) -> bool:
    return bool(LOST_PEER.search(fault.error))


def node_fault(fault: Fault) -> bool:
    """Whether `fault` is the node's: a signal, or a device, driver or NCCL error."""
    return fault.exitcode < 0 or bool(NODE_ERROR.search(fault.error))


def _final(faults: list[Fault]) -> list[Fault]:
    """The failures that ended the attempt: after its in-job restarts, the primary ones (not a
    lost peer) where there are any."""
    last = [f for f in faults if f.action == "stop"] or faults
    return [f for f in last if not _lost_peer(f)] or last


def culprits(faults: list[Fault], job_nodes: list[str]) -> list[str]:
    """The nodes to blame for a failed attempt. A node whose worker failed in a way that is the
    node's (node_fault: a signal, a device or NCCL error) is; one whose worker raised another
    exception is not (it would fail the same way elsewhere), nor one whose workers only lost a
    peer. When every fault is a lost peer, the suspects are the job's nodes that logged nothing
    (a stalled rank, a node whose launcher died with it), unless that is all of them; with no
    fault logged at all, none."""
    primary = [f for f in _final(faults) if not _lost_peer(f)]
    if primary:
        return sorted({f.node for f in primary if node_fault(f)})
    silent = [n for n in job_nodes if n not in {f.node for f in faults}]
    return silent if faults and len(silent) < len(job_nodes) else []


def signature(faults: list[Fault], exitcode: int) -> str:
    """How an attempt failed, with numbers (steps, ranks, addresses) masked: two attempts that
    failed "the same way" have equal signatures."""
    final = _final(faults)
    if not final:
        return f"exit {exitcode}, no fault logged"
    first = min(final, key=lambda f: f.time)
    text = f"{first.how}: {first.error}" if first.error else first.how
    return re.sub(r"\d+", "N", text)


def read_excluded(run_dir: str | Path) -> list[str]:
    path = Path(run_dir) / EXCLUDED_FILE
    return path.read_text().split() if path.is_file() else []


def failed_in_a_row(history: list[dict], job: str, restart: int, sig: str) -> int:
    """How many starts of `job`, counting back from `restart`, each failed with `sig`. A start
    that ended otherwise (preempted: it saved and requeued) leaves no row and breaks the run."""
    by_restart = {r["slurm_restart"]: r["signature"] for r in history if r["slurm_job"] == job}
    n = 0
    while by_restart.get(restart - n) == sig:
        n += 1
    return n


def after_failure(
    run_dir: str | Path,
    job: str,
    restart: int,
    exitcode: int,
    job_nodes: list[str],
    cluster_nodes: list[str],
    max_failures: int,
) -> Decision:
    """Decide, after a start of `job` failed (not preempted), whether to requeue it avoiding
    the nodes to blame, or to stop; record the attempt and the grown exclusion list."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    faults = attempt_faults(read_faults(run_dir), job, restart)
    sig = signature(faults, exitcode)
    blamed = culprits(faults, job_nodes)
    row = {"slurm_job": job, "slurm_restart": restart, "exitcode": exitcode,
           "signature": sig, "nodes": job_nodes, "blamed": blamed, "time": time.time()}  # fmt: skip
    append_jsonl(run_dir / FAILURES_FILE, [row])
    times = failed_in_a_row(read_jsonl(run_dir / FAILURES_FILE), job, restart, sig)
    before = read_excluded(run_dir)
    excluded = before + [n for n in blamed if n not in before]
    left = [n for n in cluster_nodes if n not in excluded]
    what = f"failed with {sig!r}"
    if times >= 2 and faults and not blamed and not any(map(_lost_peer, _final(faults))):
        return Decision(
            "stop", before,
            f"job {job} {what} again, on {','.join(job_nodes)}: an error that is no node's "
            f"(not a signal, a device or NCCL error) and fails the same way on any node; not "
            f"requeued. {run_dir / FAULTS_FILE} has the message. Fix the cause and resubmit: "
            "the run resumes from its latest checkpoint",
        )  # fmt: skip
    if times >= max_failures:
        return Decision(
            "stop", before,
            f"job {job} {what} {times} times in a row (MAX_JOB_FAILURES={max_failures}): not "
            f"requeued again; {run_dir / FAULTS_FILE} has every fault. Fix the cause and "
            "resubmit: the run resumes from its latest checkpoint",
        )  # fmt: skip
    if len(left) < len(job_nodes):
        return Decision(
            "stop", before,
            f"job {job} {what}; excluding {','.join(excluded)} would leave "
            f"{len(left)} of the partition's {len(cluster_nodes)} nodes for a job of "
            f"{len(job_nodes)}: not requeued. Check those nodes, then empty "
            f"{run_dir / EXCLUDED_FILE} and resubmit",
        )  # fmt: skip
    write_atomic(run_dir / EXCLUDED_FILE, "".join(f"{n}\n" for n in excluded))
    blame = f"blaming {','.join(blamed)}" if blamed else "no node to blame"
    return Decision(
        "requeue", excluded,
        f"job {job} {what} ({times} of {max_failures} in a row), {blame}: requeueing it "
        f"excluding [{','.join(excluded)}] ({run_dir / EXCLUDED_FILE})",
    )  # fmt: skip


def at_start(
    run_dir: str | Path, job_nodes: list[str], job_excluded: list[str], cluster_nodes: list[str]
) -> Decision:
    """Before training: a job that landed on a node the run excludes (a resubmission, a chained
    job, a requeue whose exclusion did not apply) requeues itself avoiding it, unless Slurm was
    already told to (then it would only land there again) or too few nodes would be left."""
    excluded = read_excluded(run_dir)
    bad = [n for n in job_nodes if n in excluded]
    if not bad:
        return Decision("run", excluded, "")
    left = [n for n in cluster_nodes if n not in excluded]
    if set(bad) <= set(job_excluded) or len(left) < len(job_nodes):
        return Decision(
            "run", excluded,
            f"running on {','.join(bad)} although {Path(run_dir) / EXCLUDED_FILE} excludes "
            "it: excluding it would leave too few nodes, or Slurm did not apply it",
        )  # fmt: skip
    return Decision(
        "requeue", excluded,
        f"landed on {','.join(bad)}, which {Path(run_dir) / EXCLUDED_FILE} excludes: "
        f"requeueing excluding [{','.join(excluded)}]",
    )  # fmt: skip


def _names(text: str) -> list[str]:
    return [n for n in re.split(r"[,\s]+", text) if n and n != "(null)"]


def main(argv: list[str] | None = None) -> int:
    """`python -m aiayn.distributed.node_exclusion after-failure|at-start ... --config C
    [overrides]`: slurm/train.sbatch's questions, answered as key=value lines (Decision.shell)."""
    from aiayn.config import load_config

    parser = argparse.ArgumentParser(prog="python -m aiayn.distributed.node_exclusion")
    sub = parser.add_subparsers(dest="command", required=True)
    fail = sub.add_parser("after-failure", help="a start of the job failed: requeue or stop?")
    start = sub.add_parser("at-start", help="is the job on a node the run excludes?")
    for p in (fail, start):
        p.add_argument("--nodes", required=True, help="the job's nodes, comma-separated")
        p.add_argument("--cluster-nodes", required=True, help="the partition's nodes")
        p.add_argument("--config", required=True)
        p.add_argument("overrides", nargs="*", help="section.key=value, as `aiayn train` takes")
    fail.add_argument("--job", required=True)
    fail.add_argument("--restart", type=int, required=True, help="SLURM_RESTART_COUNT")
    fail.add_argument("--exit-code", type=int, required=True)
    fail.add_argument("--max-failures", type=int, default=3)
    start.add_argument("--job-excluded", default="", help="the job's ExcNodeList")
    args = parser.parse_args(argv)
    try:
        run_dir = Path(load_config(args.config, args.overrides).run_dir)
    except AiaynError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    nodes, cluster = _names(args.nodes), _names(args.cluster_nodes)
    if args.command == "after-failure":
        decision = after_failure(
            run_dir, args.job, args.restart, args.exit_code, nodes, cluster, args.max_failures
        )
    else:
        decision = at_start(run_dir, nodes, _names(args.job_excluded), cluster)
    sys.stdout.write(decision.shell())
    return 0


if __name__ == "__main__":
    sys.exit(main())
