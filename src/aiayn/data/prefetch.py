"""Produce an iterator's items in a background thread, a bounded number ahead."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

_END = object()

AHEAD = 2
"""Batches a loader makes ahead of the loop: one step's worth is ready while the one after it is
being made, and the memory held (a few padded batches) stays small."""
BATCH_THREAD = "aiayn-batches"  # the name of the thread that makes them


def prefetch(items: Iterator, depth: int = 1, name: str = "aiayn-data") -> Iterator:
    """Produce `items` in a thread, up to `depth` ahead, so that reading and tokenising overlap
    with the consumer's work: SentencePiece releases the GIL while it encodes.

    Order and content are those of `items`; only the timing changes. The thread is `name`.
    Leaving the loop early stops the thread at its next hand-over, and waits for it.
    """
    hand = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                hand.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)
        finally:
            # Stopped early: a generator's own clean-up (its inner prefetch's thread) runs now,
            # not whenever it is collected.
            if hasattr(items, "close"):
                items.close()

    reader = threading.Thread(target=produce, name=name, daemon=True)
    reader.start()
    try:
        while (item := hand.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # Wait for it: a daemon thread still inside SentencePiece or torch when the interpreter
        # exits is unwound through C++ and aborts the process ("terminate called without an
        # active exception"). It stops at its next hand-over, after at most one chunk.
        reader.join()
