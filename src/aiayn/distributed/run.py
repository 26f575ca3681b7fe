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

How it stops a group (torch's agent gives every worker SIGTERM and 30 s before SIGKILL):
- after a fault (a worker died, raised, or its collective timed out), or when another node
  left the rendezvous: SIGKILL at once. Nothing can be saved from a broken group, and a
  worker's SIGTERM means "save after this step" (preemption.StopFlag), a step that a rank
  blocked in a collective never finishes. The workers stopped so are not faults of their own
  and are not logged as such.
- after a preemption (a worker exited 75): the others saved the same step and are exiting;
  they get --shutdown-timeout to do it before SIGKILL, and no signal.
- when the launcher itself gets SIGTERM (a scheduler): forwarded to the workers, which save
  and exit 75 within --shutdown-timeout (torch's own); the launcher then exits 75.

A restart's rendezvous waits `restart_join_timeout` (an --rdzv-conf key of this launcher,
default RESTART_JOIN_TIMEOUT_S) for the nodes, not the first start's join_timeout: every node
still alive is back within seconds, so a node that is not has been lost, and the launcher gives
up (exit 1) instead of waiting torch's 600 s (docs/distributed.md, "Faults and restarts").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.launcher import api as launcher_api

from aiayn.config import Config
from aiayn.distributed import faults
from aiayn.distributed.preemption import REQUEUE_EXIT_CODE
from aiayn.errors import AiaynError, ConfigError

PREFIX = "aiayn.distributed.run"
# What torchrun says for a worker that left no error file: nothing its exit code does not.
TORCH_PLACEHOLDERS = ("<", "To enable traceback", "Signal ")
# How long to wait for a SIGKILLed worker to be gone (milliseconds, but for one stuck in the
# kernel, which torch then leaves behind): its GPU memory is free when it is.
KILL_WAIT_S = 10
# A restart's rendezvous: the live nodes' launchers are back within seconds of the fault (each
# sees the new round within --monitor-interval, 0.1 s, and kills its workers at once); the
# rest of the time is margin for a rendezvous of many nodes.
RESTART_JOIN_TIMEOUT_S = 45
RESTART_JOIN_KEY = "restart_join_timeout"  # in --rdzv-conf, beside torch's join_timeout


class RestartPolicyAgent(LocalElasticAgent):
    """torchrun's agent, but a group whose failures include a stop is not restarted, a broken
    group is killed at once, a restart's rendezvous waits `restart_join_timeout`, and each
    failure is logged to `run_dir`'s faults.jsonl (when the command is `aiayn train`)."""

    run_dir: Path | None = None
    restart_join_timeout: float = RESTART_JOIN_TIMEOUT_S
    _signalled: signal.Signals | None = None  # what the launcher got, forwarded to the workers
    _stopped: frozenset[int] = frozenset()  # local ranks the agent killed, not failed themselves

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY) or not result.failures:
            return result
        codes = [f.exitcode for f in result.failures.values()]
        if not faults.should_restart(codes):
            # The same switch torch itself uses to stop restarting a wedged worker group.
            self._remaining_restarts = 0
        self._log_faults(worker_group, result.failures)
        return result

    def _log_faults(self, worker_group, failures: dict[int, ProcessFailure]) -> None:
        """Say what failed and what follows, and append it to the run's faults.jsonl."""
        codes = [f.exitcode for f in failures.values()]
        attempt = worker_group.spec.max_restarts - self._remaining_restarts  # 0: first start
        left = self._remaining_restarts  # the agent takes one for the restart it now makes
        if REQUEUE_EXIT_CODE in codes:
            action = "preempted"
        else:
            action = "restart" if left > 0 else "stop"
        failed = {r: f for r, f in sorted(failures.items()) if f.local_rank not in self._stopped}
        found = [
            faults.Fault(rank, f.exitcode, action, _message(f.message), attempt)
            for rank, f in failed.items()
        ]
        to_fix = _to_fix(failed)
        for fault in found:
            if fault.rank not in to_fix:
                print(f"{PREFIX}: {_describe(fault, left)}", file=sys.stderr, flush=True)
        # An error a person must fix is the worker's message (it printed none), once.
        for message in dict.fromkeys(to_fix.values()):
            ranks = ", ".join(str(r) for r, m in to_fix.items() if m == message)
            print(f"{PREFIX}: error (rank {ranks}): {message}", file=sys.stderr, flush=True)
        stopped = sorted(r for r, f in failures.items() if f.local_rank in self._stopped)
        if stopped and len(to_fix) < len(found):
            print(
                f"{PREFIX}: stopped rank(s) {', '.join(map(str, stopped))} of the group with "
                "SIGKILL" + (" after --shutdown-timeout" if action == "preempted" else " at once"),
                file=sys.stderr,
                flush=True,
            )
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

    def _start_workers(self, worker_group) -> dict:
        ids = super()._start_workers(worker_group)
        if not isinstance(self._pcontext, SubprocessContext):
            raise RuntimeError(
                f"torchrun started its workers in a {type(self._pcontext).__name__}, not a "
                "SubprocessContext: aiayn.distributed.run cannot stop them by its policy"
            )
        self._stopped = frozenset()
        # torch's process context closes the group (SIGTERM, a fixed 30 s, SIGKILL) as soon as
        # one worker has ended: the policy of the module docstring instead.
        self._pcontext.close = functools.partial(self._close, self._pcontext.close)
        return ids

    def _close(self, close, death_sig=None, timeout=None) -> None:
        if death_sig is not None or timeout is not None:  # _shutdown's: decided there
            return close(death_sig, timeout)
        procs = {lr: h.proc for lr, h in self._pcontext.subprocess_handlers.items()}
        if REQUEUE_EXIT_CODE in [p.poll() for p in procs.values()]:
            # Preempted: the others saved the same step and exit by themselves.
            deadline = time.monotonic() + self._shutdown_timeout
            for proc in procs.values():
                try:
                    proc.wait(max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    pass
        self._stopped = frozenset(lr for lr, p in procs.items() if p.poll() is None)
        close(signal.SIGKILL, KILL_WAIT_S)

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30) -> None:
        if self._signalled is not None:
            # The launcher was signalled: torch's own, the signal forwarded, and
            # --shutdown-timeout for the workers to save and exit 75.
            return super()._shutdown(self._signalled, self._shutdown_timeout)
        # A restart after a fault, a node that left the rendezvous, the agent's own failure
        # (after a group that ended by itself there is no one left).
        super()._shutdown(signal.SIGKILL, KILL_WAIT_S)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as exc:
            self._signalled = exc.sigval  # run() then forwards it (_shutdown)
            raise

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """torch's, but a signal that made the workers save and exit 75 ends the launcher as a
        preemption (75, through the ChildFailedError of `main`), not with a traceback."""
        try:
            return super().run(role)
        except SignalException as exc:
            failures = self._failures_after_signal()
            if not any(f.exitcode == REQUEUE_EXIT_CODE for f in failures.values()):
                raise
            print(
                f"{PREFIX}: got {exc.sigval.name}: forwarded to the workers, which saved",
                file=sys.stderr,
                flush=True,
            )
            self._log_faults(self._worker_group, failures)
            return RunResult(state=WorkerState.FAILED, failures=failures)

    def _failures_after_signal(self) -> dict[int, ProcessFailure]:
        pcontext = self._pcontext
        if not isinstance(pcontext, SubprocessContext):
            return {}
        failures = {}
        for worker in self._worker_group.workers:
            proc = pcontext.subprocess_handlers[worker.local_rank].proc
            if proc.returncode:
                failures[worker.global_rank] = ProcessFailure(
                    worker.local_rank, proc.pid, proc.returncode,
                    pcontext.error_files[worker.local_rank],
                )  # fmt: skip
        return failures

    def _rendezvous(self, worker_group) -> None:
        super()._rendezvous(worker_group)
        # The first start has met: a restart waits restart_join_timeout for the nodes.
        shorten_join_timeout(worker_group.spec.rdzv_handler, self.restart_join_timeout)


def shorten_join_timeout(handler, seconds: float) -> None:
    """From now on `handler`'s rendezvous waits at most `seconds` for its nodes (its next
    next_rendezvous()). torch reads the join timeout from the handler's frozen settings at
    each call and offers no setter; a handler without one (the static rendezvous of a
    single node) is left as it is."""
    settings = getattr(handler, "_settings", None)
    if not isinstance(settings, RendezvousSettings):
        return
    old, join = settings.timeout, timedelta(seconds=seconds)
    if join < old.join:
        timeout = RendezvousTimeout(join, old.last_call, old.close, old.heartbeat)
        handler._settings = dataclasses.replace(settings, timeout=timeout)


def _message(message: str | dict) -> str:
    """The first line of a worker's error from torchrun's error file (a dict when the worker
    wrote one, as aiayn's CLI does; "" when it left none, as a worker a signal killed)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if not text or text.startswith(TORCH_PLACEHOLDERS):
        return ""
    return text.splitlines()[0][:1000]


def _to_fix(failures: dict[int, ProcessFailure]) -> dict[int, str]:
    """The ranks that ended with an error a person must fix and left its message (aiayn's
    CLI writes it whole in the error file), by rank: the message without its error type."""
    out = {}
    for rank, f in failures.items():
        message = f.message.get("message", "") if isinstance(f.message, dict) else ""
        if f.exitcode == faults.USER_ERROR_EXIT_CODE and message:
            out[rank] = message.split(": ", 1)[-1]
    return out


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
        return f"{what}: an error a restart would repeat; not restarted"
    return f"{what}: no restarts left (--max-restarts); stopping"


def training_config(command: list[str]) -> Config | None:
    """The run config of an `aiayn train` command: torchrun's `-m aiayn train --config C
    [overrides]`, or a script that wraps aiayn's CLI and passes it arguments ending in
    `train --config C [overrides]`; None for another command."""
    from aiayn.config import load_config
    from aiayn.distributed.launcher import accelerate_overrides

    starts = [i for i in range(len(command) - 1) if command[i : i + 2] == ["train", "--config"]]
    if not starts:
        return None
    args = _train_arguments().parse_args(command[starts[0] + 1 :])
    return load_config(args.config, accelerate_overrides(os.environ) + args.overrides)


def largest_world(nnodes: str, nproc_per_node: str) -> int | None:
    """The most ranks torchrun's --nnodes (N or MIN:MAX) and --nproc-per-node start; None where
    the node's devices decide (auto, gpu)."""
    try:
        return int(nnodes.split(":")[-1]) * int(nproc_per_node)
    except ValueError:
        return None


def _train_arguments() -> argparse.ArgumentParser:
    """The arguments of `aiayn train` (cli/training.py's train command takes these and no
    others): the launcher sits below the command line and reads them itself."""
    parser = argparse.ArgumentParser(prog="aiayn train")
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    return parser


def restart_join_timeout(rdzv_conf: str) -> float:
    """--rdzv-conf's restart_join_timeout (seconds), else RESTART_JOIN_TIMEOUT_S."""
    value = _parse_rendezvous_config(rdzv_conf).get(RESTART_JOIN_KEY)
    if value is None:
        return RESTART_JOIN_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ConfigError(
            f"--rdzv-conf {RESTART_JOIN_KEY}={value}: give the seconds a restart's rendezvous "
            "waits for the nodes, more than 0"
        )
    return seconds


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
        cfg = training_config(command)
        if cfg is not None and (world := largest_world(args.nnodes, args.nproc_per_node)):
            cfg.train.accumulation(world)  # the batch must be shared by the most ranks
        RestartPolicyAgent.run_dir = None if cfg is None else Path(cfg.run_dir)
        RestartPolicyAgent.restart_join_timeout = restart_join_timeout(args.rdzv_conf)
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
        code = exit_code(exc.failures)
        if code != faults.USER_ERROR_EXIT_CODE:  # else the agent printed its one line
            print(exc.format_msg(), file=sys.stderr)
        return code
    except SignalException as exc:  # the workers did not save (RestartPolicyAgent.run)
        print(f"{PREFIX}: got {exc.sigval.name}; the workers stopped unsaved", file=sys.stderr)
        return 128 + exc.sigval
    except RendezvousTimeoutError:
        print(
            f"{PREFIX}: error: the nodes did not all meet within the rendezvous' join_timeout (a "
            f"first start) or {RESTART_JOIN_KEY} ({RestartPolicyAgent.restart_join_timeout:g} s, "
            "a restart): a node was lost, or started too late (its launcher's log says why)",
            file=sys.stderr,
        )
        return 1
    finally:
        launcher_api.LocalElasticAgent = LocalElasticAgent
    return 0


if __name__ == "__main__":
    sys.exit(main())
