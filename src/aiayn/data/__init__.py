"""Streaming sources -> tokenized, token-budget batches with an exact, resumable position."""

from aiayn.data.batch import Batch
from aiayn.data.loader import BatchLoader, make_loader
from aiayn.data.sources import Source, open_split, sample_sentences

__all__ = ["Batch", "BatchLoader", "Source", "make_loader", "open_split", "sample_sentences"]
