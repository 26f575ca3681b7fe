"""The training loop's view of a loader: the micro-batches of each optimizer step, up to
train.max_epochs.

A step whose batches reach the epoch limit is refused, and its batches go back to the loader:
a run resumed with a larger max_epochs then trains on them, like a run given that limit from
the start. Ranks cross an epoch boundary at different batches, so the loop refuses a step when
any rank has reached the limit, which every rank knows from its rounds (data/loader.py: the
epoch of each round's last batch); `give_back` then restores the position as it was before the
step.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiayn.data.loader import Loader, Taken


class StepBatches:
    """Use as a context manager: leaving it stops the loader's read-ahead thread."""

    def __init__(self, loader: Loader, max_epochs: int | None):
        self.loader, self.max_epochs = loader, max_epochs
        self._taken: Iterator[Taken] | None = None
        self._before: dict | None = None
        self._last: list[Taken] = []

    def __enter__(self) -> StepBatches:
        self._taken = self.loader.taken()
        return self

    def __exit__(self, *exc) -> None:
        self._taken.close()

    def next(self) -> list[Taken]:
        """The next step's micro-batches on this rank (a round of the loader's), as taken."""
        # Only a limited run can refuse a step; the position is a few numbers (a stream's adds
        # its source's small state), so keeping it costs nothing per step.
        limited = self.max_epochs is not None
        self._before = self.loader.state_dict() if limited else None
        self._last = [next(self._taken)]
        while not self._last[-1].ends_round:
            self._last.append(next(self._taken))
        return self._last

    def group_totals(self) -> tuple[int, bool]:
        """The last step's target tokens on all ranks (its round's), and whether any rank's
        step reached train.max_epochs (the epochs of a round grow: its last is the largest)."""
        last = self._last[-1]
        return (
            last.round_targets,
            self.max_epochs is not None and last.round_epoch >= self.max_epochs,
        )

    def give_back(self) -> None:
        """Return the last step's batches: the loader continues from before them."""
        self.loader.load_state_dict(self._before)
