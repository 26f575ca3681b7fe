"""Comparisons the data tests make on batches and loader states."""

import io
from pathlib import Path

import torch

from aiayn.config import DataConfig
from aiayn.data import Batch, Loader
from aiayn.data.position import Settings
from aiayn.data.stream_rows import StreamRows
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID


def stream_loader(
    cfg: DataConfig, split: str, tok, *, kind: str, max_tokens: int, seed: int, train: bool,
    rank: int = 0, world_size: int = 1, pin_memory: bool = False,
) -> Loader:  # fmt: skip
    """The loader of one streamed split, from its data config alone."""
    settings = Settings(cfg, tok, kind, max_tokens, seed, train, rank)
    return Loader(StreamRows(settings, split), max_tokens, rank, world_size, pin_memory)


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
