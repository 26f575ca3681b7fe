"""Small padded batches for the unit tests, of any model kind."""

import torch

from aiayn.data.batch import Batch

from helpers import TINY_MODEL, model_overrides  # tests/helpers.py

PAD = 0

TINY = ["data.train=corpus/train", "data.max_len=30", *model_overrides(TINY_MODEL, max_len=32)]
"""Overrides of a one-layer model these batches fit (build it with vocab 50 and pad PAD)."""


def padded_batch(
    kind: str = "seq2seq",
    rows: int = 4,
    src_len: int = 9,
    tgt_len: int = 8,
    vocab: int = 50,
    seed: int = 0,
) -> Batch:
    """Random tokens (ids 3 and up) in right-padded rows, as the loader makes them: the later
    half of the rows end in 1, 2 or 3 pads (id 0), so masks and the non-pad targets matter.

    seq2seq: src (rows, src_len), tgt_in and tgt_out (rows, tgt_len); lm: tgt_in and tgt_out;
    classifier: src and labels in {0, 1}.
    """
    g = torch.Generator().manual_seed(seed)

    def padded(length: int) -> torch.Tensor:
        x = torch.randint(3, vocab, (rows, length), generator=g)
        for r in range(rows // 2, rows):
            x[r, length - min(1 + r % 3, length - 2) :] = PAD
        return x

    src = padded(src_len) if kind in ("seq2seq", "classifier") else None
    if kind == "classifier":
        labels = torch.randint(0, 2, (rows,), generator=g)
        return Batch(ids=torch.arange(rows), n_tokens=rows, src=src, labels=labels)
    tgt = padded(tgt_len + 1)  # shifted by one into tgt_in and tgt_out, right-padded alike
    tgt_out = tgt[:, 1:]
    return Batch(
        ids=torch.arange(rows),
        n_tokens=int((tgt_out != PAD).sum()),
        src=src,
        tgt_in=tgt[:, :-1],
        tgt_out=tgt_out,
    )
