"""Resuming on another topology, with real processes: ZeRO-3 -> ZeRO-2 on 2 ranks -> ZeRO-0 on
1 -> DDP, ZeRO-3 on 2 -> 4 -> 2 ranks, and DDP on 1 -> ZeRO-3 on 4 -> DDP on 3 -> FSDP2 on 3 ->
ZeRO-3 on 2 with another max_tokens, each against an uninterrupted run: every engine's files
read back, every engine loading another's.

Every run fixes the step's batch over all ranks (train.tokens_per_step), which the loader
deals out, rank r taking the step's batches r, r + W, ...: in the first two chains 4
micro-batches of max_tokens, each a forward (2 + 2 on 2 ranks, 1 each on 4, 4 accumulated on
1: the same batches on every W); in the third 11 units of train.unit_tokens (3, 3, 3, 2 on 4;
4, 4, 3 on 3; 6, 5 on 2), each rank fusing its own into forwards of up to max_tokens. A rank
with fewer forwards repeats its last with weight 0. The resumed run must consume the same
samples at the same steps and compute the same updates up to float rounding, with no setting
but max_tokens (the forward, not the plan) changed between the runs of a chain. Each
keeps the moving average of the weights (train.ema), which continues across the change within
the weights' tolerance: restarted from the resumed weights instead, it would be off by about
0.9^10 of the EMA's distance from the weights at step 10, 4.7e-3 (measured), so 1.6e-3.

Tolerances, stated: the reference is the uninterrupted run of the chain's first topology, so
up to the first change the two runs are the same computation; after it, the new topology sums
in another order (DeepSpeed's flat-partition gradient norm and for-loop Adam against torch's
foreach Adam). Per-step loss within 1e-6 relative (measured up to 8e-8) and final weights
within 1e-5 (measured 1.2e-7 in every chain). What the tolerances catch, measured: Adam's step
count off by one after the change moves the loss by 2.4e-4 (relative); resuming with a fresh
optimizer (the units chain's reference, resumed at step 10) moves it by 9.9e-2 and the final
weights by 2.8e-2.
"""

import hashlib
import itertools
import json
import re
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import consumed, scalars, torchrun, weights_at  # tests/helpers.py
from procs import EXAMPLES, STEPS, aiayn, assert_close, checkpoint_io, run

pytestmark = pytest.mark.distributed
HALF = STEPS // 2
COMMON = (
    "train.eval_every=0",
    "logging.record_ids=true",
    f"checkpoint.every_steps={HALF}",
    "train.ema=0.9",  # its average is read back by name on any topology, each rank its share
)
WEIGHTS_ATOL, LOSS_RTOL, FRESH_AT_LEAST = 1e-5, 1e-6, 1e-2


READS = re.compile(r"resharding read ([\d.]+ \w+) of the checkpoint's ([\d.]+ \w+)")


def kib(size: str) -> float:
    """ "3.5 MiB" (files.size_text) in KiB."""
    number, unit = size.split()
    return float(number) * {"bytes": 1 / 1024, "KiB": 1, "MiB": 1024, "GiB": 1024**2}[unit]


def zero(stage: int) -> tuple[str, ...]:
    return ("distributed.backend=deepspeed", f"distributed.zero_stage={stage}")


# Four micro-batches of 300, each a forward: the same batches on 1, 2 and 4 ranks.
FOUR = ("train.tokens_per_step=1200", "train.max_tokens=300")
UNITS = ("train.tokens_per_step=2200", "train.unit_tokens=200")  # 11 units, up to 3 a forward
FSDP = "distributed.backend=fsdp"
TOPOLOGIES = {  # name -> (launcher, options, how train.log names it)
    "zero3x2": (lambda: torchrun(2), (*zero(3), *FOUR), "DeepSpeed ZeRO-3 on 2 rank(s)"),
    "zero2x2": (lambda: torchrun(2), (*zero(2), *FOUR), "DeepSpeed ZeRO-2 on 2 rank(s)"),
    "zero3x4": (lambda: torchrun(4), (*zero(3), *FOUR), "DeepSpeed ZeRO-3 on 4 rank(s)"),
    "zero0x1": (lambda: [sys.executable], (*zero(0), *FOUR), "DeepSpeed ZeRO-0 on 1 rank(s)"),
    "ddp1": (lambda: [sys.executable], FOUR, "DDP on 1 rank(s)"),
    # Eleven units: shares of 3, 3, 3, 2 on 4 ranks, 4, 4, 3 on 3, and 6, 5 on 2.
    "units_ddp1": (lambda: [sys.executable], UNITS, "DDP on 1 rank(s)"),
    "units_zero3x4": (lambda: torchrun(4), (*zero(3), *UNITS), "DeepSpeed ZeRO-3 on 4 rank(s)"),
    "units_ddpx3": (lambda: torchrun(3), UNITS, "DDP on 3 rank(s)"),
    "units_fsdpx3": (lambda: torchrun(3), (FSDP, *UNITS), "FSDP2 on 3 rank(s)"),
    "units_zero3x2_forward1000": (
        lambda: torchrun(2),
        (*zero(3), *UNITS, "train.max_tokens=1000"),
        "DeepSpeed ZeRO-3 on 2 rank(s)",
    ),
}


def train(config: Path, run_dir: Path, topology: str, steps: int) -> None:
    launcher, options, _ = TOPOLOGIES[topology]
    run(launcher() + aiayn(config, run_dir, *options, *COMMON, f"train.max_steps={steps}"))


@pytest.fixture(scope="module")
def straight(setup):
    """Uninterrupted STEPS-step runs, one per topology, made when first asked for."""
    root, config = setup
    made: dict[str, Path] = {}

    def get(topology: str) -> Path:
        if topology not in made:
            made[topology] = root / f"reshard_straight_{topology}"
            train(config, made[topology], topology, STEPS)
        return made[topology]

    return get


def cut_back(reference: Path, run_dir: Path, step: int) -> None:
    """`run_dir` as the run `reference` stood at its checkpoint of `step`: a chain's first
    topology trains what the uninterrupted run of that topology trained, so it is copied, not
    launched again. What the reference did after `step` goes: its later checkpoints, the
    examples it recorded and its log (TensorBoard drops the later scalars itself when the run
    resumes)."""
    shutil.copytree(reference, run_dir)
    log = (run_dir / "train.log").read_text().splitlines(keepends=True)
    end = next(i for i, line in enumerate(log) if f"I/O at the save of step {step}:" in line)
    (run_dir / "train.log").write_text("".join(log[: end + 1]))
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        if int(ckpt.name.removeprefix("step_")) > step:
            shutil.rmtree(ckpt)
    for path in (run_dir / "consumed").glob("rank_*.jsonl"):
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(f"{row}\n" for row in rows))


def assert_continues(run_dir: Path, reference: Path, weights_atol: float, loss_rtol: float):
    """Same samples at the same steps, none twice within an epoch (a chain may pass into a
    second); the same schedule; loss and weights close."""
    got, ref = consumed(run_dir), consumed(reference)
    assert sorted(got) == list(range(1, STEPS + 1)) == sorted(ref)
    assert all(sorted(got[s]) == sorted(ref[s]) for s in ref)
    seen = Counter(i for s in got for i in got[s])
    assert max(seen.values()) <= -(-seen.total() // EXAMPLES)  # at most once per pass
    # A schedule that restarted would be back in its warmup: lr(11) = lr(1) * 11.
    lr, ref_lr = scalars(run_dir, "train/lr"), scalars(reference, "train/lr")
    assert all(lr[s] == pytest.approx(ref_lr[s], rel=1e-6) for s in ref_lr)
    loss, ref_loss = scalars(run_dir, "train/loss"), scalars(reference, "train/loss")
    worst = max(abs(loss[s] - ref_loss[s]) / ref_loss[s] for s in ref_loss)
    assert worst <= loss_rtol, f"loss curves differ by {worst:.3g} (relative) > {loss_rtol}"
    assert_close(weights_at(run_dir, STEPS), weights_at(reference, STEPS), atol=weights_atol)
    # the moving average of those weights went on across the change, not from its weights
    ema = [load_file(r / "checkpoints" / f"step_{STEPS:08d}" / "ema.safetensors")
           for r in (run_dir, reference)]  # fmt: skip
    assert_close(*ema, atol=weights_atol)


@pytest.mark.parametrize(
    "chain",
    [
        # The stage changes, then DDP. One chain of launches: each change costs one launch,
        # not a launch and a reference run (ZeRO-3 <-> DDP: the third chain).
        ["zero3x2", "zero2x2", "zero0x1", "ddp1"],
        # The world size changes, 2 -> 4 -> 2: each rank reads its partition only. From the
        # first chain's uninterrupted run.
        ["zero3x2", "zero3x4", "zero3x2"],
        # Units: world sizes that do not divide the step's, on every engine, and another
        # max_tokens at the last resume; FSDP2 reads and is read by the others at another W.
        ["units_ddp1", "units_zero3x4", "units_ddpx3", "units_fsdpx3", "units_zero3x2_forward1000"],
    ],
    ids="_to_".join,
)
def test_resume_on_another_topology_continues_the_same_run(setup, straight, chain):
    """Each topology trains its share of STEPS, then the next resumes from its checkpoint. The
    reference is the first topology's uninterrupted run: up to the first change the two are
    the same computation, so what differs after is rounding, not lost state."""
    root, config = setup
    run_dir = root / ("reshard_" + "_".join(chain))
    ends = [HALF + (STEPS - HALF) * i // (len(chain) - 1) for i in range(len(chain))]
    cut_back(straight(chain[0]), run_dir, ends[0])  # the first topology's steps, not again
    for topology, end in zip(chain[1:], ends[1:], strict=True):
        train(config, run_dir, topology, end)
    log = (run_dir / "train.log").read_text()
    for before, after in itertools.pairwise(chain):
        names = TOPOLOGIES[before][2], TOPOLOGIES[after][2]
        assert "checkpoint written by {}, resuming on {}".format(*names) in log
    assert "apply to another batch" not in log  # the world size changed, the batch did not
    assert_continues(run_dir, straight(chain[0]), WEIGHTS_ATOL, LOSS_RTOL)
    if "units_fsdpx3" in chain:
        # An FSDP2 rank of 3 keeps a third of every parameter's rows and of its moments.
        step = ends[chain.index("units_fsdpx3")]
        files = sorted((run_dir / "checkpoints" / f"step_{step:08d}" / "fsdp").iterdir())
        sizes = [f.stat().st_size for f in files]
        assert len(sizes) == 3 and max(sizes) < 0.4 * sum(sizes), sizes
        # The start-up lines: the shares, their idle units, and the forward that changed.
        idle = "8% of the ranks' units idle), fused into forwards of up to"
        assert f"units x 11 shared by 3 ranks (2 take 4, 1 takes 3; {idle} 600 tokens" in log
        assert f"units x 11 shared by 2 ranks (1 takes 6, 1 takes 5; {idle} 1,000 tokens" in log
    elif "zero3x4" in chain:
        # ZeRO-3 to ZeRO-3: the busiest rank read about 1/W_new of the weights and moments
        # (the whole of them per rank before: W_new x the state in all).
        shares = [kib(read) / kib(stored) for read, stored in READS.findall(log)]
        assert len(shares) == 2 and shares[0] < 0.3 and shares[1] < 0.55, shares
        assert_own_files_only(log)


def assert_own_files_only(log: str) -> None:
    """ZeRO-3 saves at W = 2, 4, 2 (steps 10, 15, 20) and restarts at W = 4 and 2: what the
    busiest rank other than 0 stats, opens, lists and gathers is the same at both W, and
    rank 0's differs only by its gathers (each rank's ranges and RNG state, 1 record per
    rank). Before, every rank listed the DeepSpeed folder (2 files per rank) at a save and
    a load, and statted every rank's partition (aiayn/runtime/io_counts.py counts)."""
    lines = checkpoint_io(log)
    assert [what for what, _, _ in lines] == [
        "at the save of step 10",
        "at the restart",
        "at the save of step 15",
        "at the restart",
        "at the save of step 20",
    ]
    (_, r0_10, save_10), (_, _, restart_4), (_, r0_15, save_15) = lines[:3]
    (_, _, restart_2), (_, r0_20, save_20) = lines[3:]
    assert save_10 == save_15 == save_20, (save_10, save_15, save_20)
    assert save_10[2:] == (0, 0), save_10  # no listing, nothing gathered
    # Both restarts reshard (the topology changed): each rank maps every saved rank's
    # optimizer partition (torch.load's mmap) and reads its share of each, one open per saved
    # rank, and verifies 1/W of a checkpoint of 2 W_saved + 7 files: so its opens follow the
    # saved W, not only this one; its stats, listings (the reshard's one glob of the saved
    # partitions, 2) and gathers (none) do not. On the same topology (a fault restart) a rank
    # opens its own partition only (DeepSpeedEngine._read_own_files_only).
    assert restart_2[0] == restart_4[0] and restart_2[2:] == restart_4[2:], (restart_4, restart_2)
    assert restart_4[3] == 0, restart_4
    for (_, opens, _, _), saved, now in ((restart_4, 2, 4), (restart_2, 4, 2)):
        assert opens <= 10 + saved + -(-(2 * saved + 7) // now), (opens, saved, now)
    # Rank 0 too, but for its gathers: rank files it opened would add 2 per rank from W = 2 to
    # 4. The retention's reads of the kept manifests and its deletions, in a thread of their
    # own, are not counted (io_counts.uncounted): they landed in one save's count or the next
    # by timing alone.
    assert r0_10[:3] == r0_15[:3] == r0_20[:3], (r0_10, r0_15, r0_20)
    assert r0_15[3] / 3 == pytest.approx(r0_10[3], rel=0.02), (r0_10, r0_15)


def test_a_resume_without_the_optimizer_state_would_fail_those_tolerances(setup, straight):
    """The contrast that makes the test above meaningful: a resume with Adam's moments and
    step count dropped from the checkpoint ends far from the uninterrupted run, even on the
    same topology (one process, the units chain's reference)."""
    root, config = setup
    run_dir = root / "reshard_fresh_adam"
    cut_back(straight("units_ddp1"), run_dir, HALF)
    ckpt = run_dir / "checkpoints" / f"step_{HALF:08d}"
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    assert len(state["engine"]["optimizer"]["state"]) > 0
    state["engine"]["optimizer"]["state"] = {}
    torch.save(state, ckpt / "trainer.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    data = (ckpt / "trainer.pt").read_bytes()
    manifest["files"]["trainer.pt"] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    train(config, run_dir, "units_ddp1", STEPS)
    assert f"resumed from {ckpt} (step {HALF})" in (run_dir / "train.log").read_text()
    with pytest.raises(AssertionError, match="differ"):
        assert_continues(run_dir, straight("units_ddp1"), WEIGHTS_ATOL, LOSS_RTOL)
    a, b = weights_at(run_dir, STEPS), weights_at(straight("units_ddp1"), STEPS)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst > FRESH_AT_LEAST, f"a fresh optimizer moved the weights by only {worst:.3g}"


def test_zero3_checkpoints_average_and_export(straight, tmp_path):
    """`aiayn average` and `export` read model.safetensors, which ZeRO-3 gathers at save."""
    straight = straight("zero3x2")
    cli = [sys.executable, "-m", "aiayn"]
    run(cli + ["average", str(straight), "--last", "2", "--output", str(tmp_path / "avg")])
    a, b = weights_at(straight, HALF), weights_at(straight, STEPS)
    avg = load_file(tmp_path / "avg" / "model.safetensors")
    assert avg.keys() == a.keys() and all(torch.equal(avg[k], (a[k] + b[k]) / 2) for k in a)
    out = tmp_path / "export" / "zero3.safetensors"
    run(cli + ["export", str(straight), "--output", str(out)])
    exported = load_file(out)
    assert exported.keys() == b.keys() and all(torch.equal(exported[k], b[k]) for k in b)
