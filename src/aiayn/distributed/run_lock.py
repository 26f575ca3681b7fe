"""One job per run directory: a training run holds `run_dir/run.lock` from its start to its exit.

Two jobs in one run directory both write its checkpoints, `latest`, retention and train.log: the
same `aiayn train` started again beside a job whose launcher was lost (its workers train on:
torchrun starts each in a session of its own) resumes from that job's checkpoint and trains
beside it. So rank 0, and no other rank, takes the lock before anything is written into
run_dir, and every rank gets its verdict (DistEnv.decide): a refused start stops every rank
with the same message, naming the holder (RunDirInUse, exit 2, which a launcher does not
restart).

Two mechanisms, since shared file systems differ:
- `fcntl.flock` on run.lock, held for the run's life. The kernel drops it when the process
  ends, however it ends. Local disks have it; NFS has it through its lock manager (a crashed
  client's lock lasts until its lease ends, about 90 s on NFSv4), and not at all without one
  (ENOLCK); Lustre only when mounted with `flock` (with `localflock` it reaches this node
  alone).
- The file names its holder (host, pid, start, Slurm job, torchrun run) and its mtime is a
  heartbeat, touched every HEARTBEAT_S by a daemon thread: where the lock does not reach (another
  host, no flock), a start reads the holder and decides whether it is gone.

A holder is gone when its lock could be taken on its own host (the kernel released it), or on
its own host when its pid has ended or now names another process (the process start time in
/proc/PID/stat differs). On another host, or on this host's name after a restart (its boot id
differs), it is gone when this is a later start of its job (a restart by
aiayn.distributed.run whose rank 0 moved, a requeued Slurm job: its processes were ended
first) or when its heartbeat is older than STALE_AFTER_S. A start takes a gone holder's lock
over: with a warning, or an info line for an earlier start of the same job. Where flock is
missing, two starts within the same moment can both pass: the lock is for a job started beside
a live one, not for a race of two starts.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.errors import RunDirInUse

if TYPE_CHECKING:
    from aiayn.distributed.env import DistEnv

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0  # one utime() a period on rank 0: nothing next to a training step
# A holder on another host whose heartbeat is this old is gone: ten missed beats, so that a
# slow or briefly unreachable file server does not make a live run look dead. Hosts' clocks
# must agree to well within it. A process stopped that long (SIGSTOP, `scontrol suspend`)
# counts as gone too: a start on another host then takes its run directory.
STALE_AFTER_S = 300.0
# flock's errors where the file system has no lock to give (NFS without its lock manager,
# Lustre without -o flock): the heartbeat alone decides.
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

_open_locks: set[int] = set()  # the descriptors this process holds: closed in a forked child


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory, as its run.lock records it."""

    host: str
    pid: int
    since: float  # when it took the lock (seconds since the epoch)
    proc_start: int | None = None  # /proc/PID/stat's start time: tells a reused pid apart
    boot: str | None = None  # the host's boot id: a pid from before a restart is no process
    slurm: str | None = None  # SLURM_JOB_ID.SLURM_STEP_ID: kept by a requeued job
    run_id: str | None = None  # TORCHELASTIC_RUN_ID: the same over a job's restarts
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT
    command: str = ""

    @classmethod
    def this_process(cls) -> Holder:
        env = os.environ
        slurm = env.get("SLURM_JOB_ID")
        if slurm and env.get("SLURM_STEP_ID"):
            slurm = f"{slurm}.{env['SLURM_STEP_ID']}"
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            since=time.time(),
            proc_start=process_state(pid)[1],
            boot=_boot_id(),
            slurm=slurm,
            run_id=env.get("TORCHELASTIC_RUN_ID"),
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            command=" ".join(sys.argv)[:1000],
        )

    def to_text(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Holder | None:
        """The holder a run.lock names; None for an empty or unreadable one."""
        try:
            fields = json.loads(text)
            return cls(**fields) if isinstance(fields, dict) else None
        except (ValueError, TypeError):
            return None

    def same_machine(self, other: Holder) -> bool:
        return self.host == other.host and (
            self.boot is None or other.boot is None or self.boot == other.boot
        )

    def same_job(self, later: Holder) -> bool:
        """Whether `later` is a later start of this holder's job: the same Slurm job step (a
        requeue keeps the job's id), or, outside Slurm, the same torchrun run restarted (a run
        id alone is no job's: launch/multinode.sh gives every job the same one)."""
        if self.slurm or later.slurm:
            return self.slurm == later.slurm
        return bool(self.run_id) and self.run_id == later.run_id and later.restart > self.restart

    def describe(self, age: float | None = None) -> str:
        job = f"Slurm job {self.slurm}, " if self.slurm else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        beat = "" if age is None else f", last heartbeat {_duration(age)} ago"
        return f"pid {self.pid} on {self.host} ({job}since {since}{beat})"


def verdict(recorded: Holder | None, me: Holder, locked: bool, age: float) -> tuple[bool, str]:
    """(whether `recorded` still holds the run directory, why) for `me`, who could take the
    flock (`locked`) or has none on this file system, `age` seconds after its last heartbeat."""
    if recorded is None:
        return False, "run.lock names no holder"
    if recorded.same_machine(me):
        if locked:  # a live process of this host would still hold it
            return False, "its lock was released: the process ended"
        alive, start = process_state(recorded.pid)
        if not alive:
            return False, f"pid {recorded.pid} has ended"
        if None not in (start, recorded.proc_start) and start != recorded.proc_start:
            return False, f"pid {recorded.pid} is now another process"
        return True, "its process is running"
    # Another host (or this host's name on another boot: it restarted, or another machine has
    # its name): only the job and the heartbeat can tell.
    if recorded.same_job(me):
        return False, "its job has started again (a restart, or a requeue)"
    if age >= STALE_AFTER_S:
        return False, f"no heartbeat for {_duration(age)}"
    return True, f"its heartbeat is {_duration(age)} old"


def process_state(pid: int) -> tuple[bool, int | None]:
    """(whether process `pid` runs, its start time in clock ticks after boot where /proc has
    it). A zombie has ended: it holds no lock and writes nothing."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = fh.read().rpartition(")")[2].split()
        return fields[0] not in ("Z", "X"), int(fields[19])
    except FileNotFoundError:
        return False, None
    except (OSError, IndexError, ValueError):
        pass  # no /proc (not Linux): ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, None
    except PermissionError:  # another user's
        pass
    return True, None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.3g} minutes"


class RunLock:
    """run_dir's lock, held by this process: acquire() takes it, release() gives it back."""

    def __init__(self, path: Path, fd: int, me: Holder, flock: bool):
        self.path, self.me, self.flock = path, me, flock
        self.notes: list[tuple[int, str]] = []  # (level, line) for the run's log, once it has one
        self._fd = fd
        self._released = threading.Event()
        self._reported: str | None = None
        self._thread = threading.Thread(target=self._beat_until_released, daemon=True)
        _open_locks.add(fd)

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Take run_dir's lock, or raise RunDirInUse naming the run that holds it."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        me = Holder.this_process()
        for _ in range(10):  # each retry: a holder released (and removed) it while we opened it
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                lock = cls._take(path, fd, me)
            except BaseException:
                os.close(fd)
                raise
            if lock is not None:
                lock._thread.start()
                return lock
            os.close(fd)
        raise RunDirInUse(f"{path} keeps being removed and made again: is another run starting?")

    @classmethod
    def _take(cls, path: Path, fd: int, me: Holder) -> RunLock | None:
        locked = _flock(fd)
        if locked and not _same_file(fd, path):
            return None  # released and removed before our flock: open the new one
        recorded, age = _read(fd)
        if locked is False:
            raise RunDirInUse(_refusal(path, recorded, age, "it holds the run directory's lock"))
        held, why = verdict(recorded, me, bool(locked), age)
        if held:
            raise RunDirInUse(_refusal(path, recorded, age, why))
        _write(fd, me)
        lock = cls(path, fd, me, flock=bool(locked))
        if not locked:
            lock.notes.append(
                (
                    logging.INFO,
                    f"{path}: this file system gives no lock (flock); two starts are told "
                    f"apart by the file's heartbeat alone, every {HEARTBEAT_S:.0f} s",
                )
            )
        if recorded is not None:
            lock.notes.append(_takeover(path, recorded, me, age, why))
        return lock

    def release(self) -> None:
        """Stop the heartbeat, remove run.lock if it is still this run's, drop the flock."""
        if self._released.is_set():
            return
        self._released.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        try:
            recorded, _ = _read(self._fd)
            if recorded == self.me and _same_file(self._fd, self.path):
                self.path.unlink()  # before the flock goes: no one locks a file being removed
        except OSError as exc:
            log.warning("could not remove %s (%s): the next start takes it over", self.path, exc)
        _open_locks.discard(self._fd)
        os.close(self._fd)

    def _beat_until_released(self) -> None:
        while not self._released.wait(HEARTBEAT_S):
            self.beat()

    def beat(self) -> None:
        """Refresh the heartbeat, and say once (until it is fixed) when the file was removed,
        taken over or cannot be touched."""
        try:
            os.utime(self._fd)
            problem = self._problem()
        except OSError as exc:
            problem = f"cannot refresh its heartbeat ({exc}): a start on another host may take it"
        if problem is not None and problem != self._reported:
            log.error("%s %s", self.path, problem)
        self._reported = problem

    def _problem(self) -> str | None:
        if not _same_file(self._fd, self.path):
            return "was removed or replaced while this run holds it: a second start is not refused"
        recorded, _ = _read(self._fd)
        if recorded != self.me:
            who = recorded.describe() if recorded else "nobody"
            return f"now names {who}: two runs write into this run directory; stop one of them"
        return None


@contextmanager
def hold_run_dir(run_dir: Path, env: DistEnv) -> Iterator[RunLock | None]:
    """Rank 0 holds run_dir's lock for the duration; the other ranks wait for its verdict
    (one broadcast) and get the same RunDirInUse when it is refused, instead of waiting for
    rank 0 in a collective. Yields the lock on rank 0, None on the others."""
    taken: list[RunLock] = []
    try:

        def take() -> None:  # rank 0's; what every rank gets is its error, or none
            taken.append(RunLock.acquire(run_dir))

        env.decide(take)
        yield taken[0] if taken else None
    finally:
        for lock in taken:
            lock.release()


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds the lock; None: the file system has none."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in NO_FLOCK:
            return None
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read(fd: int) -> tuple[Holder | None, float]:
    """The holder the open run.lock names, and the age of its heartbeat in seconds."""
    text = os.pread(fd, 1 << 16, 0).decode("utf-8", errors="replace")
    return Holder.from_text(text), time.time() - os.fstat(fd).st_mtime


def _write(fd: int, me: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, me.to_text().encode(), 0)
    os.fsync(fd)


def _refusal(path: Path, holder: Holder | None, age: float, why: str) -> str:
    if holder is None:
        who = f"a process holds {path.name} but has not written its name yet (a run starting now?)"
        stop, host = "Wait for it, or stop it", "its host"
    else:
        who = f"{holder.describe(age)}: {why}"
        stop = (
            f"Wait for it to end, or stop it: `kill {holder.pid}` on {holder.host} makes the "
            "run save and exit (under torchrun, stop its launcher: its workers then save and "
            "exit too)"
        )
        host = holder.host
    return (
        f"{path.parent} is in use by another training run, {who}. Two runs in one run "
        f"directory would both write its checkpoints, `latest` and logs. {stop}. If it is "
        "gone and the lock stays (its host crashed, or the file system's locks do not reach "
        f"this host), check that none of its processes runs on {host}, then delete {path} "
        "and start again; a holder on another host counts as gone "
        f"{_duration(STALE_AFTER_S)} after its last heartbeat"
    )


def _takeover(path: Path, recorded: Holder, me: Holder, age: float, why: str) -> tuple[int, str]:
    if recorded.same_job(me):  # a restart in the job, or a requeue: nothing went wrong here
        return (
            logging.INFO,
            f"{path}: taking over from an earlier start of this job, {recorded.describe(age)}: "
            f"{why}",
        )
    return (
        logging.WARNING,
        f"{path}: taking over from {recorded.describe(age)}, which is gone ({why}); it ended "
        "without releasing the run directory (killed, or its host failed)",
    )


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the lock's descriptor; closing its copy
    leaves the lock with the parent, and a child that outlives its parent holds nothing."""
    for fd in list(_open_locks):
        try:
            os.close(fd)
        except OSError:
            pass
    _open_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)
