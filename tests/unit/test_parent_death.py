"""A worker ends when its launcher dies (aiayn/distributed/parent_death.py): a tiny launcher
starts a worker in a session of its own, as torchrun's agent does, and is SIGKILLed; the
worker gets SIGTERM, the preemption signal. No torch in either process. (With torchrun and a
training run: tests/distributed/test_run_dir_lock.py.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aiayn
from aiayn.distributed import parent_death

SRC = str(Path(aiayn.__file__).parents[1])
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])),
}

LAUNCHER = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]],
                          env={**os.environ, "LOCAL_RANK": "0"}, start_new_session=True)
print(worker.pid, flush=True)
time.sleep(60)
"""

WORKER = """
import os, signal, sys, time
from pathlib import Path
from aiayn.distributed import parent_death
out = Path(sys.argv[1])
def stop(signum, frame):
    out.write_text(f"{signum} {parent_death.launcher_gone()}")
    os._exit(75)
signal.signal(signal.SIGTERM, stop)
requested = parent_death.end_with_launcher()
(out.parent / "ready").write_text(str(requested))
time.sleep(60)
"""

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")


def wait_for(path: Path, seconds: float = 20) -> str:
    """The file's text once it has some: write_text creates the file before it writes, so a
    file that exists may still be empty (CI read '' here once)."""
    deadline = time.monotonic() + seconds
    while not (path.exists() and (text := path.read_text())):
        assert time.monotonic() < deadline, f"no {path.name} within {seconds:.0f} s"
        time.sleep(0.01)
    return text


@linux_only
def test_a_worker_whose_launcher_is_sigkilled_gets_sigterm(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WORKER, str(tmp_path / "stopped")],
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    worker = int(launcher.stdout.readline())
    try:
        assert wait_for(tmp_path / "ready") == "True"
        launcher.kill()
        launcher.wait()
        assert wait_for(tmp_path / "stopped") == f"{int(signal.SIGTERM)} {launcher.pid}"
    finally:
        launcher.kill()
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_process_no_launcher_started_is_left_alone(monkeypatch):
    monkeypatch.setattr(parent_death, "_launcher", None)
    assert parent_death.end_with_launcher({}) is False  # `aiayn train` from a shell
    monkeypatch.setattr(sys, "platform", "darwin")
    assert parent_death.end_with_launcher({"LOCAL_RANK": "0"}) is False  # no prctl: no error
    assert parent_death.launcher_gone() is None


@linux_only
def test_a_launcher_that_died_before_the_request_is_answered_at_once(monkeypatch):
    """The kernel signals a parent's death only after the request: a worker orphaned just
    before it sees its parent change, and signals itself."""
    parents = iter([4242])
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))  # 4242, then init
    requests, sent = [], []

    class Libc:
        def prctl(self, *args):
            requests.append(args)
            return 0

    monkeypatch.setattr(parent_death.ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(parent_death, "_launcher", None)
    assert parent_death.end_with_launcher({"TORCHELASTIC_RUN_ID": "x"})
    assert requests == [(parent_death.PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)]
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert parent_death.launcher_gone() == 4242
