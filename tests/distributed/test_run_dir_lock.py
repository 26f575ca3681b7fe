"""One job per run directory, with real 2-rank torchrun jobs on gloo (distributed/run_lock.py,
distributed/parent_death.py). One run directory, three starts of the same command:

1. a job trains; the same command started beside it is refused on both ranks, naming the
   holder (rank 0's pid and host), and writes nothing into the run directory;
2. the first job is SIGKILLed, launcher and workers: its run.lock stays, and the same command
   again takes it over with a warning naming the dead holder, and resumes from its checkpoint;
3. that job's launcher alone is SIGKILLed: its workers, whose parent it is, get SIGTERM, agree
   on a step, save it and exit; none trains on, and the lock is released.

The lock's logic in one process: tests/unit/test_run_lock.py, test_parent_death.py."""

import json
import re
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file
from processes import kill_tree, wait_ended, wait_until  # tests/processes.py

pytestmark = pytest.mark.distributed

# Each job here trains until it is killed; a checkpoint every 20 steps for the resume.
OPTIONS = ("train.max_steps=100000", "train.eval_every=0", "checkpoint.every_steps=20")


def command(config: Path, run_dir: Path) -> list[str]:
    """The same `aiayn train` under torchrun (each on a free port of its own)."""
    return helpers.torchrun(2) + procs.aiayn(config, run_dir, *OPTIONS)


def start(cmd: list[str], out: Path) -> subprocess.Popen:
    with open(out, "w") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=procs.ENV)


def logged_since(log: Path, since: int) -> str:
    return log.read_bytes()[since:].decode() if log.is_file() else ""


def steps_logged(log: Path, since: int) -> list[int]:
    return [int(s) for s in re.findall(r"train step (\d+) \|", logged_since(log, since))]


def test_a_second_job_is_refused_and_a_job_whose_launcher_dies_saves_and_ends(setup, tmp_path):
    root, config = setup
    run_dir = root / "one_job_per_run_dir"
    log, lock_file, latest = run_dir / "train.log", run_dir / "run.lock", run_dir / "checkpoints"
    host = socket.gethostname()

    first = start(command(config, run_dir), tmp_path / "first.out")
    try:
        wait_until(first, lambda: steps_logged(log, 0), 180, "the first job's first step")
        holder = json.loads(lock_file.read_text())
        ranks = psutil.Process(first.pid).children()
        assert [p.environ()["RANK"] for p in ranks if p.pid == holder["pid"]] == ["0"], holder
        assert holder["host"] == host

        second = subprocess.run(
            command(config, run_dir), capture_output=True, text=True, timeout=300, env=procs.ENV
        )
        out = second.stdout + second.stderr
        refusal = f"is in use by another training run, pid {holder['pid']} on {host}"
        assert second.returncode != 0, out[-3000:]
        assert out.count(f"aiayn train: error: {run_dir} {refusal}") == 2, out[-3000:]  # each rank
        assert re.search(r"exitcode\s*: 2", out), out[-3000:]  # an error to fix: not restarted
        assert first.poll() is None  # the holder trains on, its log its own
        text = log.read_text()
        assert text.count("| new run") == 1 and "resumed from" not in text

        wait_until(first, (latest / "latest").exists, 180, "the first job's first checkpoint")
        kill_tree(first)  # launcher and workers: nothing is released
    finally:
        kill_tree(first)
    assert json.loads(lock_file.read_text())["pid"] == holder["pid"]
    resumed_at = int((latest / "latest").read_text().split("_")[1])

    since = log.stat().st_size
    third = start(command(config, run_dir), tmp_path / "third.out")
    try:
        wait_until(
            third, lambda: resumed_at + 2 in steps_logged(log, since), 180, "2 steps after resume"
        )
        ranks = psutil.Process(third.pid).children()
        # torchrun's agent starts each worker itself: the kernel signals its death to them.
        assert sorted(p.environ()["RANK"] for p in ranks) == ["0", "1"], ranks
        third.kill()  # the launcher alone
        third.wait()
        running = wait_ended(ranks, 120)
        assert not running, f"workers still running after their launcher died: {running}"
    finally:
        kill_tree(third)
    text = logged_since(log, since)
    assert f"{lock_file}: taking over from pid {holder['pid']} on {host}" in text, text[:3000]
    assert "its lock was released: the process ended" in text
    assert f"resumed from {latest / f'step_{resumed_at:08d}'} (step {resumed_at})" in text
    stopped = re.findall(r"stop requested: saved step (\d+) \((.*)\); exiting with 75", text)
    assert len(stopped) == 1, text[-3000:]
    step, why = int(stopped[0][0]), stopped[0][1]
    assert step >= resumed_at + 2 and f"this process's launcher (pid {third.pid}) has died" in why
    assert (latest / "latest").read_text().strip() == f"step_{step:08d}"  # saved before exiting
    assert not lock_file.exists()  # released on the way out
