"""The test cluster itself: it comes up able to run two-node steps, and its teardown leaves no
process behind, whatever state it is in."""

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from minicluster import MiniCluster, why_unavailable

pytestmark = pytest.mark.slurm


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("controller", ["alive", "killed"])
def test_teardown_ends_the_daemons_and_the_jobs_processes_by_pid(controller):
    """A job runs a step on both nodes; then the cluster is stopped (with its controller
    killed first in the second case, so no job can be cancelled). Every daemon, slurmstepd
    and job process is gone afterwards."""
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = MiniCluster()
    try:
        cluster.start()
        cluster.sbatch(["-N2", "--output=/dev/null", "--wrap", "srun sleep 300"])
        deadline = time.monotonic() + 60
        while sum(_comm(p) == "sleep" for p in cluster.processes()) < 2:
            assert time.monotonic() < deadline, "the job's step did not start on both nodes"
            time.sleep(0.2)
        before = cluster.processes()
        names = sorted({_comm(p) for p in before})
        assert {"munged", "slurmctld", "slurmd", "slurmstepd", "sleep"} <= set(names), names
        if controller == "killed":
            os.kill(int((cluster.root / "slurmctld.pid").read_text()), signal.SIGKILL)
        cluster.stop()
        survivors = [(p, _comm(p)) for p in before if _running(p)]
        assert not survivors and not cluster.processes(), survivors
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
