"""The one loader: this rank's batches of a split, from any row source, resumable exactly.

A row source (cache_rows.py: a token cache's epochs; stream_rows.py: a stream's chunks; either
one source or a mixture's) hands out segments (segment.py), each planned whole. Every rank
walks the same global batches, segment after segment, in rounds: an optimizer step's
units (planned batches) when training (`per_round`), W (the world size) otherwise. Rank r takes the
round's batches r, r + W, ... and makes only those, a few read ahead together; where W does
not divide the round, ranks r < round % W take one more. A round's target tokens come from
the segments' cumulative sums, so the training loop learns the step's total over all ranks
without a collective, and that work does not grow with W. With `fuse_to` (training with
train.unit_tokens, forwards.py) a rank's batches of a round are fused into forwards of up to
that many tokens, and every rank knows the most forwards any rank runs in it.

Position: where the segment of the current round starts (its `anchor`: the epoch, and for a
stream the chunk and the reader's state) and the global batches the group has consumed from
there ("done", which may run past the segment's end). It is the group's, not the rank's, so a
checkpoint from N ranks resumes on M with the same global order; resuming plans (a stream:
reads and tokenises) from the anchor again and skips.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from aiayn.data.batch import Batch
from aiayn.data.forwards import fuse
from aiayn.data.pad import RowsRead, read_count
from aiayn.data.plan import LmPlan
from aiayn.data.position import check_loader_args, saved_position, saved_state
from aiayn.data.prefetch import AHEAD, BATCH_THREAD, prefetch
from aiayn.data.segment import Segment

STATE_VERSION = 1


@dataclass(frozen=True)
class Taken:
    """A batch as the training loop takes it: its epoch, its round's target tokens (the
    batches the ranks take together) and the epoch of the round's last batch, whether it is
    this rank's last of the round, and the most forwards a rank runs in the round."""

    batch: Batch
    epoch: int
    round_targets: int
    round_epoch: int
    ends_round: bool
    round_forwards: int


class Rows(Protocol):
    """A row source: segments and what a position saved over them means."""

    train: bool
    fingerprint: dict
    what: str  # what the data is, for messages

    def start(self) -> dict: ...
    def segments(self, anchor: dict) -> Iterator[Segment]: ...
    def stats(self) -> dict[str, int]: ...
    def largest_batches(self, anchor: dict, fuse_to: int | None) -> list[Batch]: ...
    def mixture_scalars(self, position: dict) -> dict[str, float]: ...


class Loader:
    """Batches of one split for one rank. `iter(loader)` gives batches, `taken()` the same
    with their epochs and rounds; each `for` continues where the last one stopped when
    training (epoch after epoch, forever), and starts a new pass otherwise, unless a state was
    just loaded. pin_memory=True hands out batches in page-locked memory (needs CUDA).
    per_round: the global batches of a round (an optimizer step's), at least W; None: W.
    fuse_to: fuse a rank's batches of a round into forwards of up to this many tokens (None:
    each batch is a forward)."""

    def __init__(
        self,
        rows: Rows,
        max_tokens: int,
        rank: int = 0,
        world_size: int = 1,
        pin_memory=False,
        per_round: int | None = None,
        fuse_to: int | None = None,
    ):
        check_loader_args(max_tokens, rank, world_size)
        self.rows, self.rank, self.world_size, self.pin_memory = rows, rank, world_size, pin_memory
        self.per_round = max(per_round or world_size, world_size)
        self.fuse_to = fuse_to
        self.train = rows.train
        self._pos = {**rows.start(), "done": 0}
        self._epoch = 0
        self._resume_pending = False
        self._batches = 0
        self._read_count = read_count(max_tokens)
        self._rows_read: RowsRead | None = None

    # ---- position ---------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the batch last handed out (of the position, after a load)."""
        return self._epoch

    def state_dict(self) -> dict:
        """The group's position (the same on every rank) with a fingerprint of what it means:
        plain values, as a checkpoint stores them."""
        return saved_state(STATE_VERSION, self.rows.fingerprint, self._pos)

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` at the next iteration; a DataError if it was saved for other
        data, batching or tokenizer."""
        fp = self.rows.fingerprint
        self._pos = saved_position(state, STATE_VERSION, fp, self.rows.what)
        self._epoch = self._pos["epoch"]
        self._resume_pending = True

    def stats(self) -> dict[str, int]:
        """What was read and dropped: examples_read, dropped_too_long, dropped_empty, batches,
        invalid_utf8_skipped."""
        read = self.rows.stats()
        return {
            "examples_read": read["examples_read"],
            "dropped_too_long": read["dropped_too_long"],
            "dropped_empty": read["dropped_empty"],
            "batches": self._batches,
            "invalid_utf8_skipped": read["invalid_utf8_skipped"],
        }

    def mixture_scalars(self) -> dict[str, float]:
        """What the group has taken of each source of a mixture, for TensorBoard ("data");
        empty for one source."""
        return self.rows.mixture_scalars(self._pos)

    def largest_batches(self) -> list[Batch]:
        """The batches that need the most memory, to try before training (fusing, forwards
        of the widest units fused up to the budget); the position does not move."""
        anchor = {k: v for k, v in self._pos.items() if k != "done"}
        return self.rows.largest_batches(anchor, self.fuse_to)

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        return (t.batch for t in self.taken())

    def taken(self) -> Iterator[Taken]:
        if not self.train and not self._resume_pending:
            self._pos = {**self.rows.start(), "done": 0}
        self._resume_pending = False
        # Made ahead in a thread; the position moves only when the loop takes a batch, so a
        # checkpoint never counts the batches still waiting in the queue.
        ahead = prefetch(self._rank_batches(self._pos), AHEAD, BATCH_THREAD)
        try:
            for taken, pos in ahead:
                self._pos, self._epoch = pos, taken.epoch
                self._batches += 1
                yield taken
        finally:
            ahead.close()
        if not self.train:
            self._pos = {**self.rows.start(), "done": 0}

    def _rank_batches(self, pos: dict) -> Iterator[tuple[Taken, dict]]:
        """This rank's batches from `pos` on, each with the group's position after its round.
        `held` keeps the segments from the round's first on (a round may cross into the next
        ones); `i` is the round's first batch in held[0]."""
        G, segments = self.per_round, self.rows.segments(pos)
        held: deque[Segment] = deque()
        i = pos["done"]
        try:
            while True:
                while not held or i >= len(held[0]):  # settle: the round's first batch
                    if held:
                        i -= len(held.popleft())
                    if not held and not _pull(segments, held):
                        return  # an evaluation pass is over
                targets, last_epoch, mine, most = self._round(held, i, segments)
                if not mine:  # an evaluation pass that ends inside a round, before this rank
                    return
                after = {**held[0].anchor, "done": i + G}  # the group's position
                for j, (seg, ks) in enumerate(mine):
                    if self.fuse_to is not None:
                        batch = seg.fused(np.asarray(ks))
                    elif isinstance(seg.plan, LmPlan):
                        batch = seg.lm_batch(ks[0])
                    else:
                        batch = self._batch(seg, ks[0])
                    batch = batch.pin_memory() if self.pin_memory else batch
                    ends = j == len(mine) - 1
                    yield Taken(batch, seg.epoch, targets, last_epoch, ends, most), after
                i += G
        finally:
            segments.close()

    def _round(self, held: deque, i: int, segments) -> tuple[int, int, list[tuple], int]:
        """The round of `per_round` global batches from batch i of held[0]: its target tokens,
        the epoch of its last batch, this rank's forwards as (segment, its batch indices), and
        the most forwards a rank runs in it. Fewer where an evaluation pass ends first (its
        last round may be short)."""
        left, targets, mine, at, n = self.per_round, 0, [], i, 0
        last, forwards = held[0].epoch, {}
        while left:
            if n == len(held) and not _pull(segments, held):
                break
            seg = held[n]
            take = min(left, len(seg) - at)
            targets += int(seg.sums[at + take] - seg.sums[at])
            first = self.per_round - left  # the round's index of this stretch's first batch
            if self.fuse_to is None:
                offset = (self.rank - first) % self.world_size  # this rank's first here
                mine += [(seg, [at + k]) for k in range(offset, take, self.world_size)]
            else:
                units = np.arange(at, at + take)
                owner = (first + np.arange(take)) % self.world_size
                counts, groups = fuse(units, owner, *seg.shapes(units), self.fuse_to, self.rank)
                for rank, count in counts.items():
                    forwards[rank] = forwards.get(rank, 0) + count
                mine += [(seg, ks) for ks in groups]
            left, at, n, last = left - take, 0, n + 1, seg.epoch
        if self.fuse_to is None:
            return targets, last, mine, -(-self.per_round // self.world_size)
        return targets, last, mine, max(forwards.values(), default=0)

    def _batch(self, seg: Segment, k: int) -> Batch:
        """Global batch k of a pair plan, from this rank's batches k, k + W, ... of the segment
        read together (a few, by read_count)."""
        read = self._rows_read
        if read is None or not read.holds(seg.plan, k):
            step = self.world_size
            ks = np.arange(k, min(len(seg), k + self._read_count * step), step)
            read = self._rows_read = seg.read(ks)
        return read.batch(k)


def _pull(segments: Iterator[Segment], held: deque) -> bool:
    segment = next(segments, None)
    if segment is not None:
        held.append(segment)
    return segment is not None
