"""A segment: one planned stretch of a split, the unit the loader walks. A token cache's epoch
or a streamed chunk, each a table of rows (pad.py) with its plan (plan.py), where it starts
(`anchor`, as a saved position names it) and the cumulative target tokens of its batches.

Rows are numbered across the segment's sources: a mixture of caches numbers source s's rows
from base[s] on; a streamed chunk's rows are its own, each with its source (`source_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiayn.data.batch import Batch
from aiayn.data.pad import RowsRead, Specials, lm_batch, ragged_index, read_batches
from aiayn.data.plan import LmPlan, Plan


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

    def __len__(self) -> int:
        return len(self.plan)

    def read(self, ks: np.ndarray) -> RowsRead:
        """Global batches ks (equally spaced) of a pair plan, read and padded together."""
        plan = self.plan
        js = ks if plan.order is None else plan.order[ks]
        first, sizes = plan.bounds[js], plan.bounds[js + 1] - plan.bounds[js]
        cells, ends = ragged_index(first, sizes)
        rows = plan.rows[cells].astype(np.intp)
        which = None if self.source_of is None else self.source_of[rows]
        local = rows if self.base is None else rows - self.base[which]
        row_at = np.concatenate(([0], ends))
        arrays = read_batches(self.tables, local, row_at, self.special, which, self.tags)
        step = int(ks[1] - ks[0]) if len(ks) > 1 else 1
        return RowsRead(plan, int(ks[0]), step, len(ks), row_at, **arrays)

    def lm_batch(self, k: int) -> Batch:
        return lm_batch(self.tables[0], self.plan, k, self.special, self.first_id)


def batch_targets(plan: Plan | LmPlan, row_targets) -> np.ndarray:
    """Target tokens of each global batch of `plan` (Batch.n_tokens), in plan order.
    `row_targets(rows)`: each row's (eos included; 1 for a label); unused for blocks."""
    if isinstance(plan, LmPlan):  # a block's targets are its positions 1.. inside the stream
        starts = plan.offset + np.arange(plan.n_blocks, dtype=np.int64) * plan.size
        per_block = np.clip(plan.total - starts - 1, 0, plan.size - 1)
        blocks = per_block if plan.order is None else per_block[plan.order]
        if not len(blocks):
            return np.zeros(0, np.int64)
        return np.add.reduceat(blocks, np.arange(0, len(blocks), plan.rows))
    if not len(plan.rows):
        return np.zeros(0, np.int64)
    per_batch = np.add.reduceat(row_targets(plan.rows), plan.bounds[:-1])
    return per_batch if plan.order is None else per_batch[plan.order]


def target_sums(plan: Plan | LmPlan, row_targets) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(batch_targets(plan, row_targets))))
