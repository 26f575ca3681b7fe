"""The tests that need a CUDA device: marked `gpu`, skipped where torch sees none (CI).

On a GPU machine: `pytest -m gpu -n 8 tests/gpu` (docs/gpu.md). They share the distributed
tests' corpus, tokenizer and config (tests/distributed/procs.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import procs  # noqa: E402  (tests/distributed/procs.py)


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """(root, config): the distributed tests' corpus, tokenizer and run config."""
    return procs.make_setup(tmp_path_factory.mktemp("gpu"))
