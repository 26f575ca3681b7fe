"""The one padder: rows of token tables -> padded `Batch`es, for every loader.

A table is a token cache's arrays (`cache_arrays`: memory maps) or a streamed chunk's, tokenised
into arrays of the same shape in memory (`table`): flat token ids per side with offsets, the
lengths, ids and labels. Pairs (seq2seq, classifier) are padded by `read_batches` (and
`one_batch`), a language model's blocks by `lm_batch`. A mixture's tags are put here, before a
tagged source's source tokens, and nowhere else.

The loader hands out one batch at a time but pads several of a segment's together (about
READ_TOKENS padded tokens of them): numpy's fixed price per call, not the tokens, is most of a
small batch's cost, so each tensor of all those batches is laid out in one array, every token
put straight into its padded cell, and a batch is views of it. A mixture's rows are gathered
source by source and scattered into their cells the same way, a few calls per read, not per
batch. The read holds its batches' padded tensors (three int64 arrays of about READ_TOKENS),
so the memory held ahead stays small at any batch size.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from aiayn.data.batch import Batch, round_width, target_positions
from aiayn.data.cache.format import TokenCache
from aiayn.data.plan import LmPlan

READ_TOKENS = 2**17
"""Padded tokens of the batches read together: 32 batches of 4,096 tokens, 5 of 25,000, one
batch from 131,072 up."""
MOST_BATCHES = 64


def read_count(max_tokens: int) -> int:
    """How many of a rank's batches are read together at data.max_tokens (1 to MOST_BATCHES)."""
    return max(1, min(MOST_BATCHES, READ_TOKENS // max(max_tokens, 1)))


def cache_arrays(cache: TokenCache) -> dict[str, np.ndarray]:
    """Plain ndarray views of a cache's memory maps (no copy): np.memmap's indexing goes
    through a Python subclass on every call."""
    return {name: np.asarray(a) for name, a in vars(cache).items() if isinstance(a, np.ndarray)}


def table(
    src: list[list[int]], tgt: list[list[int]] | None, ids: np.ndarray, labels=None
) -> dict[str, np.ndarray]:
    """Rows tokenised in memory as a token cache's arrays (a streamed chunk's): each side's
    tokens back to back, their offsets and lengths; the rows' ids, and labels if given."""
    out = {"ids": ids}
    for side, rows in (("src", src), ("tgt", tgt)):
        if rows is None:
            continue
        length = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        total = int(length.sum())
        out[f"{side}_tokens"] = np.fromiter(itertools.chain.from_iterable(rows), np.int64, total)
        out[f"{side}_offsets"] = np.concatenate(([0], np.cumsum(length)))
        out[f"{side}_lengths"] = length.astype(np.int32)
    if labels is not None:
        out["labels"] = labels
    return out


def ragged_index(start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cells, ends): the cells start[i] .. start[i] + length[i] - 1 of every row, one row after
    another, and where each row ends in them."""
    ends = np.cumsum(length)
    total = int(ends[-1]) if len(ends) else 0
    return np.arange(total, dtype=np.int64) + np.repeat(start - (ends - length), length), ends


@dataclass
class Padded:
    """One tensor of every batch of a read, batch after batch: batch b's is
    cells[at[b]:at[b + 1]] as (rows, width[b])."""

    cells: np.ndarray
    at: np.ndarray
    width: np.ndarray

    def of(self, b: int) -> torch.Tensor:
        block = self.cells[int(self.at[b]) : int(self.at[b + 1])]
        return torch.from_numpy(block.reshape(-1, int(self.width[b])))


@dataclass
class RowsRead:
    """Batches first, first + step, ... (`count` of them) of one plan: batch b's rows are rows
    row_at[b] .. row_at[b + 1] - 1 of the per-row arrays; its target positions (Batch.keep) are
    keep[keep_at[b]:keep_at[b + 1]], counted from the start of the read's tgt_out cells."""

    plan: object
    first: int
    step: int
    count: int
    row_at: np.ndarray
    ids: np.ndarray
    sources: np.ndarray | None
    labels: np.ndarray | None
    src: Padded
    tgt_in: Padded | None = None
    tgt_out: Padded | None = None
    keep: np.ndarray | None = None
    keep_at: np.ndarray | None = None

    def holds(self, plan: object, k: int) -> bool:
        d = k - self.first
        return plan is self.plan and d >= 0 and d % self.step == 0 and d // self.step < self.count

    def batch(self, k: int) -> Batch:
        """Global batch k of the plan, as views of the read's arrays."""
        b = (k - self.first) // self.step
        lo, hi = int(self.row_at[b]), int(self.row_at[b + 1])
        common = dict(ids=torch.from_numpy(self.ids[lo:hi]), src=self.src.of(b))
        if self.sources is not None:
            common["sources"] = torch.from_numpy(self.sources[lo:hi])
        if self.tgt_in is None:
            return Batch(**common, n_tokens=hi - lo, labels=torch.from_numpy(self.labels[lo:hi]))
        a, z = int(self.keep_at[b]), int(self.keep_at[b + 1])
        keep = torch.from_numpy(self.keep[a:z] - self.tgt_in.at[b])
        tgt_in, tgt_out = self.tgt_in.of(b), self.tgt_out.of(b)
        return Batch(**common, n_tokens=z - a, tgt_in=tgt_in, tgt_out=tgt_out, keep=keep)


@dataclass
class Specials:
    """What padding needs to know: the special ids, and round_width's (multiple, limit)."""

    pad: int
    bos: int
    eos: int
    multiple: int
    limit: int


def read_batches(
    arrays: list[dict[str, np.ndarray]],
    local: np.ndarray,
    row_at: np.ndarray,
    special: Specials,
    which: np.ndarray | None = None,
    tags: list[int | None] | None = None,
) -> dict:
    """RowsRead's arrays (all but the plan and where the batches are in it) for the batches
    whose rows are `local` of the caches `arrays`, batch b's rows local[row_at[b]:row_at[b +
    1]]: row i is row local[i] of source which[i] (which=None: one cache, rows in their order).
    A source with a tag (tags[s], a token id) has it as its rows' first source token.

    src is rows + eos, tgt_in bos + rows, tgt_out rows + eos, each batch as wide as its widest
    row + 1, rounded by round_width(multiple, limit). Several sources: the rows are read source
    by source (a stable sort of `which`, then one gather per source and array), and their
    tokens scattered into their own rows' cells, so the rows stay in their order."""
    if which is None:
        spans, to_batches = [(0, 0, len(local))], None
    else:
        to_batches = np.argsort(which, kind="stable")  # source order: row j is row to_batches[j]
        local = local[to_batches]
        cuts = np.concatenate(([0], np.cumsum(np.bincount(which, minlength=len(arrays)))))
        spans = [(s, int(a), int(b)) for s, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a]

    def per_row(name: str) -> np.ndarray:
        out = np.empty(len(local), dtype=np.int64)
        for s, a, b in spans:
            out[a:b] = arrays[s][name][local[a:b]]
        return out if to_batches is None else _scattered(out, to_batches)

    side = dict(local=local, spans=spans, to_batches=to_batches, row_at=row_at, special=special)
    src, src_len, starts = _pad_side(arrays, "src", lead=0, tags=tags, **side)
    src.cells[starts + src_len] = special.eos
    out = dict(
        ids=per_row("ids"),
        sources=None if which is None else which.astype(np.int64),
        labels=per_row("labels") if "labels" in arrays[0] else None,
        src=src,
    )
    if "tgt_tokens" not in arrays[0]:
        return out
    tgt_in, tgt_len, starts = _pad_side(arrays, "tgt", lead=1, **side)
    tgt_in.cells[starts] = special.bos
    # tgt_out is tgt_in one cell on (bos + y -> y + eos): no second pass over the tokens. A
    # row's last cell would take the next row's bos: it is pad, or the row's eos.
    cells = np.empty_like(tgt_in.cells)
    cells[:-1] = tgt_in.cells[1:]
    cells[starts + np.repeat(tgt_in.width, np.diff(row_at)) - 1] = special.pad
    cells[starts + tgt_len] = special.eos
    # Batch.keep: the cells of each row's targets and eos, in row-major order.
    keep, ends = ragged_index(starts, tgt_len + 1)
    out.update(
        tgt_in=tgt_in,
        tgt_out=Padded(cells, tgt_in.at, tgt_in.width),
        keep=keep,
        keep_at=np.concatenate(([0], ends))[row_at],
    )
    return out


def one_batch(
    arrays: list[dict[str, np.ndarray]],
    local: np.ndarray,
    special: Specials,
    which: np.ndarray | None = None,
    tags: list[int | None] | None = None,
) -> Batch:
    """The batch of rows `local` (of source which[i] where given), as read_batches pads it."""
    row_at = np.array([0, len(local)])
    read = read_batches(arrays, local, row_at, special, which, tags)
    return RowsRead(None, 0, 1, 1, row_at, **read).batch(0)


def lm_batch(
    arrays: dict[str, np.ndarray],
    plan: LmPlan,
    blocks: np.ndarray,
    special: Specials,
    first_id: int = 0,
) -> Batch:
    """Blocks `blocks` of a language model's plan as a batch: stretches of the stream that
    joins the plan's documents (rows of `arrays`), each followed by eos; a block's id is
    first_id + its index."""
    pos = plan.offset + blocks[:, None] * plan.size + np.arange(plan.size)[None, :]
    inside = pos < plan.total
    j = np.minimum(np.searchsorted(plan.ends, pos, side="right"), len(plan.docs) - 1)
    doc = plan.docs[j]
    length = arrays["src_lengths"][doc]
    within = pos - (plan.ends[j] - length - 1)
    at_eos = within >= length
    # An empty document is a lone eos: its index is clamped to stay inside the array.
    inner = np.maximum(np.minimum(within, length - 1), 0)
    tokens = arrays["src_tokens"][arrays["src_offsets"][doc] + inner]
    out = np.where(at_eos, special.eos, tokens).astype(np.int64)
    out[~inside] = special.pad
    block = torch.from_numpy(out)
    tgt_out = block[:, 1:].contiguous()
    keep = target_positions(tgt_out, special.pad)
    ids = torch.from_numpy(first_id + blocks.astype(np.int64))
    tgt_in = block[:, :-1].contiguous()
    return Batch(ids=ids, n_tokens=len(keep), tgt_in=tgt_in, tgt_out=tgt_out, keep=keep)


def _pad_side(
    arrays: list[dict[str, np.ndarray]],
    side: str,
    local: np.ndarray,
    spans: list[tuple[int, int, int]],
    to_batches: np.ndarray | None,
    row_at: np.ndarray,
    special: Specials,
    lead: int,
    tags: list[int | None] | None = None,
) -> tuple[Padded, np.ndarray, np.ndarray]:
    """(padded, length, starts): one side's rows, read in source order (`spans`; rows of a
    tagged source one cell longer, the tag first), each put `lead` cells into its row of the
    padded batches. length and starts (each row's first cell) are per row, in batch order."""
    start = np.empty(len(local), dtype=np.int64)
    end = np.empty(len(local), dtype=np.int64)
    tagged = [(s, a, b) for s, a, b in spans if tags and tags[s] is not None]
    for s, a, b in spans:
        offsets = arrays[s][f"{side}_offsets"]
        start[a:b], end[a:b] = offsets[local[a:b]], offsets[local[a:b] + 1]
    for _, a, b in tagged:  # one cell more, before the row, where its tag goes
        start[a:b] -= 1
    length = end - start  # source order
    in_batches = length if to_batches is None else _scattered(length, to_batches)
    # Each batch is as wide as its widest row + 1 (eos, or bos); rows one after another.
    width = round_width(
        np.maximum.reduceat(in_batches, row_at[:-1]) + 1, special.multiple, special.limit
    )
    rows_per_batch = np.diff(row_at)
    row_width = np.repeat(width, rows_per_batch)
    starts = np.cumsum(row_width) - row_width  # batch order
    at = np.concatenate(([0], np.cumsum(width * rows_per_batch)))
    first = starts + lead if to_batches is None else starts[to_batches] + lead  # source order
    cells, ends = ragged_index(start, length)  # in the caches
    into = cells + np.repeat(first - start, length)  # in the padded batches
    padded = np.full(int(at[-1]), special.pad, dtype=np.int64)
    for s, a, b in spans:
        lo, hi = (int(ends[a - 1]) if a else 0), int(ends[b - 1])
        # A tagged source's first row may start at cell -1, which its tag then replaces.
        mode = "clip" if (s, a, b) in tagged else "raise"
        padded[into[lo:hi]] = np.take(arrays[s][f"{side}_tokens"], cells[lo:hi], mode=mode)
    for s, a, b in tagged:
        padded[first[a:b]] = tags[s]
    return Padded(padded, at, width), in_batches, starts


def _scattered(values: np.ndarray, to: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    out[to] = values
    return out
