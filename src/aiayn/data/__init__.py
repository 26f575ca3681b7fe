"""Sources -> tokenised cache (arrays + length index) -> global batch plan -> this rank's Batch,
or, without a cache, streamed sources tokenised as they are read. Positions are exact and
resumable either way."""

from aiayn.data.batch import Batch
from aiayn.data.cache import TokenCache
from aiayn.data.cache_build import ensure_cache
from aiayn.data.cached_loader import CachedLoader
from aiayn.data.loader import BatchLoader
from aiayn.data.make import make_loader
from aiayn.data.sources import Source, open_split, sample_sentences
from aiayn.data.steps import StepBatches

__all__ = [
    "Batch",
    "BatchLoader",
    "CachedLoader",
    "Source",
    "StepBatches",
    "TokenCache",
    "ensure_cache",
    "make_loader",
    "open_split",
    "sample_sentences",
]
