"""Data parallelism with real processes on CPU (gloo): torchrun and accelerate. Two "nodes" on
localhost, each with its own disk for the token cache: test_restarts.py's two-node fault."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from aiayn.config import load_config
from aiayn.data import ensure_cache, make_loader
from aiayn.tokenizer import Tokenizer

from helpers import consumed, free_port, torchrun, weights_at  # tests/helpers.py
from procs import LAUNCH, STEPS, aiayn, assert_close, launch_wrapper, run

pytestmark = pytest.mark.distributed
FIXED_BATCH = ("train.tokens_per_step=1200", "logging.record_ids=true")


def test_two_ddp_ranks_equal_one_process_accumulating_two_micro_batches(setup, ddp_run):
    """One batch over all ranks (train.tokens_per_step=1200, micro-batches of 600): one process
    derives an accumulation of 2 where 2 ranks take 1 each, trains on the same examples in
    every step and ends with the same weights."""
    root, config = setup
    single = root / "accum2"
    run([sys.executable] + aiayn(config, single, *FIXED_BATCH))
    log = (single / "train.log").read_text()
    assert (
        "1,200 tokens a step over all ranks = 600-token micro-batches x 2 accumulated x 1 ranks"
        in log
    )
    steps = consumed(single)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(sorted(steps[s]) == sorted(ids) for s, ids in consumed(ddp_run).items())
    assert_close(weights_at(ddp_run, STEPS), weights_at(single, STEPS), atol=1e-5)
    # ... and both differ from one process taking one micro-batch per step, started by
    # launch/single.sh, which prints the command it runs:
    other = root / "accum1"
    printed = launch_wrapper("single.sh", str(config), f"run_dir={other}")
    assert "python -m aiayn train" in printed and f"--config {config} run_dir={other}" in printed
    assert "x 1 accumulated x 1 ranks per step" in (other / "train.log").read_text()
    with pytest.raises(AssertionError):
        assert_close(weights_at(ddp_run, STEPS), weights_at(other, STEPS), atol=1e-5)


def test_fp16_two_ranks_equal_one_process_accumulating_and_skip_an_overflow_together(tmp_path):
    """fp16 loss scaling under DDP (once crashed at step 1: the loss went unscaled into
    backward and step() unscaled it). An inf in rank 1's micro-batch only reaches rank 0
    through the all-reduce: both ranks skip that step and halve the scale, as one process
    accumulating both micro-batches does; the other steps update alike."""
    script = str(Path(__file__).with_name("fp16_steps.py"))
    run(torchrun(2) + [script, str(tmp_path)], timeout=300)
    (tmp_path / "single").mkdir()
    run([sys.executable, script, str(tmp_path / "single")], timeout=300)
    ranks = [torch.load(tmp_path / f"rank_{r}.pt") for r in (0, 1)]
    single = torch.load(tmp_path / "single" / "rank_0.pt")
    for got in (*ranks, single):
        assert got["skipped_steps"] == 1  # step 2 of 4
        assert got["loss_scale"] == 2.0**15  # GradScaler's 2**16, halved once
        assert got["lr"] == single["lr"]  # 3 applied steps of the schedule
    assert_close(ranks[0]["weights"], ranks[1]["weights"], atol=0.0)
    # Scales, the world size and DDP's averaging are powers of two: the same bits.
    assert_close(ranks[0]["weights"], single["weights"], atol=0.0)
    with pytest.raises(AssertionError):  # ... and the 3 applied steps moved the weights
        assert_close(single["initial"], single["weights"], atol=1e-4)
    # train.ema averages the applied steps' weights only: the skipped step is no update.
    expected = list(single["initial"].values())  # named_parameters' order: parameters()'
    for step, weights in enumerate(single["after"], start=1):
        if step != 2:
            expected = [e * 0.5 + w * 0.5 for e, w in zip(expected, weights, strict=True)]
    for got in (*ranks, single):
        assert got["ema_updates"] == 3
        for g, e in zip(got["ema"], expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)

    # DDP broadcasts no buffers before each forward: the only ones are constant tables.
    assert not ranks[0]["syncs_buffers"]
    for got in ranks:
        assert list(got["buffers_after"]) == ["src_embed.positions.pe", "tgt_embed.positions.pe"]
        assert all(
            torch.equal(got["buffers_before"][k], v) for k, v in got["buffers_after"].items()
        )


def test_parameters_are_checked_identical_across_ranks_at_every_save(ddp_run):
    log = (ddp_run / "train.log").read_text()
    assert "x 1 accumulated x 2 ranks per step (train.tokens_per_step)" in log
    assert log.count("saved ") == 2  # steps 10 and 20, each after the replica check passed
    assert "differ between data-parallel ranks" not in log


def test_compiled_layers_under_ddp_follow_the_eager_ranks(setup, ddp_run):
    """train.compile with DDP's gradient hooks: the same weights as eager, up to the float
    rounding of the fused kernels, and replicas that agree at every save."""
    root, config = setup
    run_dir = root / "ddp2_compiled"  # started by launch/torchrun.sh, which prints its command
    args = (str(config), f"run_dir={run_dir}", "train.compile=true")
    printed = launch_wrapper("torchrun.sh", *args, env={"NPROC": "2", "MAX_RESTARTS": "0"})
    launcher = "python -m aiayn.distributed.run --standalone --nproc_per_node=2 --max-restarts=0"
    assert launcher in printed and " ".join(args[1:]) in printed, printed
    log = (run_dir / "train.log").read_text()
    assert "x 2 ranks per step" in log
    assert "differ between data-parallel ranks" not in log and log.count("saved ") == 2
    assert_close(weights_at(run_dir, STEPS), weights_at(ddp_run, STEPS), atol=1e-5)  # 4e-7 seen


def test_accelerate_launch_multi_process(setup, ddp_run, tmp_path):
    """launch/accelerate.sh with configs/accelerate/ddp_2proc.yaml (on a free port: accelerate
    ignores MASTER_PORT): it prints its command and its 2 processes train as torchrun's."""
    root, config = setup
    exe = Path(sys.executable).parent / "accelerate"
    if not exe.exists() and shutil.which("accelerate") is None:
        pytest.skip("accelerate is not installed")
    acc = (LAUNCH.parent / "configs" / "accelerate" / "ddp_2proc.yaml").read_text()
    (tmp_path / "accelerate.yaml").write_text(acc + f"main_process_port: {free_port()}\n")
    run_dir = root / "accelerate"
    args = (str(tmp_path / "accelerate.yaml"), str(config), f"run_dir={run_dir}")
    printed = launch_wrapper("accelerate.sh", *args)
    assert f"accelerate launch --config_file {args[0]}" in printed and args[2] in printed
    assert "x 2 ranks per step" in (run_dir / "train.log").read_text()
    assert_close(weights_at(run_dir, STEPS), weights_at(ddp_run, STEPS), atol=1e-6)


def test_uneven_shards_finish_and_every_example_is_seen_once_per_epoch(setup):
    """An odd number of batches per epoch on 2 ranks: one rank starts epoch 1 while the other
    ends epoch 0. Nothing hangs, and epoch 0's examples are each trained on exactly once."""
    root, config = setup
    cfg = load_config(config, [f"run_dir={root / 'uneven'}"])
    tok = Tokenizer(cfg.tokenizer_path)
    cache = ensure_cache(cfg, "train", tok)  # the one the run will open
    for max_tokens in range(600, 800, 10):
        cfg.train.max_tokens = max_tokens
        loader = make_loader(cfg, cfg.data.train, tok, train=True, cache=cache)
        n_batches = len(loader.rows.plan(0)[0])
        if n_batches % 2:
            break
    assert n_batches % 2, "no max_tokens gives an odd number of batches"
    run_dir = root / "uneven"
    steps = n_batches // 2 + 3  # into epoch 1 on both ranks
    run(
        torchrun()
        + aiayn(
            config,
            run_dir,
            f"train.max_tokens={max_tokens}",
            f"train.max_steps={steps}",
            "logging.record_ids=true",
        )
    )
    seen: list[int] = []
    for rank in (0, 1):
        rows = [json.loads(line) for line in open(run_dir / "consumed" / f"rank_{rank}.jsonl")]
        assert len(rows) == steps  # one batch per step on each rank: they stayed in step
        seen += [i for row in rows if row["epoch"] == 0 for i in row["ids"]]
    assert sorted(seen) == list(range(3000))  # every example once, none twice
