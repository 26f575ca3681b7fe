import shutil

import pytest

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
