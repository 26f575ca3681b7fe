import pytest
import torch

from aiayn.corpora import demo


@pytest.fixture(scope="session")
def numbers(tmp_path_factory):
    """A small English -> German numbers corpus (2000 / 100 / 50 pairs), made once."""
    return demo.write_numbers(tmp_path_factory.mktemp("numbers"), 2000, 100, 50)


THREADS = torch.get_num_threads()  # the default, before any test sets it


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """train.threads=1 in an in-process run (a module fixture's too) must not change the
    thread count of the tests after it: they compare weights bitwise with subprocess runs, and
    a matmul on another number of threads sums in another order."""
    yield
    torch.set_num_threads(THREADS)
