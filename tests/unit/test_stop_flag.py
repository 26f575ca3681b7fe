"""StopFlag (aiayn/distributed/preemption.py) in a real process: the first SIGTERM asks for a
save after this step; a SIGTERM REPEAT_AFTER_S or more after it exits at once, even while the
process is blocked in C, where Python runs no signal handler."""

import signal
import subprocess
import sys
import time

from aiayn.distributed.preemption import NOW_EXIT_CODE, REPEAT_AFTER_S

BLOCKED_IN_C = """
import hashlib
from aiayn.distributed.preemption import StopFlag
with StopFlag():
    print("ready", flush=True)
    # Minutes in OpenSSL, with the GIL released and no return to the interpreter until it is
    # done: what a rank waiting in a collective looks like to its signal handlers.
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 10**9)
print("not ended", flush=True)
"""


def test_a_second_sigterm_ends_the_process_at_once_even_blocked_in_c():
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_IN_C],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGUSR1)  # a preemption's warning: not a SIGTERM
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the first: save after this step
        first = time.monotonic()
        time.sleep(0.2)
        # The same request delivered twice (Slurm signals the launcher and the workers, and
        # the launcher forwards it): not a second one.
        proc.send_signal(signal.SIGTERM)
        time.sleep(max(first + REPEAT_AFTER_S - 0.3 - time.monotonic(), 0))
        assert proc.poll() is None, proc.communicate()
        time.sleep(max(first + REPEAT_AFTER_S + 1.0 - time.monotonic(), 0))
        proc.send_signal(signal.SIGTERM)  # a second: now
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        ended = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == NOW_EXIT_CODE, err
    assert "a second SIGTERM: exiting now, without saving" in err
    assert ended < 5, f"{ended:.1f} s after the second SIGTERM"
