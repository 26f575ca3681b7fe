"""The rows of a rank's next few batches, read from token caches together.

A token-cache loader hands out one batch at a time but reads the rows of its next batches of the
epoch in one go (about READ_TOKENS padded tokens of them). A batch of a few thousand tokens
costs mostly numpy's fixed price per call, a microsecond or two: reading its rows from the
memory maps one batch at a time took a fancy index of the offsets and one of the tokens per
side, and a mixture of sources (data/mixed_loader.py) one of each per source. Read together,
those calls are made once per read, the sources' rows each in one gather, so the number of
sources costs a few calls per read, not per batch. What is left per batch is padding rows that
are already in memory, one after another.

The read holds the rows' tokens unpadded (two int64 arrays of about READ_TOKENS), not batches,
so the memory held ahead stays small at any batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aiayn.data.batch import Batch, round_width, target_positions
from aiayn.data.cache import TokenCache

READ_TOKENS = 2**17
"""Padded tokens of the batches read together: 32 batches of 4,096 tokens, 5 of 25,000, one
batch from 131,072 up."""
MOST_BATCHES = 64


def read_count(max_tokens: int) -> int:
    """How many of a rank's batches are read together at data.max_tokens (1 to MOST_BATCHES)."""
    return max(1, min(MOST_BATCHES, READ_TOKENS // max(max_tokens, 1)))


def cache_arrays(cache: TokenCache) -> dict[str, np.ndarray]:
    """Plain ndarray views of a cache's memory maps (no copy): np.memmap's indexing goes
    through a Python subclass, about a microsecond more a call."""
    return {name: np.asarray(a) for name, a in vars(cache).items() if isinstance(a, np.ndarray)}


def ragged_index(start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cells, ends): the cells start[i] .. start[i] + length[i] - 1 of every row, one row after
    another, and where each row ends in them."""
    ends = np.cumsum(length)
    total = int(ends[-1]) if len(ends) else 0
    return np.arange(total, dtype=np.int64) + np.repeat(start - (ends - length), length), ends


@dataclass
class Ragged:
    """One side's rows, batch after batch: the rows of batch b are flat[at[b]:at[b + 1]], one
    after another, row i of them length[i] tokens long."""

    flat: np.ndarray
    length: np.ndarray
    at: np.ndarray

    def padded(self, b: int, lo: int, hi: int, width: int, lead: int, pad: int) -> np.ndarray:
        """(hi - lo, width) int64: batch b's rows (rows lo .. hi - 1), each after `lead` free
        columns (where the caller writes bos), right-padded. Their tokens are one stretch of
        `flat`, in the row-major order of the cells they fill."""
        column = np.arange(width)
        mask = column < (self.length[lo:hi, None] + lead)
        if lead:
            mask &= column >= lead
        out = np.full((hi - lo, width), pad, dtype=np.int64)
        out[mask] = self.flat[int(self.at[b]) : int(self.at[b + 1])]
        return out


@dataclass
class RowsRead:
    """Batches first, first + step, ... (`count` of them) of one plan, their rows one after
    another: batch b's are rows row_at[b] .. row_at[b + 1] - 1."""

    plan: object
    first: int
    step: int
    count: int
    row_at: np.ndarray
    ids: np.ndarray
    sources: np.ndarray | None
    src: Ragged
    tgt: Ragged | None
    labels: np.ndarray | None

    def holds(self, plan: object, k: int) -> bool:
        d = k - self.first
        return plan is self.plan and d >= 0 and d % self.step == 0 and d // self.step < self.count

    def batch(self, k: int, kind: str, pad: int, bos: int, eos: int, fit: dict) -> Batch:
        """Batch k of the plan: src (rows + eos), and tgt_in (bos + rows) and tgt_out (rows +
        eos), or labels. Widths are the widest row + 1, rounded by round_width(**fit)."""
        b = (k - self.first) // self.step
        lo, hi = int(self.row_at[b]), int(self.row_at[b + 1])
        n, every = hi - lo, np.arange(hi - lo)
        common = dict(ids=torch.from_numpy(self.ids[lo:hi]))
        if self.sources is not None:
            common["sources"] = torch.from_numpy(self.sources[lo:hi])
        length = self.src.length[lo:hi]
        src = self.src.padded(b, lo, hi, int(round_width(int(length.max()) + 1, **fit)), 0, pad)
        src[every, length] = eos
        if kind == "classifier":
            labels = torch.from_numpy(self.labels[lo:hi])
            return Batch(**common, n_tokens=n, src=torch.from_numpy(src), labels=labels)
        length = self.tgt.length[lo:hi]
        width = int(round_width(int(length.max()) + 1, **fit))
        tgt_in = self.tgt.padded(b, lo, hi, width, 1, pad)
        tgt_in[:, 0] = bos
        # tgt_out is tgt_in one position on (bos + y -> y + eos): no second pass over the tokens.
        tgt_out = np.empty_like(tgt_in)
        tgt_out[:, :-1] = tgt_in[:, 1:]
        tgt_out[:, -1] = pad
        tgt_out[every, length] = eos
        tgt_out = torch.from_numpy(tgt_out)
        keep = target_positions(tgt_out, pad)
        return Batch(
            **common,
            n_tokens=int(length.sum()) + n,
            src=torch.from_numpy(src),
            tgt_in=torch.from_numpy(tgt_in),
            tgt_out=tgt_out,
            keep=keep,
        )


def read_rows(
    arrays: list[dict[str, np.ndarray]],
    local: np.ndarray,
    row_at: np.ndarray,
    which: np.ndarray | None = None,
    tags: list[int | None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None, Ragged, Ragged | None, np.ndarray | None]:
    """(ids, sources, src, tgt, labels) of the rows `local` of the caches `arrays`, batch by
    batch (batch b's rows begin at row_at[b]): row i is row local[i] of source which[i]
    (which=None: one cache, rows in their order). A source with a tag (tags[s], a token id)
    has it as its rows' first source token.

    Several sources: the rows are read source by source (a stable sort of `which`, then one
    gather per source and array) and handed back batch by batch, each batch's rows grouped by
    source in their order within it, so that they come back by whole blocks (_Blocks)."""
    if which is None:
        spans, blocks = [(0, 0, len(local))], None
    else:
        blocks = _Blocks(which, row_at, len(arrays))
        local = local[blocks.by_source]
        spans = blocks.spans

    def per_row(name: str) -> np.ndarray:
        out = np.empty(len(local), dtype=np.int64)
        for s, a, b in spans:
            out[a:b] = arrays[s][name][local[a:b]]
        return out if blocks is None else blocks.rows(out)

    side = dict(local=local, spans=spans, blocks=blocks, row_at=row_at)
    src = _read_side(arrays, "src", **side, tags=tags)
    tgt = _read_side(arrays, "tgt", **side) if "tgt_tokens" in arrays[0] else None
    labels = per_row("labels") if "labels" in arrays[0] else None
    sources = None if blocks is None else np.repeat(blocks.source, blocks.size)
    return per_row("ids"), sources, src, tgt, labels


class _Blocks:
    """A read of several sources' rows: sorted by source for the gathers (source order), then
    handed back by batch (batch order: batch by batch, each batch's rows grouped by source).
    A block, the rows of one batch from one source, is one stretch in both orders."""

    CONCATENATED = 512
    """Up to this many blocks, a side's tokens are put in batch order by copying each block's
    stretch (np.concatenate); past it (many sources), by one gather, whose cost is per token."""

    def __init__(self, which: np.ndarray, row_at: np.ndarray, n_sources: int):
        K, S = len(row_at) - 1, n_sources
        batch = np.repeat(np.arange(K), np.diff(row_at))
        size = np.bincount(batch * S + which, minlength=K * S)  # (batch, source) order
        self.by_source = np.argsort(which, kind="stable")  # rows in (source, batch) order
        per_source = size.reshape(K, S).sum(axis=0)
        cuts = np.concatenate(([0], np.cumsum(per_source)))
        self.spans = [(s, int(cuts[s]), int(cuts[s + 1])) for s in range(S) if per_source[s]]
        # The blocks that hold rows, in batch order: each one's source, batch, size, and
        # first row in source order and in batch order.
        kept = np.flatnonzero(size)
        self.source, self.batch, self.size = kept % S, kept // S, size[kept]
        by_source = size.reshape(K, S).T.ravel()
        in_sources = (np.cumsum(by_source) - by_source).reshape(S, K).T.ravel()
        self.first = in_sources[kept]
        in_batches = np.cumsum(self.size) - self.size
        # Where each row of source order goes in batch order: blocks in source order move by
        # (their first row in batch order - in source order).
        order = np.argsort(self.source, kind="stable")
        shift = (in_batches - self.first)[order]
        self.to_batches = np.arange(len(which)) + np.repeat(shift, self.size[order])
        self.n_batches = K

    def rows(self, values: np.ndarray) -> np.ndarray:
        """Per-row values of source order, in batch order."""
        out = np.empty_like(values)
        out[self.to_batches] = values
        return out

    def tokens(self, flat: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat, at): the rows' tokens (source order, rows ending at `ends`) in batch order,
        and where each batch's begin in them."""
        bounds = np.concatenate(([0], ends))
        lo, hi = bounds[self.first], bounds[self.first + self.size]
        per_batch = np.bincount(self.batch, weights=hi - lo, minlength=self.n_batches)
        at = np.concatenate(([0], np.cumsum(per_batch.astype(np.int64))))
        if len(lo) > self.CONCATENATED:
            return flat[ragged_index(lo, hi - lo)[0]], at
        return np.concatenate(list(map(flat.__getitem__, map(slice, lo.tolist(), hi.tolist())))), at


def _read_side(
    arrays: list[dict[str, np.ndarray]],
    side: str,
    local: np.ndarray,
    spans: list[tuple[int, int, int]],
    blocks: _Blocks | None,
    row_at: np.ndarray,
    tags: list[int | None] | None = None,
) -> Ragged:
    """One side's rows, read in source order (`spans`) and handed back in batch order."""
    start = np.empty(len(local), dtype=np.int64)
    end = np.empty(len(local), dtype=np.int64)
    tagged = [(s, a, b) for s, a, b in spans if tags and tags[s] is not None]
    for s, a, b in spans:
        offsets = arrays[s][f"{side}_offsets"]
        start[a:b], end[a:b] = offsets[local[a:b]], offsets[local[a:b] + 1]
    for _, a, b in tagged:  # one cell more, before the row, where its tag goes
        start[a:b] -= 1
    length = end - start
    cells, ends = ragged_index(start, length)
    # In the caches' own type (uint16 below 65,536 pieces): a quarter of int64's bytes to copy.
    kind = np.result_type(*(arrays[s][f"{side}_tokens"] for s, _, _ in spans))
    flat = np.empty(len(cells), dtype=kind)
    for s, a, b in spans:
        lo, hi = (int(ends[a - 1]) if a else 0), int(ends[b - 1])
        # A tagged source's first row may start at cell -1, which its tag then replaces.
        mode = "clip" if (s, a, b) in tagged else "raise"
        flat[lo:hi] = np.take(arrays[s][f"{side}_tokens"], cells[lo:hi], mode=mode)
    for s, a, b in tagged:
        flat[ends[a:b] - length[a:b]] = tags[s]
    if blocks is None:
        return Ragged(flat, length, np.concatenate(([0], ends))[row_at])
    flat, at = blocks.tokens(flat, ends)
    return Ragged(flat, blocks.rows(length), at)
