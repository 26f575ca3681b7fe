"""Comparisons the data tests make on batches and loader states."""

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.config import DataConfig
from aiayn.data import Batch, Loader
from aiayn.data.position import Settings
from aiayn.data.stream_rows import StreamRows
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID


def stream_loader(
    cfg: DataConfig, split: str, tok, *, kind: str, max_tokens: int, seed: int, train: bool,
    rank: int = 0, world_size: int = 1, pin_memory: bool = False, per_round: int | None = None,
) -> Loader:  # fmt: skip
    """The loader of one streamed split, from its data config alone."""
    settings = Settings(cfg, tok, kind, max_tokens, seed, train, rank)
    rows = StreamRows(settings, split)
    return Loader(rows, max_tokens, rank, world_size, pin_memory, per_round)


def take(it, n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def same(a: Batch, b: Batch) -> bool:
    fields = ("ids", "src", "tgt_in", "tgt_out", "labels")
    tensors = all(
        (getattr(a, f) is None and getattr(b, f) is None)
        or torch.equal(getattr(a, f), getattr(b, f))
        for f in fields
    )
    return tensors and a.n_tokens == b.n_tokens


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def roundtrip(state: dict) -> dict:
    """Through torch.save/torch.load(weights_only=True), as a checkpoint would."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def check_pair_rows(b: Batch, src: list[str], tgt: list[str], tok) -> None:
    """Row r of a seq2seq batch is pair b.ids[r] tokenised: src + eos, bos + tgt and tgt + eos,
    then pads; n_tokens counts the targets that are not pads."""
    for row, i in enumerate(b.ids.tolist()):
        s, t = tok.encode([src[i], tgt[i]])
        assert b.src[row, : len(s) + 1].tolist() == s + [EOS_ID]
        assert (b.src[row, len(s) + 1 :] == PAD_ID).all()
        assert b.tgt_in[row, : len(t) + 1].tolist() == [BOS_ID] + t
        assert b.tgt_out[row, : len(t) + 1].tolist() == t + [EOS_ID]
        assert (b.tgt_out[row, len(t) + 1 :] == PAD_ID).all()
    assert b.n_tokens == int((b.tgt_out != PAD_ID).sum())


def check_plans_kept(make: Callable[[int, int], Loader], world: int) -> None:
    """One rank per node makes each epoch's plan and the others memory-map it
    (data/plan_files.py): the same batches, plans and rounds' targets, bit for bit, as a rank
    that plans every epoch itself; a rank makes only the plans of its own epochs (epoch mod W);
    a restart reads the plan of its epoch instead of making it. `make(rank, W)`: a training
    loader of a token cache (or a mixture's caches) at that rank."""
    today = make(0, 1)
    today.rows._plan_files = None  # every epoch planned here, as before plans were kept
    ranks = [make(r, world) for r in range(world)]
    made: dict[int, list[int]] = {r: [] for r in range(world)}
    for r, ld in enumerate(ranks):
        ld.rows.compute_plan = lambda e, r=r, f=ld.rows.compute_plan: made[r].append(e) or f(e)
    assert len(today.rows.plan(0)[0]) > world  # each epoch has a round before it ends
    # Driven in lockstep without the batch threads, each planner's next epoch finished before
    # the next round (as an epoch's time allows in training): which rank plans is then exact.
    streams = [ld._rank_batches({"epoch": 0, "done": 0}) for ld in ranks]
    got, pos = [], None
    while not got or got[-1][1] < 4:
        for ld, stream in zip(ranks, streams, strict=True):
            taken, pos = next(stream)
            got.append((taken.batch, taken.epoch, taken.round_targets))
            for _ in range(2 if ld.rows._planner is not None else 0):
                ld.rows._planner.submit(int).result()  # its plan ahead, then the write it queued
    ref = take(iter(today), len(got))
    assert all(same(b, r) for (b, _, _), r in zip(got, ref, strict=True))
    made_by_all = sorted(e for r in made for e in made[r])
    assert made_by_all == list(range(len(made_by_all))) and len(made_by_all) >= 5  # each once
    assert all(e % world == r for r in made for e in made[r])  # by the epoch's planner
    if world > 1:  # the other ranks memory-mapped it
        assert sum(ld.rows._plan_files.read_count for ld in ranks) >= 4 * (world - 1)
    files = ranks[0].rows._plan_files
    kept = sorted(int(p.name.split("_")[1].split(".")[0]) for p in files.folder.glob("epoch_*"))
    assert kept and kept[0] >= 2  # the planners delete the plans of epochs long past
    for e in kept:
        plan, sums = files.read(e)
        fresh = today.rows.compute_plan(e)
        assert type(plan) is type(fresh) and vars(plan).keys() == vars(fresh).keys()
        for name, b in vars(fresh).items():
            a = getattr(plan, name)
            if isinstance(b, np.ndarray):
                assert (a.dtype, a.tobytes()) == (b.dtype, b.tobytes()), (e, name)
            else:
                assert a == b and type(a) is type(b), (e, name)
        want = today.rows.plan(e)[1]
        assert (sums.dtype, sums.tobytes()) == (np.dtype(np.int64), want.tobytes())
    # A restart in the last epoch reads its plan and gives the batches that follow.
    ranks[0]._pos = pos
    state = roundtrip(ranks[0].state_dict())
    again = make(world - 1, world)
    again.rows.compute_plan = lambda e: pytest.fail(f"the restart made epoch {e}'s plan")
    again.load_state_dict(state)
    nxt = take(iter(today), world)[-1]  # global batch done + world - 1
    assert same(next(iter(again)), nxt)
