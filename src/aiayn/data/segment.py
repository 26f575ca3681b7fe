"""A segment: one planned stretch of a split, the unit the loader walks. A token cache's epoch
or a streamed chunk, each a table of rows (pad.py) with its plan (plan.py), where it starts
(`anchor`, as a saved position names it) and the cumulative target tokens of its batches.

Rows are numbered across the segment's sources: a mixture of caches numbers source s's rows
from base[s] on; a streamed chunk's rows are its own, each with its source (`source_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiayn.data.batch import Batch, round_width
from aiayn.data.pad import RowsRead, Specials, lm_batch, ragged_index, read_batches
from aiayn.data.plan import LmPlan, Plan
from aiayn.data.position import Settings
from aiayn.errors import DataError


@dataclass
class Segment:
    anchor: dict
    epoch: int
    plan: Plan | LmPlan
    sums: np.ndarray  # cumulative target tokens of the global batches, 0 first
    tables: list[dict[str, np.ndarray]]  # a table per source (a chunk's: the same one)
    special: Specials
    tags: list[int | None] | None = None  # a tag's token id per source
    source_of: np.ndarray | None = None  # each row's source (a mixture)
    base: np.ndarray | None = None  # each source's first row (a mixture of caches)
    first_id: int = 0  # a language model's block ids start here
    width: np.ndarray | None = None  # each row's padded width (a pair plan's rows index it)
    _widest: np.ndarray | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.plan)

    def read(self, ks: np.ndarray) -> RowsRead:
        """Global batches ks (equally spaced) of a pair plan, read and padded together."""
        local, which, row_at = self._rows(ks)
        arrays = read_batches(self.tables, local, row_at, self.special, which, self.tags)
        step = int(ks[1] - ks[0]) if len(ks) > 1 else 1
        return RowsRead(self.plan, int(ks[0]), step, len(ks), row_at, **arrays)

    def fused(self, ks: np.ndarray) -> Batch:
        """Global batches ks as one batch: their rows (blocks) together, padded once."""
        if isinstance(self.plan, LmPlan):
            blocks = np.concatenate([self.plan.blocks(int(k)) for k in ks])
            return lm_batch(self.tables[0], self.plan, blocks, self.special, self.first_id)
        local, which, row_at = self._rows(ks)
        row_at = row_at[[0, -1]]
        arrays = read_batches(self.tables, local, row_at, self.special, which, self.tags)
        return RowsRead(None, 0, 1, 1, row_at, **arrays).batch(0)

    def lm_batch(self, k: int) -> Batch:
        blocks = self.plan.blocks(k)
        return lm_batch(self.tables[0], self.plan, blocks, self.special, self.first_id)

    def shapes(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, width) of global batches ks: their rows (blocks) and padded width, what a
        batch of several of them costs (loader.py fuses them)."""
        plan = self.plan
        if isinstance(plan, LmPlan):
            rows = np.minimum(plan.rows, plan.n_blocks - ks * plan.rows)
            return rows, np.full(len(ks), plan.size)
        if self._widest is None:  # each batch's widest row, computed once a segment
            self._widest = np.maximum.reduceat(self.width[plan.rows], plan.bounds[:-1])
        js = ks if plan.order is None else plan.order[ks]
        return plan.bounds[js + 1] - plan.bounds[js], self._widest[js]

    def _rows(self, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The rows of global batches ks of a pair plan, in their sources' numbering: (local
        row, source or None, where each batch's rows start)."""
        plan = self.plan
        js = ks if plan.order is None else plan.order[ks]
        first, sizes = plan.bounds[js], plan.bounds[js + 1] - plan.bounds[js]
        cells, ends = ragged_index(first, sizes)
        rows = plan.rows[cells].astype(np.intp)
        which = None if self.source_of is None else self.source_of[rows]
        local = rows if self.base is None else rows - self.base[which]
        return local, which, np.concatenate(([0], ends))


def specials(s: Settings) -> Specials:
    """What padding the rows of a source with these settings needs."""
    tok = s.tok
    return Specials(tok.pad_id, tok.bos_id, tok.eos_id, s.multiple, s.cfg.max_len + 1)


def row_widths(s: Settings, src_len: np.ndarray, tgt_len: np.ndarray | None, tagged=0):
    """(longest, width): each row's longest side, a tag counted (`tagged`: 1 where the row's
    source has one), and the width it is padded to. Every row gains one special token (eos,
    or bos for tgt_in), and the plan counts the padded width, so the token budget includes the
    rounding."""
    longest = src_len + tagged  # a new array, maximised in place
    if tgt_len is not None:
        np.maximum(longest, tgt_len, out=longest)
    return longest, round_width(longest + 1, s.multiple, s.cfg.max_len + 1)


def row_targets(tgt_lengths: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """int64 target tokens of each row as Batch.n_tokens counts them: its target and eos, or 1
    where there is no target side (a label)."""
    if tgt_lengths is None:
        return np.ones(len(rows), np.int64)
    return tgt_lengths[rows].astype(np.int64) + 1


def nothing_left(where: str, stats: dict[str, int], max_len: int) -> DataError:
    """A split that gives no batch at all: what was read, and what was dropped and why."""
    return DataError(
        f"{where} gives no batches: of {stats['examples_read']} examples read, "
        f"{stats['dropped_too_long']} are longer than data.max_len={max_len} tokens and "
        f"{stats['dropped_empty']} are empty; raise data.max_len or check the corpus"
    )


def batch_targets(plan: Plan | LmPlan, tgt_lengths: np.ndarray | None) -> np.ndarray:
    """Target tokens of each global batch of `plan` (Batch.n_tokens), in plan order, from the
    rows' target lengths (`row_targets`; unused for blocks)."""
    if isinstance(plan, LmPlan):  # a block's targets are its positions 1.. inside the stream
        starts = plan.offset + np.arange(plan.n_blocks, dtype=np.int64) * plan.size
        per_block = np.clip(plan.total - starts - 1, 0, plan.size - 1)
        blocks = per_block if plan.order is None else per_block[plan.order]
        if not len(blocks):
            return np.zeros(0, np.int64)
        return np.add.reduceat(blocks, np.arange(0, len(blocks), plan.rows))
    if not len(plan.rows):
        return np.zeros(0, np.int64)
    per_batch = np.add.reduceat(row_targets(tgt_lengths, plan.rows), plan.bounds[:-1])
    return per_batch if plan.order is None else per_batch[plan.order]


def target_sums(plan: Plan | LmPlan, tgt_lengths: np.ndarray | None) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(batch_targets(plan, tgt_lengths))))
