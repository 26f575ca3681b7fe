"""Streaming sources -> tokenized, token-budget batches with an exact, resumable position."""

from aiayn.data.batch import Batch
from aiayn.data.loader import BatchLoader
from aiayn.data.sources import Source, open_split, sample_sentences

__all__ = ["Batch", "BatchLoader", "Source", "open_split", "sample_sentences"]
