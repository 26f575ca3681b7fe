"""What a start reads, per rank (real processes, gloo): each rank verifies its share of the
checkpoint and of the token cache, and every rank resumes from the same checkpoint, or all stop
with one message."""

import json
import re
import shutil
from pathlib import Path

import pytest

from aiayn.checkpoint import CheckpointManager
from aiayn.config import load_config
from aiayn.data.cache import cache_dir

from helpers import torchrun  # tests/helpers.py
from procs import aiayn, checkpoint_io, run

pytestmark = pytest.mark.distributed

VERIFIED = re.compile(
    r"checksums at start: ([\d,]+) bytes hashed by (\d+) of (\d+) rank\(s\), at most ([\d,]+)"
)
WORKER = str(Path(__file__).with_name("resume_verdict.py"))


def manifest_files(directory: Path) -> dict[str, dict]:
    """What a manifest records and a start verifies: a token cache's lengths arrays too."""
    manifest = json.loads((directory / "manifest.json").read_text())
    return {**manifest["files"], **manifest.get("lengths", {})}


def manifest_bytes(directory: Path) -> int:
    return sum(meta["bytes"] for meta in manifest_files(directory).values())


def largest_whole(directory: Path) -> int:
    """The largest piece a rank may be dealt whole: a file without ranges, or one range."""
    return max(
        max((b - a for a, b, _ in meta["sha256_ranges"]), default=0)
        if "sha256_ranges" in meta
        else meta["bytes"]
        for meta in manifest_files(directory).values()
    )


def test_each_rank_of_four_verifies_its_share_and_all_fall_back_together(setup, ddp_run):
    """Four ranks train and save steps 5 and 10; then one byte of step 10 is changed in the
    byte range rank 2 wrote (same size: only its checksum can tell). At the resume each rank
    verifies its share of step 10, rank 2 finds the damage, one sum tells them all, and the
    four resume from step 5 together. What the ranks hashed, summed: the token cache and the
    two checkpoints, each once; no rank more than a quarter of that, plus the largest piece it
    can be dealt whole from each (one rank verifying for all would hash all of it). No rank
    touches the others' files or state: what a rank stats, opens, lists and gathers at a save
    and a restart is the same at W = 4 as at W = 2 (ddp_run's saves), rank 0's gathers
    excepted (one small record per rank)."""
    root, config = setup
    run_dir = root / "four_ranks"
    options = ("train.eval_every=0", "checkpoint.every_steps=5")
    run(torchrun(4) + aiayn(config, run_dir, *options, "train.max_steps=10"))
    ckpts = run_dir / "checkpoints"
    weights = ckpts / "step_00000010" / "model.safetensors"
    a, b, _ = manifest_files(weights.parent)["model.safetensors"]["sha256_ranges"][2]
    data = bytearray(weights.read_bytes())
    data[(a + b) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    cache = cache_dir(load_config(config), "train")
    expected = [
        manifest_bytes(d) for d in (cache, ckpts / "step_00000010", ckpts / "step_00000005")
    ]
    slack = sum(largest_whole(d) for d in (cache, ckpts / "step_00000010", ckpts / "step_00000005"))
    run(torchrun(4) + aiayn(config, run_dir, *options, "train.max_steps=12"))
    log = (run_dir / "train.log").read_text()
    first, resumed = VERIFIED.findall(log)
    # The first start verified the shared cache, or built it if no test before had (then each
    # rank hashed the byte ranges of the corpus it read): either way on all four ranks.
    assert first[1:3] == ("4", "4")
    assert resumed[:3] == (f"{sum(expected):,}", "4", "4")
    busiest = int(resumed[3].replace(",", ""))
    assert busiest <= sum(expected) / 4 + slack, (busiest, sum(expected), slack)
    assert "skipping checkpoint step_00000010: 1 rank(s) found it damaged (rank 2: bytes" in log
    assert f"resuming from {ckpts / 'step_00000005'}" in log
    assert "training done at step 12" in log
    # The save was every rank's: each wrote and hashed a quarter of the weights and of the
    # trainer state's tensors; rank 0 alone, the small rest (trainer.pt: counters, positions).
    files = manifest_files(ckpts / "step_00000012")
    for name in ("model.safetensors", "trainer.safetensors"):
        ranges, size = files[name]["sha256_ranges"], files[name]["bytes"]
        assert [(a, b) for a, b, _ in ranges] == [
            (size * r // 4, size * (r + 1) // 4) for r in range(4)
        ]
    shared = files["model.safetensors"]["bytes"] + files["trainer.safetensors"]["bytes"]
    assert files["trainer.pt"]["bytes"] < shared / 10
    assert_own_files_only(log, (ddp_run / "train.log").read_text())


def assert_own_files_only(four: str, two: str) -> None:
    """Per rank at a save and at a restart, from the runs' "checkpoint I/O" lines: stats,
    opens, listings and bytes gathered from the other ranks (aiayn/runtime/io_counts.py)."""
    saves4 = [(r0, other) for what, r0, other in checkpoint_io(four) if "save" in what]
    saves2 = [(r0, other) for what, r0, other in checkpoint_io(two) if "save" in what]
    (restart,) = [other for what, _, other in checkpoint_io(four) if what == "at the restart"]
    assert saves4 and saves2
    for (r0_four, other_four), (r0_two, other_two) in zip(saves4, saves2, strict=False):
        # Another rank opens its two byte ranges' files, stats and lists nothing, and gathers
        # nothing: not the W ranges and RNG states an all-gather brought each rank before.
        assert other_four == other_two == (0, 2, 0, 0), (other_four, other_two)
        # Rank 0: the same files (the retention's reads and deletions, in a thread of their
        # own, are not counted: io_counts.uncounted); its gathers, each rank's ranges and RNG
        # state.
        assert r0_four[:3] == r0_two[:3], (r0_four, r0_two)
        assert r0_four[3] / 3 == pytest.approx(r0_two[3], rel=0.02), (r0_four, r0_two)
    # At the restart another rank verifies its share of two checkpoints (the damaged step 10,
    # then step 5: each its manifest and the files its share falls in, of the five a DDP
    # checkpoint has), then loads the manifest, weights, trainer state and its own RNG state:
    # none of it grows with W, it lists nothing and gathers nothing.
    stats, opens, listings, gathered = restart
    assert stats <= 6 and opens <= 20 and listings == 0 and gathered == 0, restart


def verdicts(tmp_path: Path, *run_dirs: Path) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    run(torchrun(2) + [WORKER, str(out), *map(str, run_dirs)], timeout=300)
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


def test_a_checkpoint_damaged_in_one_ranks_share_is_skipped_by_both(ddp_run, tmp_path):
    """A checkpoint is corrupt in the byte range rank 1 verifies (same size, its last byte
    changed: only its checksum can tell): rank 1 finds it, and both ranks resume from the one
    before; each hashed its share, neither the whole. A newer one without a manifest (on the
    storage every rank sees) is skipped by both, not taken for storage they do not share."""
    run_dir = tmp_path / "run"
    shutil.copytree(ddp_run / "checkpoints", run_dir / "checkpoints")
    shutil.copytree(
        run_dir / "checkpoints" / "step_00000020", run_dir / "checkpoints" / "step_00000030"
    )
    (run_dir / "checkpoints" / "step_00000030" / "manifest.json").unlink()
    weights = run_dir / "checkpoints" / "step_00000020" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    rank0, rank1 = verdicts(tmp_path, run_dir)
    older = str(run_dir / "checkpoints" / "step_00000010")
    assert rank0["checkpoint"] == rank1["checkpoint"] == older, (rank0, rank1)
    both = sum(
        manifest_bytes(run_dir / "checkpoints" / s) for s in ("step_00000020", "step_00000010")
    )
    assert rank0["hashed"] + rank1["hashed"] == both
    assert 0 < rank0["hashed"] < both * 0.6 and 0 < rank1["hashed"] < both * 0.6


def test_a_rank_that_cannot_see_the_chosen_checkpoint_stops_every_rank(ddp_run, tmp_path):
    """Rank 1's run_dir lacks the checkpoint rank 0 chose (storage that is not shared): both
    ranks stop with the same error, naming the rank and the fix, instead of loading different
    steps or waiting for each other until the timeout."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(ddp_run / "checkpoints", run_dir / "checkpoints")
    elsewhere.mkdir()
    rank0, rank1 = verdicts(tmp_path, run_dir, elsewhere)
    assert rank0.get("error") == rank1.get("error"), (rank0, rank1)
    assert "rank(s) cannot read it (rank 1:" in rank0["error"]
    assert "storage all nodes share" in rank0["error"]


def test_ranks_shown_different_checkpoints_resume_the_step_rank_0_chose(ddp_run, tmp_path):
    """Rank 1 is shown a newer checkpoint that rank 0 does not see (step 30, and `latest`
    naming it: what a filesystem whose clients see a directory at different times may show).
    On its own it would resume step 30; it resumes step 20 with rank 0."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    for where in (run_dir, other):
        shutil.copytree(ddp_run / "checkpoints", where / "checkpoints")
    ckpts = other / "checkpoints"
    shutil.copytree(ckpts / "step_00000020", ckpts / "step_00000030")
    (ckpts / "latest").write_text("step_00000030\n")
    alone = CheckpointManager(other, every_steps=10, keep_last=5, is_writer=False)
    assert alone.resume_point("auto").name == "step_00000030"
    rank0, rank1 = verdicts(tmp_path, run_dir, other)
    assert Path(rank0["checkpoint"]).name == Path(rank1["checkpoint"]).name == "step_00000020"
    assert rank1["hashed"] < manifest_bytes(run_dir / "checkpoints" / "step_00000020") * 0.6
