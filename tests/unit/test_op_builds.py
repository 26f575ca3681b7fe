"""A killed DeepSpeed op build leaves torch's lock: we wait for live builds, refuse dead ones."""

import os
import threading
import time

import pytest

from aiayn.engine import op_builds
from aiayn.errors import TrainingError


def make_lock(path, age_s: float = 0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_lock_older_than_any_build_is_refused_with_its_path_and_the_fix(tmp_path):
    lock = make_lock(tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", age_s=3 * 3600)
    with pytest.raises(TrainingError, match="killed half way") as err:
        op_builds.wait_for_op_builds(tmp_path, poll_s=0.01)
    assert f"rm {lock}" in str(err.value)
    assert "180 minutes old" in str(err.value)


def test_a_live_build_is_waited_for_until_it_releases_its_lock(tmp_path):
    lock = make_lock(tmp_path / "cpu_adam" / "lock")  # the TORCH_EXTENSIONS_DIR layout
    threading.Timer(0.3, lock.unlink).start()
    start = time.monotonic()
    op_builds.wait_for_op_builds(tmp_path, poll_s=0.02)
    assert time.monotonic() - start >= 0.25
    assert not lock.exists()


def test_a_build_that_outlives_the_limit_while_waited_on_is_refused(tmp_path):
    make_lock(tmp_path / "py311_cpu" / "cpu_adam" / "lock")
    with pytest.raises(TrainingError, match="cpu_adam/lock"):
        op_builds.wait_for_op_builds(tmp_path, stale_after_s=0.2, poll_s=0.02)


def test_finished_builds_and_a_missing_root_do_not_wait(tmp_path):
    built = tmp_path / "py311_cpu" / "cpu_adam"
    built.mkdir(parents=True)
    (built / "cpu_adam.so").touch()
    start = time.monotonic()
    op_builds.wait_for_op_builds(tmp_path, poll_s=5)
    op_builds.wait_for_op_builds(tmp_path / "never_built", poll_s=5)
    assert time.monotonic() - start < 1


def test_the_root_is_torch_extensions_dir_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert op_builds.extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert op_builds.extensions_root().name == "torch_extensions"
