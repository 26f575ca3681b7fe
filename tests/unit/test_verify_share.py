"""Verifying a manifest on W ranks (runtime/verify_share.py): every byte by exactly one rank,
a range back to the rank that wrote it, no rank above 1/W plus one piece, and a damaged piece
found by the rank it was dealt to alone."""

import itertools
from pathlib import Path

import pytest

from aiayn.engine.deepspeed_files import partition_rank
from aiayn.runtime.durable import bytes_hashed, sha256_of
from aiayn.runtime.verify_share import hashed_in_ranges, share_of, verify_share


def manifest(root: Path, world_saved: int) -> dict[str, dict]:
    """Files like a checkpoint's and a cache's: one written by range by `world_saved` ranks,
    DeepSpeed partitions, small whole files, and an array in 1 KiB ranges."""
    files = {}
    weights = root / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 40)
    size = weights.stat().st_size
    cuts = [size * r // world_saved for r in range(world_saved + 1)]
    ranges = [[a, b, sha256_of(weights, a, b)] for a, b in itertools.pairwise(cuts)]
    files[weights.name] = {"bytes": size, "sha256_ranges": ranges}
    (root / "deepspeed").mkdir()
    for r in range(world_saved):
        name = f"deepspeed/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        (root / name).write_bytes(bytes([r]) * (3000 + r))
        files[name] = hashed_in_ranges(root / name, least=1 << 30)
    for name, n in (("trainer.pt", 700), ("src_tokens.npy", 9000)):
        (root / name).write_bytes(bytes([7]) * n)
        files[name] = hashed_in_ranges(root / name, least=1024)
    return files


@pytest.mark.parametrize("world", [1, 3, 4])
def test_every_byte_is_verified_once_and_no_rank_holds_much_more_than_its_share(tmp_path, world):
    files = manifest(tmp_path, 4)
    shares = [share_of(files, r, world, partition_rank) for r in range(world)]
    covered = sorted((n, a, b) for share in shares for n, a, b, _ in share)
    assert len(covered) == len(set(covered))
    for name, entry in files.items():  # the pieces of each file tile it
        ends = [(a, b) for n, a, b in covered if n == name]
        assert ends[0][0] == 0 and ends[-1][1] == entry["bytes"]
        assert all(x[1] == y[0] for x, y in itertools.pairwise(ends))
    total = sum(entry["bytes"] for entry in files.values())
    largest = max(b - a for share in shares for _, a, b, _ in share)
    loads = [sum(b - a for _, a, b, _ in share) for share in shares]
    assert max(loads) <= total / world + largest, loads
    if world == 4:  # a range and a partition go back to the rank that wrote them
        for r in range(4):
            names = [n for n, *_ in shares[r]]
            assert f"deepspeed/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" in names
            mine = [(a, b) for n, a, b, _ in shares[r] if n == "model.safetensors"]
            assert mine == [tuple(files["model.safetensors"]["sha256_ranges"][r][:2])]


def test_a_damaged_byte_is_found_by_the_one_rank_dealt_it(tmp_path):
    files = manifest(tmp_path, 4)
    assert [verify_share(tmp_path, files, r, 4, partition_rank) for r in range(4)] == [None] * 4
    data = bytearray((tmp_path / "src_tokens.npy").read_bytes())
    data[5000] ^= 1
    (tmp_path / "src_tokens.npy").write_bytes(bytes(data))
    before = bytes_hashed()
    found = [verify_share(tmp_path, files, r, 4, partition_rank) for r in range(4)]
    # every piece still hashed once, the damaged one included
    assert bytes_hashed() - before == sum(entry["bytes"] for entry in files.values())
    assert [p is not None for p in found].count(True) == 1
    assert "bytes 4,096-5,120 of" in next(p for p in found if p) and "src_tokens.npy" in str(found)
    (tmp_path / "trainer.pt").write_bytes(b"short")
    found = [verify_share(tmp_path, files, r, 4, partition_rank) for r in range(4)]
    assert (
        sum("trainer.pt is 5 bytes, the manifest says 700 bytes" in (p or "") for p in found) == 1
    )
