"""One job per run directory (aiayn/distributed/run_lock.py): a second start is refused naming
the holder; a holder that is gone (its process ended, its pid reused, its heartbeat old on
another host) is taken over with a warning, an earlier start of the same job with an info line.
A few tiny processes hold a lock for real and are SIGKILLed; no torch is imported in them.
(Two real torchrun jobs in one run directory: tests/distributed/test_run_dir_lock.py.)"""

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aiayn
from aiayn.distributed import run_lock
from aiayn.distributed.run_lock import LOCK_FILE, STALE_AFTER_S, Holder, RunLock, verdict
from aiayn.errors import RunDirInUse

SRC = str(Path(aiayn.__file__).parents[1])
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
}

# Takes run_dir's lock, optionally forks a child that sleeps (a DataLoader worker), says
# "ready CHILD_PID" and sleeps until killed.
HOLDER = """
import os, sys, time
from pathlib import Path
from aiayn.distributed.run_lock import RunLock
lock = RunLock.acquire(Path(sys.argv[1]))
child = 0
if sys.argv[2] == "fork":
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # fork's handlers have run: the child's copy of the lock is closed
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
    os.read(r, 1)  # the child has run that far (a loaded machine may not have scheduled it)
print("ready", child, flush=True)
time.sleep(60)
"""


@pytest.fixture
def held(tmp_path):
    """Start a process that holds tmp_path's lock: returns (process, child pid or 0)."""
    started = []

    def start(fork: bool = False) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path), "fork" if fork else "-"],
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        started.append(proc)
        word, child = proc.stdout.readline().split()
        assert word == "ready"
        if int(child):
            started.append(int(child))
        return proc, int(child)

    yield start
    for p in started:
        if isinstance(p, int):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            p.kill()
            p.wait()


def me(**changes) -> Holder:
    """This process as a holder records it, outside any job unless `changes` say so."""
    alone = {"slurm": None, "run_id": None, "restart": 0}
    return dataclasses.replace(Holder.this_process(), **{**alone, **changes})


@pytest.fixture(autouse=True)
def no_job(monkeypatch):
    """The tests' own process is no job's start (whatever ran pytest)."""
    for name in (
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)


def record(run_dir: Path, holder: Holder, age: float = 0.0) -> None:
    """run_dir/run.lock naming `holder`, its heartbeat `age` seconds old."""
    path = run_dir / LOCK_FILE
    path.write_text(holder.to_text())
    then = time.time() - age
    os.utime(path, (then, then))


def test_a_second_start_is_refused_naming_the_holder_and_how_to_proceed(tmp_path):
    lock = RunLock.acquire(tmp_path)
    try:
        with pytest.raises(RunDirInUse) as refused:
            RunLock.acquire(tmp_path)
    finally:
        lock.release()
    text = str(refused.value)
    assert f"{tmp_path} is in use by another training run, pid {os.getpid()} on " in text
    assert socket.gethostname() in text and "since 20" in text, text
    assert "it holds the run directory's lock" in text
    assert f"`kill {os.getpid()}`" in text and f"delete {tmp_path / LOCK_FILE}" in text
    assert "5 minutes after its last heartbeat" in text
    assert RunDirInUse.exit_code == 2  # the CLI's, which aiayn.distributed.run does not restart
    # Released: the file is gone, and the next start takes it without a word.
    assert not (tmp_path / LOCK_FILE).exists()
    again = RunLock.acquire(tmp_path)
    assert again.notes == [] and again.flock
    assert Holder.from_text((tmp_path / LOCK_FILE).read_text()) == again.me
    again.release()


def test_a_process_that_holds_the_lock_is_named_and_once_killed_taken_over(tmp_path, held):
    proc, _ = held()
    with pytest.raises(
        RunDirInUse, match=f"pid {proc.pid} on .*: it holds the run directory's lock"
    ):
        RunLock.acquire(tmp_path)
    proc.kill()
    proc.wait()
    lock = RunLock.acquire(tmp_path)
    lock.release()
    [(level, note)] = lock.notes
    assert level == logging.WARNING
    assert f"taking over from pid {proc.pid} on {socket.gethostname()}" in note
    assert "its lock was released: the process ended" in note


def test_a_forked_child_that_outlives_its_parent_holds_no_lock(tmp_path, held):
    """A DataLoader worker forked by rank 0 inherits the lock's descriptor: it closes its copy,
    so the lock goes with rank 0, not with the last of its children."""
    proc, child = held(fork=True)
    proc.kill()
    proc.wait()
    assert run_lock.process_state(child)[0]  # the child lives on
    RunLock.acquire(tmp_path).release()


def test_without_flock_a_holder_on_this_host_is_judged_by_its_pid_and_start_time():
    now = me()
    alive = me(pid=os.getpid(), proc_start=now.proc_start)
    assert verdict(alive, now, locked=False, age=1e6) == (True, "its process is running")
    reused = me(proc_start=(now.proc_start or 0) + 1)
    assert verdict(reused, now, locked=False, age=0) == (
        False,
        f"pid {os.getpid()} is now another process",
    )
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = me(pid=ended.pid)
    assert verdict(dead, now, locked=False, age=0) == (False, f"pid {ended.pid} has ended")
    # With the flock taken, a holder on this host has ended, whatever its pid says now.
    assert verdict(alive, now, locked=True, age=0)[0] is False


def test_a_holder_on_another_host_is_gone_once_its_heartbeat_is_stale(tmp_path):
    other = me(host="other-host", pid=4242)
    record(tmp_path, other, age=60)
    with pytest.raises(RunDirInUse) as refused:
        RunLock.acquire(tmp_path)
    text = str(refused.value)
    assert "pid 4242 on other-host (since " in text and "last heartbeat 60 s ago" in text
    assert (
        "its heartbeat is 60 s old" in text and "none of its processes runs on other-host" in text
    )
    record(tmp_path, other, age=STALE_AFTER_S + 30)
    lock = RunLock.acquire(tmp_path)
    lock.release()
    [(level, note)] = lock.notes
    assert level == logging.WARNING
    assert (
        "taking over from pid 4242 on other-host" in note and "no heartbeat for 5.5 minutes" in note
    )


def test_this_host_on_another_boot_is_judged_by_the_heartbeat():
    """Its pids are not this boot's: a holder recorded before the host restarted (or by
    another machine of the same name) is gone only when its heartbeat is."""
    before = me(boot="another-boot", pid=os.getpid())
    assert verdict(before, me(), locked=True, age=10)[0] is True
    assert verdict(before, me(), locked=True, age=STALE_AFTER_S)[0] is False


def test_an_earlier_start_of_the_same_job_is_taken_over_with_an_info_line(tmp_path, monkeypatch):
    """aiayn.distributed.run restarting a group whose rank 0 is now on another node, or a
    requeued Slurm job: the previous start's heartbeat is fresh, its processes have ended."""
    first = me(host="node-a", run_id="job-7", restart=0)
    restarted = me(run_id="job-7", restart=1)
    assert verdict(first, restarted, locked=True, age=5)[0] is False
    # The same run id on a first start is another job (launch/multinode.sh's default id).
    assert verdict(first, me(run_id="job-7", restart=0), locked=True, age=5)[0] is True
    # Slurm: the job and its step decide; a new step in the same allocation is another start.
    slurm = me(host="node-a", slurm="99.0")
    assert verdict(slurm, me(slurm="99.0"), locked=True, age=5)[0] is False
    assert verdict(slurm, me(slurm="99.1"), locked=True, age=5)[0] is True

    record(tmp_path, first, age=5)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock = RunLock.acquire(tmp_path)
    lock.release()
    [(level, note)] = lock.notes
    assert level == logging.INFO
    assert note.startswith(f"{tmp_path / LOCK_FILE}: taking over from an earlier start of this job")
    assert "pid" in note and "node-a" in note and "its job has started again" in note


def test_without_flock_the_heartbeat_alone_decides_and_the_log_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "_flock", lambda fd: None)  # NFS without its lock manager
    lock = RunLock.acquire(tmp_path)
    try:
        assert not lock.flock
        assert "gives no lock (flock)" in lock.notes[0][1]
        with pytest.raises(RunDirInUse, match="its process is running"):
            RunLock.acquire(tmp_path)
    finally:
        lock.release()


def test_the_heartbeat_refreshes_the_file_and_reports_a_takeover(tmp_path, caplog):
    lock = RunLock.acquire(tmp_path)
    path = tmp_path / LOCK_FILE
    try:
        os.utime(path, (time.time() - 100, time.time() - 100))
        lock.beat()
        assert time.time() - path.stat().st_mtime < 10
        assert not caplog.records
        path.write_text(me(host="other-host", pid=4242).to_text())  # taken over meanwhile
        with caplog.at_level(logging.ERROR):
            lock.beat()
            lock.beat()  # said once
        [said] = [r.getMessage() for r in caplog.records]
        assert "now names pid 4242 on other-host" in said and "stop one of them" in said
    finally:
        lock.release()
    assert path.exists()  # not this run's any more: left to its holder


def test_a_record_that_is_not_json_names_no_holder(tmp_path):
    (tmp_path / LOCK_FILE).write_text('{"host": "half-writ')
    assert Holder.from_text((tmp_path / LOCK_FILE).read_text()) is None
    assert Holder.from_text(json.dumps({"host": "h"})) is None  # fields missing
    lock = RunLock.acquire(tmp_path)
    lock.release()
    assert lock.notes == []
