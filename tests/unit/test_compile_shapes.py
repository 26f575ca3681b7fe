"""torch.compile and token-budget batches: an epoch of a plan's shapes, a validation pass and a
beam search stay within the graphs each layer kind may have, and one more is an error, not a
silent fall back to eager. Dynamo's CompileCounter stands in for Inductor: it counts the
graphs and runs them as they are traced, without generating code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.fx.experimental._config
from torch._dynamo.testing import CompileCounter

from aiayn.config import ModelConfig
from aiayn.data.batch import Batch, round_width
from aiayn.data.plan import epoch_rng, pair_plan
from aiayn.engine import parallelize
from aiayn.engine.loss import batch_loss
from aiayn.infer.beam import beam_search
from aiayn.model import build_model

PAD, BOS, EOS, VOCAB = 0, 1, 2, 40
MAX_LEN = 128


def corpus_shapes(n: int, max_tokens: int, multiple: int) -> list[tuple[int, int, int]]:
    """(rows, source width, target width) of one epoch's batches, in plan order, for a corpus
    whose lengths are drawn like a news translation corpus's (log-normal around 24 tokens)."""
    g = np.random.default_rng(0)
    src = np.clip(np.rint(g.lognormal(np.log(24), 0.6, n)), 1, MAX_LEN).astype(np.int32)
    tgt = np.clip(np.rint(src * g.lognormal(0.05, 0.2, n)), 1, MAX_LEN).astype(np.int32)
    limit = MAX_LEN + 1
    width = round_width(np.maximum(src, tgt) + 1, multiple, limit)
    plan = pair_plan(width, np.arange(n, dtype=np.int32), max_tokens, 1000, epoch_rng(0, 0))
    starts, order = plan.bounds[:-1], plan.order
    rows = np.diff(plan.bounds)[order]
    s = round_width(np.maximum.reduceat(src[plan.rows] + 1, starts), multiple, limit)[order]
    t = round_width(np.maximum.reduceat(tgt[plan.rows] + 1, starts), multiple, limit)[order]
    return list(zip(rows.tolist(), s.tolist(), t.tolist(), strict=True))


def batch_of(rows: int, s: int, t: int, g: torch.Generator) -> Batch:
    """Right-padded rows as the loader makes them (half of the rows end in padding)."""
    src = torch.randint(3, VOCAB, (rows, s), generator=g)
    tgt = torch.randint(3, VOCAB, (rows, t), generator=g)
    src[rows // 2 :, max(1, s - 3) :] = PAD
    tgt[rows // 2 :, max(1, t - 3) :] = PAD
    n = int((tgt != PAD).sum())
    return Batch(ids=torch.arange(rows), n_tokens=n, src=src, tgt_in=tgt, tgt_out=tgt)


def distinct(shapes: list) -> list:
    return list(dict.fromkeys(shapes))  # first appearance order: what a run meets first


@pytest.fixture
def compiled():
    """A tiny seq2seq model whose layers are compiled with a CompileCounter backend; dynamo's
    settings and caches are restored afterwards."""
    torch._dynamo.reset()
    dynamo = torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=False)
    with dynamo, torch.fx.experimental._config.patch(use_duck_shape=True):
        torch.manual_seed(0)
        cfg = ModelConfig(N=2, d_model=8, d_ff=16, h=2, max_len=MAX_LEN + 8)
        model = build_model(cfg, VOCAB, PAD)
        counter = CompileCounter()
        parallelize.apply_compile(model, backend=counter)
        yield model, counter
    torch._dynamo.reset()


def test_the_plans_shapes_have_fewer_distinct_sizes_padded_to_eight():
    plain = corpus_shapes(100_000, 2048, 1)
    padded = corpus_shapes(100_000, 2048, 8)
    assert all(r * max(s, t) <= 2048 for r, s, t in padded)  # the budget counts the rounding
    assert all(s % 8 == 0 or s == MAX_LEN + 1 for _, s, t in padded)
    assert len(distinct(padded)) < 0.6 * len(distinct(plain))


def test_an_epoch_a_validation_and_a_beam_search_stay_within_the_graph_budget(compiled):
    model, counter = compiled
    g = torch.Generator().manual_seed(0)
    shapes = distinct(corpus_shapes(100_000, 2048, 8))
    assert len(shapes) > 40  # a varied epoch, single-row batches included
    assert any(r == 1 for r, _, _ in shapes)
    model.train()
    for shape in shapes:  # training: grad mode on, dropout on (no backward: it adds no graph)
        batch_loss(model, batch_of(*shape, g), "seq2seq", 0.1, PAD)
    train_graphs = counter.frame_count
    model.eval()
    with torch.inference_mode():
        for shape in shapes[:15]:
            batch_loss(model, batch_of(*shape, g), "seq2seq", 0.0, PAD)
    for rows in (1, 5):
        src = batch_of(rows, 11, 4, g).src
        beam_search(model, src, beam=3, max_len_b=5, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    # Per layer kind: training, and training on one row (sizes 1 are specialised); inference
    # (grad mode is guarded); the encoder on one sentence; the decoder's first cached step, its
    # steps of one token (not causal), and its cache past one position, each also for one
    # sentence (a single input, or the last one decoded once the others have finished).
    assert train_graphs == 4, train_graphs
    assert counter.frame_count <= 13, counter.frame_count
    assert counter.frame_count <= 2 * parallelize.GRAPH_BUDGET


def test_a_layer_past_its_graph_budget_stops_the_run(compiled, monkeypatch):
    model, _ = compiled
    torch._dynamo.config.recompile_limit = 1  # inside the fixture's patch: restored after
    g = torch.Generator().manual_seed(0)
    model.train()
    batch_loss(model, batch_of(4, 9, 8, g), "seq2seq", 0.1, PAD)
    model.eval()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        with torch.no_grad():  # another grad mode: a second graph, one past the limit
            batch_loss(model, batch_of(4, 9, 8, g), "seq2seq", 0.0, PAD)
