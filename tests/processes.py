"""Launched jobs in tests: wait for something while the job lives, and SIGKILL the whole job."""

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil


def wait_until(
    proc: subprocess.Popen,
    done: Callable[[], object],
    timeout: float,
    what: str,
    interval: float = 0.01,
):
    """Poll `done` until it returns something true, and return that. The test fails if `proc`
    exits first or `timeout` seconds pass. interval=0 busy-polls, to catch short moments such
    as a save in progress."""
    deadline = time.monotonic() + timeout
    while not (result := done()):
        assert proc.poll() is None, f"the job exited (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(interval)
    return result


def logged(log: Path, text: str) -> Callable[[], bool]:
    """A `done` for wait_until: `text` appears in the file `log`."""
    return lambda: log.is_file() and text in log.read_text()


def kill_tree(proc: subprocess.Popen) -> None:
    """torchrun starts each rank in a session of its own, so killing the launcher's process
    group would leave the ranks training; every process of the tree gets the signal."""
    try:
        family = [psutil.Process(proc.pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    wait_ended(family, 30)


def wait_ended(members: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every one of `members` has exited; return those still running after
    `timeout` seconds. The ranks, orphaned, are reaped by PID 1, which may take a second or more
    (measured 1 s here); a zombie has exited and closed its files, which is all a test waits
    for."""
    deadline = time.monotonic() + timeout
    while not all(map(_exited, members)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [m for m in members if not _exited(m)]


def _exited(member: psutil.Process) -> bool:
    try:
        return member.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
