import pytest

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """(root, config): the corpus, tokenizer and run config every distributed test shares."""
    return procs.make_setup(tmp_path_factory.mktemp("distributed"))


@pytest.fixture(scope="session")
def ddp_run(setup):
    """The reference: 2 DDP ranks, STEPS steps, each of 2 micro-batches over both ranks (the
    same as train.grad_accum's default here), recording the examples of each step."""
    root, config = setup
    run_dir = root / "ddp2"
    fixed = ("train.tokens_per_step=1200", "logging.record_ids=true")
    procs.run(helpers.torchrun(2) + procs.aiayn(config, run_dir, *fixed))
    return run_dir
