import pytest

from aiayn import demo_data


@pytest.fixture(scope="session")
def numbers(tmp_path_factory):
    """A small English -> German numbers corpus (2000 / 100 / 50 pairs), made once."""
    return demo_data.write_numbers(tmp_path_factory.mktemp("numbers"), 2000, 100, 50)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """train.threads=1 in one in-process run must not change the next test's thread count:
    tests compare weights bitwise, and a matmul on another number of threads sums in another
    order."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
