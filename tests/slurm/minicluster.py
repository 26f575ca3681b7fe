"""A throwaway Slurm cluster on this machine: munged, slurmctld and two slurmd emulating nodes
n1 and n2 on 127.0.0.1, everything (config, state, logs, pid files, munge key) in one
temporary directory. Started by `MiniCluster.start()`, stopped by `stop()`, which cancels the
jobs first and then ends every process that carries this cluster's SLURM_CONF, by PID.

Debian bookworm's Slurm 22.05 runs without systemd or cgroups with the settings below; each is
there for a reason given beside it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from helpers import free_ports  # tests/helpers.py

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue")
PACKAGES = "slurmctld slurmd slurm-client munge"


def why_unavailable() -> str | None:
    """None when a cluster can be started here, else the reason (for pytest.skip)."""
    if not Path("/etc/debian_version").is_file():
        return "the Slurm tests start Debian's Slurm packages; this is not Debian"
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd as root (SlurmUser=root); run them as root"
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b, path=_sbin_path()) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): "
            f"apt-get install {PACKAGES} (.ci/run does this on CI)"
        )
    return None


def _sbin_path() -> str:
    return os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


class MiniCluster:
    NODES = ("n1", "n2")

    def __init__(self, root: Path | None = None, cpus_per_node: int = 2):
        self.root = Path(root or tempfile.mkdtemp(prefix="aiayn-slurm-"))
        # munged refuses a socket directory that others can write to.
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.cpus = cpus_per_node
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": _sbin_path(),
        }

    # ---- start ----

    def start(self, timeout: float = 60.0) -> MiniCluster:
        try:
            self._write_config()
            self._start_munged()
            self._daemon(["slurmctld", "-f", str(self.conf), "-c"])  # -c: no saved state
            for node in self.NODES:
                self._daemon(["slurmd", "-f", str(self.conf), "-N", node])
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(self.NODES))
        host = socket.gethostname()
        r = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
            "State=UNKNOWN"
            for n, p in zip(self.NODES, node_ports, strict=True)
        )
        self.conf.write_text(
            f"""\
ClusterName=aiayntest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
# Our own munged; cred_expire=5: a requeued job may start again after 5 s instead of ~120 s.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge.socket,cred_expire=5
# Listen on 127.0.0.1 only.
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
# No systemd, no cgroups: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Schedule at once: tests wait for jobs, not for the scheduler.
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
# Finished jobs stay visible to `scontrol show job` long enough for the tests to read them.
MinJobAge=600
KillWait=10
InactiveLimit=0
StateSaveLocation={r}/state
SlurmctldPidFile={r}/slurmctld.pid
SlurmctldLogFile={r}/slurmctld.log
# %n: one spool, pid file and log per emulated node.
SlurmdSpoolDir={r}/slurmd.%n
SlurmdPidFile={r}/slurmd.%n.pid
SlurmdLogFile={r}/slurmd.%n.log
{nodes}
PartitionName=test Nodes={",".join(self.NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        (r / "state").mkdir(exist_ok=True)

    def _start_munged(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        r = self.root
        self._daemon(
            [
                "munged",
                f"--socket={r}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={r}/munged.pid",
                f"--log-file={r}/munged.log",
                f"--seed-file={r}/munged.seed",
            ]
        )

    def _daemon(self, cmd: list[str]) -> None:
        """Start a daemon that forks into the background; a failure names its log."""
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}\n"
                f"logs: {self.root}/*.log"
            )

    def _wait_ready(self, timeout: float) -> None:
        # An idle sinfo is no proof that nodes can run steps; a two-node step is.
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            proc = self.run(["srun", "-N2", "-n2", "--immediate=5", "true"], check=False)
            if proc.returncode == 0:
                return
            last = proc.stderr.strip()
            time.sleep(1)
        raise RuntimeError(f"the cluster did not become ready in {timeout:.0f}s: {last}")

    # ---- use ----

    def run(self, cmd: list[str], check: bool = True, timeout: float = 60):
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: list[str], env: dict[str, str] | None = None) -> int:
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            env={**(env or os.environ), "SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait until the job has ended for good (a requeued job goes back to PENDING)."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in final:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout}s")
            time.sleep(0.2)

    # ---- stop ----

    def processes(self) -> list[int]:
        """PIDs of every process carrying this cluster's SLURM_CONF: the daemons (started with
        it), the slurmstepds they start and the jobs' processes (sbatch passes it on)."""
        return [
            int(d.name)
            for d in Path("/proc").iterdir()
            if d.name.isdigit() and int(d.name) != os.getpid() and self._ours(int(d.name))
        ]

    def _ours(self, pid: int) -> bool:
        # A pid file may outlive its daemon and its PID be reused: only a process that carries
        # our SLURM_CONF is ever signalled.
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or a zombie
            return False
        return f"SLURM_CONF={self.conf}".encode() in environ.split(b"\0")

    def _daemon_pids(self, name: str) -> list[int]:
        pids = []
        for f in self.root.glob(f"{name}.pid"):
            try:
                pids.append(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        return [p for p in pids if self._ours(p)]

    def stop(self) -> None:
        """Cancel the jobs (their processes are detached from slurmd), end the daemons by the
        PIDs in their pid files, then whatever else still carries our SLURM_CONF. Safe to call
        again, and after a partial start."""
        if self.conf.is_file() and self._daemon_pids("slurmctld"):
            try:
                cancel = self.run(["scancel", "--quiet", "--user", "root"], check=False, timeout=10)
                deadline = time.monotonic() + 20
                while cancel.returncode == 0 and time.monotonic() < deadline:
                    q = self.run(["squeue", "--noheader", "--format=%i"], check=False, timeout=10)
                    if q.returncode != 0 or not q.stdout.strip():
                        break
                    time.sleep(0.5)
            except (subprocess.TimeoutExpired, OSError):
                pass  # a hung controller: the processes below end all the same
        for name in ("slurmd.*", "slurmctld", "munged"):
            _end(self._daemon_pids(name))
        _end(self.processes(), grace=3)  # stepds and job processes that outlived a cancel
        left = self.processes()
        if left:
            raise RuntimeError(f"processes of the Slurm test cluster survived: {left}")


def _end(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is still there after `grace` seconds."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5  # SIGKILL is not instant either
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our own exited child, not yet reaped) is no longer running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
