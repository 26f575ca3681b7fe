"""The training loop's view of a loader: the micro-batches of each optimizer step, up to
train.max_epochs.

A step whose batches reach the epoch limit is refused, and its batches go back to the loader:
a run resumed with a larger max_epochs then trains on them, like a run given that limit from
the start. Ranks cross an epoch boundary at different batches, so the loop refuses a step when
any rank has reached the limit (known from the plan on the token cache, `group_totals`; an
all-reduce of `past_limit` when streaming); `give_back` then restores each rank's position as
it was before the step.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiayn.data.batch import Batch
from aiayn.data.loader_protocol import Loader


class StepBatches:
    """Use as a context manager: leaving it stops the loader's read-ahead thread."""

    def __init__(self, loader: Loader, per_step: int, max_epochs: int | None):
        self.loader, self.per_step, self.max_epochs = loader, per_step, max_epochs
        self._batches: Iterator[Batch] | None = None
        self._before: dict | None = None
        self._rounds: list = []

    def __enter__(self) -> StepBatches:
        self._batches = iter(self.loader)
        return self

    def __exit__(self, *exc) -> None:
        self._batches.close()

    @property
    def limited(self) -> bool:
        return self.max_epochs is not None

    def next(self) -> list[tuple[Batch, int]]:
        """The next step's micro-batches, each with the epoch it belongs to."""
        # Only a limited run can refuse a step; the position is a few numbers (the streaming
        # loader's adds its source's small state), so keeping it costs nothing per step.
        self._before = self.loader.state_dict() if self.limited else None
        fetched, self._rounds = [], []
        for _ in range(self.per_step):
            fetched.append((next(self._batches), self.loader.epoch))
            self._rounds.append(self.loader.round)
        return fetched

    def group_totals(self) -> tuple[int, bool] | None:
        """The last step's target tokens on all ranks, and whether any rank's step reached
        train.max_epochs, where the loader plans every rank's batches (the token cache: each
        micro-batch's round); None where only each rank knows its own (streaming)."""
        if not self._rounds or any(r is None for r in self._rounds):
            return None
        last_epoch = self._rounds[-1][1]  # the epochs of a round grow: the last is the largest
        return sum(t for t, _ in self._rounds), self.limited and last_epoch >= self.max_epochs

    def past_limit(self) -> bool:
        """Whether this rank's last step reached train.max_epochs."""
        return self.limited and self.loader.epoch >= self.max_epochs

    def give_back(self) -> None:
        """Return the last step's batches: the loader continues from before them."""
        self.loader.load_state_dict(self._before)
