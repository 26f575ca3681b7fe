"""`python -m aiayn.distributed.run`: torchrun, with a restart policy that tells a fault from a
stop, and a record of every fault in the run's faults.jsonl.

It takes torchrun's options and command unchanged, e.g.

    python -m aiayn.distributed.run --nproc-per-node=8 --max-restarts=3 \\
        -m aiayn train --config configs/wmt14_en_de_base.yaml

Plain torchrun restarts the whole group whenever a worker fails, until --max-restarts are used
up. That is right for a fault: a worker killed, an exception or an out-of-memory error on one
rank, a rank the others gave up on (distributed.timeout_minutes); the group resumes from the
latest checkpoint. It is wrong for two exits (distributed/faults.py):
- 75, preempted: every rank saved and stopped because the scheduler asked. Restarting in place
  would train on in an allocation that is about to end; the job must end so the scheduler can
  requeue it (slurm/train.sbatch), and this launcher exits 75 too.
- 2, an error a person must fix (a config, a corpus, a non-finite loss, a disk that stays
  full): a restart would fail the same way, --max-restarts times. This launcher exits 2.
torch's agent has no hook for that choice, so the one class that makes it is swapped in for
torchrun's, in this process only.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher import api as launcher_api

from aiayn.distributed import faults
from aiayn.distributed.preemption import REQUEUE_EXIT_CODE
from aiayn.errors import AiaynError

PREFIX = "aiayn.distributed.run"
# What torchrun says for a worker that left no error file: nothing its exit code does not.
TORCH_PLACEHOLDERS = ("<", "To enable traceback", "Signal ")


class RestartPolicyAgent(LocalElasticAgent):
    """torchrun's agent, but a group whose failures include a stop is not restarted, and each
    failure is logged to `run_dir`'s faults.jsonl (when the command is `aiayn train`)."""

    run_dir: Path | None = None

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            return result
        codes = [f.exitcode for f in result.failures.values()]
        attempt = worker_group.spec.max_restarts - self._remaining_restarts  # 0: first start
        if not faults.should_restart(codes):
            # The same switch torch itself uses to stop restarting a wedged worker group.
            self._remaining_restarts = 0
        left = self._remaining_restarts  # the agent takes one for the restart it now makes
        if REQUEUE_EXIT_CODE in codes:
            action = "preempted"
        else:
            action = "restart" if left > 0 else "stop"
        found = [
            faults.Fault(rank, f.exitcode, action, _message(f.message), attempt)
            for rank, f in sorted(result.failures.items())
        ]
        for fault in found:
            print(f"{PREFIX}: {_describe(fault, left)}", file=sys.stderr, flush=True)
        if self.run_dir is not None:
            try:
                faults.record(self.run_dir, found)
            except OSError as exc:  # a full or read-only run_dir: the policy above still holds
                print(
                    f"{PREFIX}: could not write {self.run_dir / faults.FAULTS_FILE} ({exc}); "
                    "the faults above are not in the run's fault log",
                    file=sys.stderr,
                    flush=True,
                )
        return result

    def _start_workers(self, worker_group) -> dict:
        ids = super()._start_workers(worker_group)
        # When a worker fails, torch's process context stops the others with a fixed 30 s
        # grace before SIGKILL, not the --shutdown-timeout it was given: a stalled
        # (SIGSTOPped) worker, which SIGTERM cannot end, held every restart 30 s.
        close, grace = self._pcontext.close, self._shutdown_timeout
        self._pcontext.close = lambda death_sig=None, timeout=None: close(
            death_sig, grace if timeout is None else timeout
        )
        return ids


def _message(message: str | dict) -> str:
    """The first line of a worker's error from torchrun's error file (a dict when the worker
    wrote one, as aiayn's CLI does; "" when it left none, as a worker a signal killed)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if not text or text.startswith(TORCH_PLACEHOLDERS):
        return ""
    return text.splitlines()[0][:1000]


def _describe(fault: faults.Fault, left: int) -> str:
    what = f"rank {fault.rank} on {fault.node} ended with {fault.how}"
    if fault.error:
        what += f" ({fault.error})"
    if fault.action == "preempted":
        return f"{what}: preempted, checkpoint saved; not restarted, exiting {REQUEUE_EXIT_CODE}"
    if fault.action == "restart":
        return (
            f"{what}: restarting the group from the latest checkpoint "
            f"({left - 1} restarts left after this one)"
        )
    if fault.exitcode == faults.USER_ERROR_EXIT_CODE:
        return f"{what}: an error a restart would repeat; not restarted (see the message above)"
    return f"{what}: no restarts left (--max-restarts); stopping"


def run_dir_of(command: list[str]) -> Path | None:
    """The run directory of an `aiayn train` command: torchrun's `-m aiayn train --config C
    [overrides]`, or a script that wraps aiayn's CLI and passes it arguments ending in
    `train --config C [overrides]`; None for another command."""
    from aiayn.config import load_config
    from aiayn.distributed.launcher import accelerate_overrides

    starts = [i for i in range(len(command) - 1) if command[i : i + 2] == ["train", "--config"]]
    if not starts:
        return None
    args = _train_arguments().parse_args(command[starts[0] + 1 :])
    return Path(load_config(args.config, accelerate_overrides(os.environ) + args.overrides).run_dir)


def _train_arguments() -> argparse.ArgumentParser:
    """The arguments of `aiayn train` (cli.py's train command takes these and no others): the
    launcher sits below the command line and reads them itself."""
    parser = argparse.ArgumentParser(prog="aiayn train")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    return parser


def exit_code(failures: dict) -> int:
    """The launcher's exit code for its workers' failures: 75 when the group was preempted
    (ranks saved and stopped), 2 for an error a person must fix, else 1."""
    codes = [f.exitcode for f in failures.values()]
    # A preempted rank that had saved may be killed by the agent (SIGTERM) while it exits.
    if REQUEUE_EXIT_CODE in codes and all(c == REQUEUE_EXIT_CODE or c < 0 for c in codes):
        return REQUEUE_EXIT_CODE
    if faults.USER_ERROR_EXIT_CODE in codes:
        return faults.USER_ERROR_EXIT_CODE
    return 1


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv)
    if args.max_restarts < 0:  # torch's agent fails on it with a bare AssertionError
        print(
            f"{PREFIX}: error: --max-restarts={args.max_restarts}: give the number of restarts "
            "allowed after a fault, 0 or more",
            file=sys.stderr,
        )
        return faults.USER_ERROR_EXIT_CODE
    command = [args.training_script, *args.training_script_args]
    try:
        RestartPolicyAgent.run_dir = run_dir_of(command)
    except AiaynError as exc:  # a bad config fails here once, not in every worker
        print(f"{PREFIX}: error: {exc}", file=sys.stderr)
        return faults.USER_ERROR_EXIT_CODE
    if launcher_api.LocalElasticAgent is not LocalElasticAgent:
        raise RuntimeError(
            "torch.distributed.launcher.api no longer builds its agent from LocalElasticAgent: "
            "aiayn.distributed.run cannot apply its restart policy to this torch version"
        )
    launcher_api.LocalElasticAgent = RestartPolicyAgent
    # Each start of the group gets a store of its own (rank 0 hosts it), not the agents'
    # shared one: in a c10d rendezvous a node restarted for a membership change keeps its
    # restart count, so no count names a start on every node, and a restarted rank read its
    # dead peer's address from the shared store's old keys. AIAYN_LAUNCHER tells the workers
    # whose policy restarts them (train/assemble.py warns under plain torchrun).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[faults.LAUNCHER_ENV] = PREFIX
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return exit_code(exc.failures)
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent
    return 0


if __name__ == "__main__":
    sys.exit(main())
