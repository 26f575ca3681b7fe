"""Batch plans from lengths alone: which examples form each global batch of an epoch.

A plan needs no token: every rank computes the same plan from the cache's length index (a few
arrays of one integer per example), then reads only the rows of its own batches. The same
(seed, epoch) gives the same plan on every rank and every world size, which is what makes the
data position global.

Translation and classification (`pair_plan`): the epoch's examples are permuted whole, cut into
windows of `window` examples, each window sorted by width (stable: rows of one width keep their
shuffled order), cut into token-budget batches, and all the epoch's batches are shuffled
together. The whole-epoch permutation makes each window a sample of the whole corpus rather
than of one stretch of the file; the window bounds how alike a batch's lengths are.

Language modelling (`lm_plan`), two orders:
- documents: the non-empty documents, permuted whole, are joined by eos into one stream, cut
  into blocks of block_size tokens, `rows` blocks a batch, in order. For corpora of independent
  documents.
- stream: every line in corpus order (an empty one is a lone eos, so eos stands for the line
  break) is one running text, as in char-rnn, nanoGPT and the WikiText baselines. Each epoch
  starts it at a random offset below block_size, so block boundaries move from epoch to epoch,
  and the blocks are shuffled across the epoch, so a batch samples the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PLAN_VERSION = 1
"""Names the planning below in the plans kept beside a cache (data/plan_files.py): raise it with
any change that gives another plan for the same lengths, seed and epoch, or a rank reading an
older file would take other batches than a rank that plans for itself."""


@dataclass
class Plan:
    """The global batches of one epoch: batch k holds rows[bounds[j]:bounds[j + 1]], with
    j = order[k] (j = k when order is None). Shuffling batches through `order` rather than by
    gathering rows keeps one array of rows per plan."""

    rows: np.ndarray
    bounds: np.ndarray
    order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def batch(self, k: int) -> np.ndarray:
        j = k if self.order is None else int(self.order[k])
        return self.rows[self.bounds[j] : self.bounds[j + 1]]


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def budget_bounds(width: np.ndarray, max_tokens: int) -> np.ndarray:
    """Greedy cut of consecutive rows into batches with rows x widest row <= max_tokens.

    Returns the batch boundaries (0 first, len(width) last). A row wider than max_tokens alone
    still gets a batch of its own. One numpy call per batch, not per row: the cost of a batch
    of n rows, (n) x running max of the width, only grows with n.
    """
    bounds, start, n = [0], 0, len(width)
    while start < n:
        # A batch has at most max_tokens // width[start] rows: the running max is >= width[start].
        span = width[start : start + max(1, max_tokens // max(int(width[start]), 1)) + 1]
        cost = np.maximum.accumulate(span) * np.arange(1, len(span) + 1)
        start += max(1, int(np.searchsorted(cost, max_tokens, side="right")))
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)


def sorted_bounds(width: np.ndarray, window: int, max_tokens: int) -> np.ndarray:
    """budget_bounds for rows sorted by width within consecutive windows of `window` rows
    (batches never cross a window), without a numpy call per batch.

    In an ascending run, a batch ending at row e fits iff its start s >= g(e) = e + 1 -
    max(1, max_tokens // width[e]) (a row wider than the budget stands alone), and g increases
    with e. Clamped to the window's start it still never decreases, and rows of the next window
    have g above this window's rows: the batch from s ends at the last e with g(e) <= s.
    Whole windows are cut a group of about 2^20 rows at a time, so that the temporaries stay
    small however long the epoch.
    """
    n, bounds = len(width), [0]
    group = max(1, _GROUP_ROWS // window) * window
    for lo in range(0, n, group):
        g = _first_starts(width[lo : lo + group], window, max_tokens)
        s = 0
        while s < len(g):
            s = int(np.searchsorted(g, s, side="right"))
            bounds.append(lo + s)
    return np.asarray(bounds, dtype=np.int64)


_GROUP_ROWS = 1 << 20


def _first_starts(width: np.ndarray, window: int, max_tokens: int) -> np.ndarray:
    """g(e) of sorted_bounds for rows 0..len(width)-1 of whole windows. int64, because
    searchsorted on an int32 array with a Python int copies the array."""
    n = len(width)
    g = np.maximum(width, 1).astype(np.int64)
    np.floor_divide(max_tokens, g, out=g)
    np.maximum(g, 1, out=g)  # rows that fit in a batch ending here
    np.subtract(np.arange(1, n + 1), g, out=g)
    window_start = np.arange(n)
    window_start //= window
    window_start *= window
    np.maximum(g, window_start, out=g)
    return g


def _permuted(keep: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """rng.permutation(keep). numpy shuffles int64 faster than int32 for small arrays, and
    keep[permutation(n)] is the same permutation; for millions of rows the speeds meet, and
    shuffling a copy in place saves an int64 temporary the size of the epoch."""
    if len(keep) < _GROUP_ROWS:
        return keep[rng.permutation(len(keep))]
    rows = keep.copy()
    rng.shuffle(rows)
    return rows


def pair_plan(
    width: np.ndarray,
    keep: np.ndarray,
    max_tokens: int,
    window: int,
    rng: np.random.Generator | None,
) -> Plan:
    """Token-budget batches of the examples `keep` (indices), by `width` (tokens of a row).

    rng None keeps the given order (evaluation) and does not shuffle batches; window 0 does not
    sort by width either.
    """
    rows = keep.copy() if rng is None else _permuted(keep, rng)
    if not window:
        return Plan(rows, budget_bounds(width[rows], max_tokens))
    for lo in range(0, len(rows), window):
        part = rows[lo : lo + window]
        # uint16 keys take numpy's radix sort: linear in the window.
        key = np.minimum(width[part], np.iinfo(np.uint16).max).astype(np.uint16)
        part[:] = part[np.argsort(key, kind="stable")]
    bounds = sorted_bounds(width[rows], window, max_tokens)
    order = None if rng is None else rng.permutation(len(bounds) - 1)
    return Plan(rows, bounds, order)


@dataclass
class LmPlan:
    """One epoch of a language model: documents `docs` in this order, each followed by eos,
    form one stream of `total` tokens. Block b is stream[offset + b * size : ... + size] (the
    last block padded); batch k holds blocks order[k * rows : (k + 1) * rows] (consecutive
    blocks when order is None)."""

    docs: np.ndarray
    ends: np.ndarray  # cumulative stream length after each doc (eos included)
    total: int
    size: int
    rows: int
    offset: int = 0
    order: np.ndarray | None = None

    @property
    def n_blocks(self) -> int:
        return -(-(self.total - self.offset) // self.size)

    def __len__(self) -> int:
        return -(-self.n_blocks // self.rows)

    def blocks(self, k: int) -> np.ndarray:
        lo, hi = k * self.rows, min((k + 1) * self.rows, self.n_blocks)
        return np.arange(lo, hi) if self.order is None else self.order[lo:hi]


def lm_plan(
    doc_lengths: np.ndarray,
    block_size: int,
    rows: int,
    rng: np.random.Generator | None,
    order: str = "documents",
) -> LmPlan:
    if order == "stream":
        docs = np.arange(len(doc_lengths))
        offset = 0 if rng is None else int(rng.integers(block_size))
    else:
        docs = np.flatnonzero(doc_lengths > 0)  # an empty document has nothing to learn
        if rng is not None:
            docs = docs[rng.permutation(len(docs))]
        offset = 0
    ends = np.cumsum(doc_lengths[docs] + 1)
    total = int(ends[-1]) if len(docs) else 0
    if total - offset <= 1:
        total, offset = 0, 0
    if (total - offset) % block_size == 1:  # a last block of one token has no target: drop it
        total -= 1
    plan = LmPlan(docs, ends, total, block_size, max(1, rows), offset)
    if order == "stream" and rng is not None:
        plan.order = rng.permutation(plan.n_blocks)
    return plan
