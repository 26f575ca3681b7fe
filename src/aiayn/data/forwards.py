"""A rank's units of a step fused into forwards (train.unit_tokens below train.max_tokens).

The plan deals a step's units to the ranks (data/loader.py); a rank runs its own in as few
forwards as train.max_tokens allows: its units of one segment sorted by width (stable), each
added to the forward before it while the forward's rows x its widest row stay within the
budget. Which units train in step k does not depend on this, only how a rank groups its own;
the loss divides by the step's targets on all ranks, so the update is the same (up to float
rounding) however they are grouped.

Every rank groups every rank's units of the step, so that all know the most forwards any rank
runs: a sharded engine (ZeRO-2/3, FSDP2) communicates in each forward or backward, and a rank
with fewer runs weight-0 repeats up to that count. That is a pass over the step's units (a
few integers each, no token), the same on every rank and without a collective.
"""

from __future__ import annotations

import numpy as np


def fuse(
    units: np.ndarray,
    owner: np.ndarray,
    rows: np.ndarray,
    width: np.ndarray,
    budget: int,
    me: int,
) -> tuple[dict[int, int], list[list[int]]]:
    """Units `units` of one segment, unit i dealt to rank owner[i], with rows[i] rows of padded
    width width[i]: (the forwards of each rank that has units, rank `me`'s forwards as lists of
    units)."""
    order = np.lexsort((width, owner))  # by rank, then by width; stable
    counts: dict[int, int] = {}
    mine: list[list[int]] = []
    last, held = -1, 0
    columns = (units[order], owner[order], rows[order], width[order])
    for unit, rank, r, w in zip(*(c.tolist() for c in columns), strict=True):
        if rank != last or (held + r) * w > budget:  # ascending widths: w is the widest
            counts[rank] = counts.get(rank, 0) + 1
            if rank == me:
                mine.append([])
            last, held = rank, 0
        held += r
        if rank == me:
            mine[-1].append(unit)
    return counts, mine


def widest_fused(seg, budget: int) -> np.ndarray:
    """The units of `seg` a forward of the widest ones holds: the widest first, then the next
    widest while the forward stays within `budget` (what the memory probe tries)."""
    units = np.arange(len(seg))
    rows, width = seg.shapes(units)
    order = np.argsort(-width, kind="stable")
    fits = np.cumsum(rows[order]) * int(width[order[0]]) <= budget  # True, then False
    return order[: max(1, int(fits.sum()))]
