import shutil

import pytest
from jobs import DEMO, describe, submit, wrapper  # tests/slurm/jobs.py

from aiayn.config import load_config
from aiayn.corpora import demo
from aiayn.data import sample_sentences
from aiayn.tokenizer import train_tokenizer

from minicluster import MiniCluster, why_unavailable  # tests/slurm/minicluster.py


@pytest.fixture(scope="session")
def slurm():
    """A throwaway two-node Slurm cluster for the session; torn down whatever happened.
    It lives in its own /tmp directory: munged wants every directory above its socket
    searchable by all, which pytest's tmp_path is not."""
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = MiniCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The demo corpus (smaller) and its tokenizer, trained once so no job races to write it."""
    root = tmp_path_factory.mktemp("sbatch")
    data = demo.write_numbers(root / "numbers", n_train=3000, n_valid=50, n_test=10)
    tokenizer = root / "spm.model"
    cfg = load_config(DEMO, [f"data.train={data}/train", f"tokenizer.path={tokenizer}"])
    train_tokenizer(cfg.tokenizer, sample_sentences(cfg.data, "seq2seq", 5000, 1), tokenizer)
    return root, data, tokenizer


@pytest.fixture(scope="session")
def straight(slurm, corpus, tmp_path_factory):
    """The demo config on 2 nodes x 1 process, never interrupted; its python started through
    a wrapper script, as a container runtime would start it (PYTHON of two words)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job_id, out = submit(slurm, corpus, run_dir, prefix=[str(wrapper(run_dir.parent))])
    job = slurm.wait(job_id, timeout=300)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", describe(job, out, run_dir)
    return run_dir, job, out
