import pytest

from aiayn import demo_data


@pytest.fixture(scope="session")
def numbers(tmp_path_factory):
    """A small English -> German numbers corpus (2000 / 100 / 50 pairs), made once."""
    return demo_data.write_numbers(tmp_path_factory.mktemp("numbers"), 2000, 100, 50)
