"""The Tiny Shakespeare config on the real corpus, on 2 ranks: DDP and ZeRO-3 follow one process.

One process accumulating two micro-batches takes the same global batches as two ranks taking
one each (the token cache's plan is global), so the three loss curves agree up to float
rounding, and so do the validation scores of the whole validation text. ZeRO-3 validates on its
partitioned model, the ranks in step (evaluate.Lockstep): scoring and rank 0's samples.
"""

import gzip
import os
import sys
from pathlib import Path

import pytest

from aiayn.config import load_config
from aiayn.data import sample_sentences
from aiayn.tokenizer import train_tokenizer

from helpers import SMALL_MODEL, events, model_overrides, scalars, torchrun  # tests/helpers.py
from procs import aiayn, run, train_runs

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt.gz"
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not TEXT.is_file(), reason=f"Tiny Shakespeare not found at {TEXT} (shared data)"
    ),
]
STEPS = 20


def tb_text(run_dir: Path, tag: str) -> dict[int, str]:
    """Step -> the text the run logged to TensorBoard under `tag`."""
    from tensorboard.util import tensor_util

    texts = events(run_dir).Tensors(tag)
    return {e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in texts}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shakespeare")
    text = gzip.open(TEXT, "rt", encoding="utf-8").read()
    cut = int(len(text) * 0.9)
    (root / "train.txt").write_text(text[:cut], encoding="utf-8")
    (root / "valid.txt").write_text(text[cut : cut + 20_000], encoding="utf-8")  # quicker
    overrides = [
        f"data.train={root}/train.txt", f"data.valid={root}/valid.txt",
        f"tokenizer.path={root}/spm.model",
        *model_overrides(SMALL_MODEL, max_len=66, dropout=0.0),  # h=4: the config's too
        "data.max_len=64", "train.max_tokens=512",
        f"train.max_steps={STEPS}", "train.eval_every=10", "checkpoint.every_steps=10",
        "logging.every_steps=1", "schedule.warmup=10", "logging.samples=1",
        # fp32 wherever CI runs, so that the ranks can be held to 1e-4 of one process (the
        # recipe's cooldown, a fraction of max_steps, is its last 4 steps here)
        "train.precision=fp32",
    ]  # fmt: skip
    config = ROOT / "configs" / "tinyshakespeare_lm.yaml"
    cfg = load_config(config, overrides)
    sents = sample_sentences(cfg.data, "lm", 50_000, 1)
    train_tokenizer(cfg.tokenizer, sents, cfg.tokenizer_path)
    return root, config, overrides


def test_ddp_and_zero3_follow_one_process_on_tiny_shakespeare(setup):
    root, config, overrides = setup
    zero3 = ("distributed.backend=deepspeed", "distributed.zero_stage=3")
    run([sys.executable] + aiayn(config, root / "one", *overrides, "train.grad_accum=2"))
    # DDP, then ZeRO-3: one launch of 2 ranks, one run after the other (train_runs.py)
    two = {root / "ddp": tuple(overrides), root / "zero3": (*overrides, *zero3)}
    run(torchrun(2) + train_runs(config, two), timeout=900)
    ref = scalars(root / "one", "train/loss")
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS] < 0.85 * ref[1]  # it learns (7.0 -> 5.6 nats per BPE token seen)
    ref_bpc = scalars(root / "one", "valid/bpc")
    assert sorted(ref_bpc) == [10, 20] and ref_bpc[20] < 6.2  # ln(512)/ln(2)/0.49 = 18 at first
    for name in ("ddp", "zero3"):
        got = scalars(root / name, "train/loss")
        worst = max(abs(got[s] - ref[s]) / ref[s] for s in ref)
        assert worst <= 1e-4, f"{name}: loss curve differs from one process's by {worst:.3g}"
        bpc = scalars(root / name, "valid/bpc")
        assert bpc == pytest.approx(ref_bpc, rel=1e-4)  # the windows split over both ranks
    log = (root / "ddp" / "train.log").read_text()
    assert "x 2 ranks per step" in log and os.path.isdir(root / "ddp" / "data_cache")
    samples = [tb_text(root / name, "valid/samples/text_summary") for name in ("one", "zero3")]
    assert samples[0] and samples[0] == samples[1]  # rank 0 sampled them, the other in step
