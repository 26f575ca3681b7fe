"""SIGKILL for a launched job: the launcher and every process under it, at once."""

import signal
import subprocess

import psutil


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
    psutil.wait_procs(family, timeout=30)
