import pytest

import helpers  # tests/helpers.py
import procs  # tests/distributed/procs.py, beside this file


@pytest.fixture(scope="session")
def setup(tmp_path_factory):
    """(root, config): the corpus, tokenizer and run config every distributed test shares."""
    return procs.make_setup(tmp_path_factory.mktemp("distributed"))


@pytest.fixture(scope="session")
def ddp_run(setup):
    """The reference: 2 DDP ranks, STEPS steps."""
    root, config = setup
    run_dir = root / "ddp2"
    procs.run(helpers.torchrun(2) + procs.aiayn(config, run_dir))
    return run_dir
