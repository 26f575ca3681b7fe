"""What every loader offers, and all that its callers outside data/ use: the training loop
(train/loop.py, data/steps.py), the reports (train/report.py), the memory probe
(train/assemble.py) and the checkpoint manager (checkpoint/manager.py).

The four loaders, on two axes (data/make.py picks one):

                    one source                      a mixture (data.sources)
    streamed        StreamLoader                    MixedStreamLoader
                    (stream_loader.py)              (mixed_stream_loader.py)
    token cache     CacheLoader                     MixedCacheLoader
                    (cache_loader.py)               (mixed_cache_loader.py)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from aiayn.data.batch import Batch


@runtime_checkable
class Loader(Protocol):
    """This rank's batches of one split, resumable exactly."""

    epoch: int
    """The epoch of the batch last handed out (of the saved position, after a load)."""

    round: tuple[int, int] | None
    """For the batch last handed out: the target tokens of its round (the W global batches the
    ranks take together, one each) and the epoch of the round's last batch, where every rank
    plans every rank's batches (a token cache); None where each rank knows only its own (a
    stream), or before the first batch."""

    def __iter__(self) -> Iterator[Batch]:
        """This rank's batches from the position on: epoch after epoch when training, each
        `for` continuing where the last one stopped; one pass otherwise."""
        ...

    def state_dict(self) -> dict:
        """The group's position (the same on every rank) with a fingerprint of what it means:
        plain values, as a checkpoint stores them."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` at the next iter(); a DataError if it was saved for other
        data, batching or tokenizer."""
        ...

    def stats(self) -> dict[str, int]:
        """What was read and dropped: examples_read, dropped_too_long, dropped_empty, batches,
        invalid_utf8_skipped."""
        ...

    def largest_batches(self) -> list[Batch]:
        """The batches that need the most memory, to try before training; the position does
        not move."""
        ...

    def mixture_scalars(self) -> dict[str, float]:
        """What the group has taken of each source of a mixture, for TensorBoard ("data");
        empty for one source."""
        ...
