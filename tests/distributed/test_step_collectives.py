"""Collectives and host syncs per optimizer step, with two real ranks (gloo) on the path a NCCL
job takes: under DDP, under DeepSpeed ZeRO 0, 1, 2 and 3 and under FSDP2 in the same launch;
and, from the same runs, that each ZeRO stage and FSDP2 compute DDP's update (test_deepspeed.py
follows the stages with options, offload and activation checkpointing, over 20 steps)."""

import json
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest

from helpers import scalars, torchrun, weights_at  # tests/helpers.py
from procs import assert_close, run

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("step_collectives.py")
STEPS = 5

# The host syncs an optimizer step makes outside log lines, by the code that asks for the value
# (tests/syncs.py call_site), under DeepSpeed 0.19.8; none inside a micro-batch, in any engine.
# ZeRO's step decides on the host whether the gradient norm is finite, to skip the update of a
# step whose gradients overflowed (deepspeed/runtime/utils.py is_invalid_grad_norm:
# `bool((~isfinite(norm) | (norm < 0)).any())`), in every precision. Stages 1 and 2 ask again
# for the clipping factor (unscale_and_clip_grads), a few kernels later, of a norm step() has
# already accepted. They stay (docs/distributed.md prices them): without them a non-finite
# update would be applied where DeepSpeed skips it, and removing the second means replacing
# a DeepSpeed method for the time of a few kernels. A DeepSpeed that adds, moves or drops one
# fails here, named, with its version.
ZERO_NORM = "runtime/utils.py:is_invalid_grad_norm"
ALLOWED_PER_STEP = {
    "ddp": [],
    "zero0": [],  # DeepSpeed steps the torch optimizer; aiayn clips (DeepSpeedEngine)
    "zero1": [
        f"zero/stage_1_and_2.py:step -> {ZERO_NORM}",
        f"zero/stage_1_and_2.py:unscale_and_clip_grads -> {ZERO_NORM}",
    ],
    "zero2": [
        f"zero/stage_1_and_2.py:step -> {ZERO_NORM}",
        f"zero/stage_1_and_2.py:unscale_and_clip_grads -> {ZERO_NORM}",
    ],
    "zero3": [f"zero/stage3.py:step -> {ZERO_NORM}"],
    "fsdp": [],  # the norm is one all-reduce of the ranks' rows' norms, on the device
}
# ZeRO-3 records the order in which modules gather their weights during the first step and
# checks it is the same on every rank: a broadcast and an .item() per module and parameter
# (zero/utils.py assert_ints_same_as_other_ranks), once (and again only after the order
# changes: validation's forwards did not change it).
ZERO3_TRACE_CHECK = (
    "zero/utils.py:assert_lst_len_same_as_other_ranks",
    "zero/utils.py:<listcomp>",  # get_lst_from_rank0's, a frame of its own before Python 3.12
    "zero/utils.py:get_lst_from_rank0",
)


@pytest.fixture(scope="module")
def launched(setup) -> Path:
    """The folder where step_collectives.py's 2 ranks ran DDP, then ZeRO 0, 1, 2 and 3: each
    run's run_dir (by its name), and what each rank recorded (rank_<r>.json)."""
    root, config = setup
    out = root / "step_collectives"
    out.mkdir()
    overrides = [
        f"train.max_steps={STEPS}",
        "train.grad_accum=2",  # two micro-batches a step on each rank
        "train.max_epochs=100",  # the loop checks the epoch limit at every step
        "train.eval_every=0",
        "logging.every_steps=100",  # only the last step logs
        "checkpoint.every_steps=100",
    ]
    run(torchrun(2) + [str(WORKER), str(config), str(out), *overrides])
    return out


@pytest.fixture(scope="module")
def ranks(launched):
    """What step_collectives.py recorded on each of 2 ranks, by run."""
    return [json.loads((launched / f"rank_{rank}.json").read_text()) for rank in (0, 1)]


def test_a_step_waits_for_no_collective_of_host_numbers_and_no_host_sync(ranks):
    """Between the starts of two optimizer steps without a log line, each rank makes exactly
    one collective, and does not wait for it: an all-reduce of a host tensor over a gloo group
    of its own (which on a NCCL job waits for nothing queued on the GPU), started by one step
    and read by the next: the stop request (StopVote). The step's tokens and train.max_epochs'
    limit come from the token cache's plan, which every rank knows whole (they were in that
    all-reduce, waited for, and before that each an all-reduce on the default group, through
    the GPU). The DDP step itself makes no host sync."""
    for seen in ranks:
        calls, steps = seen["ddp"]["calls"], seen["ddp"]["steps"]
        assert len(steps) == STEPS
        for before, after in zip(steps, steps[1:], strict=False):
            between = calls[before["first_call"] : after["first_call"]]
            expected = {"op": "all_reduce", "group": "gloo", "devices": ["cpu"], "waits": False}
            assert between == [expected], between
        assert all(step["syncs"] == [] for step in steps), steps


def test_an_fsdp_step_makes_no_host_sync(ranks):
    """Under FSDP2 on two ranks, 2 micro-batches a rank: no host sync in the micro-batches
    (the first gathers no reduction: set_requires_gradient_sync) nor in the step."""
    for seen in ranks:
        steps = seen["fsdp"]["steps"]
        assert len(steps) == STEPS
        assert all(step["sites"] == ALLOWED_PER_STEP["fsdp"] for step in steps), steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_zero_step_syncs_only_for_its_norm_and_never_per_micro_batch(ranks, stage):
    """Under DeepSpeed on two ranks, ZeRO 0 to 3, each optimizer step (2 micro-batches per
    rank): no host sync in any micro-batch's forward and backward (but ZeRO-3's first), only
    ALLOWED_PER_STEP in the step, and no call of DeepSpeed's device-wide synchronize. Its
    throughput timer, on and synchronized by default, made one at every forward and every step
    from the third (3 a step here) before engine/deepspeed_config.py turned it off; none of
    DeepSpeed's diagnostics that wait for the device is on in the engine it built."""
    name, version = f"zero{stage}", metadata.version("deepspeed")
    for seen in ranks:
        run_ = seen[name]
        assert not any(run_["diagnostics"].values()), run_["diagnostics"]
        assert len(run_["steps"]) == STEPS
        for i, step in enumerate(run_["steps"]):
            split = step["before_step"]  # the syncs before engine.step: the micro-batches'
            micro, in_step = step["sites"][:split], step["sites"][split:]
            if stage == 3 and i == 0:
                micro = [s for s in micro if not s.endswith(ZERO3_TRACE_CHECK)]
            where = f"step {i + 1} under DeepSpeed {version}"
            assert micro == [], (where, micro)
            assert Counter(in_step) == Counter(ALLOWED_PER_STEP[name]), (where, in_step)
            assert step["device_syncs"] == [], (where, step["device_syncs"])


@pytest.mark.parametrize("engine", ["zero0", "zero1", "zero2", "zero3", "fsdp", "fsdp_kept"])
def test_a_sharded_engine_computes_the_ddp_update(launched, engine):
    """The same 5 steps (2 micro-batches a rank, fp32, dropout off) under DDP and under a ZeRO
    stage or FSDP2 (as ZeRO-3, and as ZeRO-2 offloaded: its weights kept gathered from a
    forward to its backward, and after the last validation until the save shards them again),
    in one process group: the same update up to float rounding. DeepSpeed sums
    the gradient norm over flat partitions and steps Adam per partition, FSDP2 sums each rank's
    rows' norms, so low bits may differ:
    measured on 2026-11-27 (AMD EPYC, avx512_bf16), the last step's loss equal, its gradient norm
    within 1e-7 (relative) and the weights within 3e-8. The bounds leave 10-30 times that, and
    are far below what a wrong update moves: Adam moves each weight by about the learning rate a
    step, here 1.25e-4 x step (warmup 100, d_model 64), about 2e-3 over the 5 steps. The norm
    before clipping is the one DDP reports (ZeRO-0 once reported nan: DeepSpeed computed none
    for a plain torch optimizer). test_deepspeed.py follows ZeRO with options over 20 steps."""
    ddp, other = launched / "ddp", launched / engine
    assert_close(weights_at(other, STEPS), weights_at(ddp, STEPS), atol=1e-6)
    for tag, rtol in (("train/loss", 1e-6), ("train/grad_norm", 1e-6)):
        got, ref = scalars(other, tag), scalars(ddp, tag)
        assert sorted(got) == sorted(ref) == [STEPS], (tag, got, ref)
        assert got[STEPS] == pytest.approx(ref[STEPS], rel=rtol), tag
