import contextlib
import fcntl
import os
import shutil
from pathlib import Path

import pytest

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file


@contextlib.contextmanager
def made_once(folder: Path):
    """Yields True where `folder` is still to be made, holding a lock until it is: the
    pytest-xdist workers of a session share the runs below, made by the first worker to need
    one while the others wait for it. One its maker left half made (it failed) is made again
    from nothing."""
    done = folder.with_name(folder.name + ".made")
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = not done.exists()
        if todo:
            shutil.rmtree(folder, ignore_errors=True)
        yield todo
        if todo:
            done.touch()


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """(root, config): the corpus, tokenizer, token cache and run config every distributed test
    shares, made once a session (its workers share the session's folder)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "distributed"
    with made_once(root) as todo:
        if todo:
            root.mkdir()
            procs.make_setup(root)
    return root, root / "run.yaml"


@pytest.fixture(scope="session")
def ddp_run(setup):
    """The reference: 2 DDP ranks, STEPS steps, each of 2 micro-batches over both ranks (the
    same as train.grad_accum's default here), recording the examples of each step."""
    root, config = setup
    run_dir = root / "ddp2"
    with made_once(run_dir) as todo:
        if todo:
            fixed = ("train.tokens_per_step=1200", "logging.record_ids=true")
            procs.run(helpers.torchrun(2) + procs.aiayn(config, run_dir, *fixed))
    return run_dir
