"""Host syncs in the training step, counted on CPU (tests/syncs.py): none inside a micro-batch,
none in an optimizer step outside its log lines (but what fp16's loss scaler needs)."""

import itertools

import pytest
import torch

from aiayn.config import load_config
from aiayn.data import ensure_cache, make_loader
from aiayn.model.transformer import _project
from aiayn.train import loop as train_module

from helpers import TINY_MODEL, model_overrides  # tests/helpers.py
from syncs import SyncCounter  # tests/syncs.py

# The step's allowed syncs outside log lines: none, but with fp16 GradScaler.get_scale before
# and after its update (LocalEngine.step: an overflow skips the schedule's step).
ALLOWED_PER_STEP = {"fp32": 0, "fp16": 2}


def tiny_config(tmp_path, corpus, lm_corpus, kind, *overrides):
    if kind == "lm":
        data = ["data.format=text", f"data.train={lm_corpus}/train.txt", "data.max_len=32"]
    else:
        data = [f"data.train={corpus}/train", "data.src_lang=en", "data.tgt_lang=de"]
        data += ["data.max_len=40"]
    return load_config(
        None,
        [
            f"run_dir={tmp_path}/run",
            f"model.kind={kind}",
            *data,
            "data.shuffle_buffer=200",
            *model_overrides(TINY_MODEL),
            "tokenizer.vocab_size=100",
            "tokenizer.sample_sentences=400",
            "train.max_tokens=300",
            "train.grad_accum=2",
            "train.max_steps=10",
            "logging.tensorboard=false",
            *overrides,
        ],
    )


@pytest.mark.parametrize(
    "kind, precision, cache",
    [("seq2seq", "fp32", True), ("lm", "fp32", False), ("seq2seq", "fp16", False)],
)
def test_a_training_step_syncs_only_where_allowed_and_no_micro_batch_syncs(
    tmp_path, monkeypatch, corpus, lm_corpus, kind, precision, cache
):
    """A real run's optimizer steps (train._train_step, on the loader's batches, with the real
    engine) counted: 0 syncs before engine.step, i.e. in the forward and backward of every
    micro-batch, and at most ALLOWED_PER_STEP in the whole step. Boolean indexing of the
    non-pad targets made 3 per micro-batch (two masks forward, one backward)."""
    cfg = tiny_config(
        tmp_path,
        corpus,
        lm_corpus,
        kind,
        f"train.precision={precision}",
        f"data.cache={str(cache).lower()}",
        "train.clip_norm=1.0",
        "train.max_steps=3",
        "logging.every_steps=100",
        "train.ema=0.999",  # the moving average's update is sync-free too
    )
    counted = []  # (syncs before engine.step, syncs of the whole step) per step
    real_train_step = train_module._train_step

    def counting_train_step(run, *args, **kwargs):
        engine, marks = run.engine, []
        real_step = engine.step

        def step():
            marks.append(len(counter.seen))
            return real_step()

        engine.step = step
        try:
            with SyncCounter() as counter:
                out = real_train_step(run, *args, **kwargs)
        finally:
            del engine.step  # the class's method again
        counted.append((counter.seen[: marks[0]], counter.seen))
        return out

    monkeypatch.setattr(train_module, "_train_step", counting_train_step)
    train_module.train(cfg)
    assert len(counted) == 3
    for per_micro, per_step in counted:
        assert per_micro == [], per_micro
        assert len(per_step) <= ALLOWED_PER_STEP[precision], per_step


@pytest.mark.parametrize("kind, cache", [("seq2seq", True), ("seq2seq", False), ("lm", True)])
def test_the_loaders_give_the_non_pad_target_positions_with_each_batch(
    tmp_path, corpus, lm_corpus, tok, kind, cache
):
    """Batch.keep, made on the host: the flat positions a boolean mask of tgt_out != pad takes,
    in its order, one per counted target."""
    cfg = tiny_config(tmp_path, corpus, lm_corpus, kind, f"data.cache={str(cache).lower()}")
    tok_cache = ensure_cache(cfg, "train", tok) if cache else None
    loader = make_loader(cfg, cfg.data.train, tok, train=True, cache=tok_cache)
    for b in itertools.islice(loader, 4):
        want = (b.tgt_out.reshape(-1) != tok.pad_id).nonzero().squeeze(1)
        assert b.keep.dtype == torch.int64 and torch.equal(b.keep, want)
        assert len(b.keep) == b.n_tokens and b.keep.device.type == "cpu"


def test_selecting_by_positions_gives_the_bits_of_boolean_indexing():
    """The model's projection and the loss's targets, taken by Batch.keep's flat positions,
    equal those a boolean mask takes, in value and in gradient, bit for bit."""
    g = torch.Generator().manual_seed(0)
    tgt_out = torch.randint(1, 9, (5, 7), generator=g)
    for r, pads in enumerate([0, 1, 3, 6, 2]):
        tgt_out[r, 7 - pads :] = 0
    mask = tgt_out != 0
    keep = mask.reshape(-1).nonzero().squeeze(1)  # as the loaders make Batch.keep
    out = torch.nn.Linear(16, 11, bias=False)
    x = torch.randn(5, 7, 16, generator=g)
    grads = []
    for select in (lambda x: _project(out, x, keep), lambda x: out(x[mask])):
        xi = x.clone().requires_grad_()
        logits = select(xi)
        (logits.sin() * torch.arange(11)).sum().backward()
        grads.append((logits, xi.grad, out.weight.grad.clone()))
        out.weight.grad = None
    for by_position, by_mask in zip(*grads, strict=True):
        assert torch.equal(by_position, by_mask)
    assert torch.equal(tgt_out.reshape(-1).index_select(0, keep), tgt_out[mask])
