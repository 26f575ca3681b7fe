"""`aiayn data prepare` in real processes: two ranks under torchrun split the tokenising and
write the same bytes as one process; a SIGKILL at any moment leaves nothing that is read, and
the same command then completes."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiayn import demo_data
from aiayn.data.cache import MANIFEST
from aiayn.data.cache_build import _CHUNK

import procs  # tests/distributed/procs.py, beside this file
from processes import kill_tree, wait_until  # tests/processes.py

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def big(tmp_path_factory, setup) -> tuple[Path, Path]:
    """A corpus of several cache chunks, so that both ranks tokenise, and its config."""
    root, config = setup
    corpus = demo_data.write_numbers(
        tmp_path_factory.mktemp("big"), n_train=int(2.5 * _CHUNK), n_valid=10, n_test=10
    )
    return corpus, config


def prepare(config: Path, corpus: Path, cache: Path, *launcher: str) -> list[str]:
    cmd = [*launcher] if launcher else [sys.executable]
    return cmd + [
        "-m",
        "aiayn",
        "data",
        "prepare",
        "--config",
        str(config),
        f"data.train={corpus}/train",
        f"data.cache_dir={cache}",
    ]


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_two_ranks_build_the_same_bytes_as_one(big, tmp_path):
    corpus, config = big
    out = procs.run(prepare(config, corpus, tmp_path / "one"))
    assert '"examples": ' in out
    procs.run(prepare(config, corpus, tmp_path / "two", *procs.torchrun(2)))
    one, two = files(tmp_path / "one" / "train"), files(tmp_path / "two" / "train")
    assert set(one) == {
        MANIFEST,
        "ids.npy",
        "src_offsets.npy",
        "src_tokens.npy",
        "tgt_offsets.npy",
        "tgt_tokens.npy",
    }
    assert one == two
    assert not (tmp_path / "two" / "train.partial").exists()


def test_a_prepare_killed_at_random_moments_leaves_nothing_read_then_completes(big, tmp_path):
    corpus, config = big
    reference = tmp_path / "reference"
    procs.run(prepare(config, corpus, reference))
    cache = tmp_path / "killed"
    root, work = cache / "train", cache / "train.partial"
    rng, interrupted = random.Random(7), 0
    for _ in range(4):
        proc = subprocess.Popen(
            prepare(config, corpus, cache),
            env=procs.ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The build starts once the interpreter has imported everything.
        wait_until(proc, work.exists, 120, "cache build")
        time.sleep(rng.uniform(0.0, 1.2))  # the build takes about a second here
        kill_tree(proc)
        if (root / MANIFEST).exists():  # it finished first: what it wrote must be whole
            assert files(root) == files(reference / "train")
            shutil.rmtree(cache)
        else:
            interrupted += work.exists()
    assert interrupted, "no kill fell inside a build: the test did not test anything"
    procs.run(prepare(config, corpus, cache))
    assert files(root) == files(reference / "train") and not work.exists()
