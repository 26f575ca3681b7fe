"""gloo's full mesh under aiayn's settings (distributed/env.py use_scalable_gloo_meshes): what
its rendezvous asks of the store's one host must not grow as W^2 (issue 54: 2.1 million
requests and 8.6 GB at 1,024 ranks without them, 73 s of a restart's budget)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("gloo_mesh.py")


def test_a_gloo_group_reads_the_store_in_batches_and_its_keys_do_not_grow_with_w():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "3", "8"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = {int(w): r for w, r in json.loads(out.stdout).items()}
    for w, r in got.items():
        # One key set and one read of all W keys (128 to a request) a rank: 2W requests, not
        # the 2W(W - 1) + W of one wait and one get a key.
        assert r["calls"] == {"set": w, "multi_get": w}
        assert r["sums"] == [w * (w - 1) / 2] * w  # and the mesh sums
    # A key is a rank's host and address: the same bytes at W = 3 and 8 (by default it lists a
    # pair number for each rank, 8 bytes more a rank).
    per_key = {w: r["read_bytes"] / w**2 for w, r in got.items()}
    assert per_key[3] == per_key[8]
