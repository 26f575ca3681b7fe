"""Sources -> tokenised cache (arrays + length index) -> global batch plan -> this rank's Batch,
or, without a cache, streamed sources tokenised as they are read. Positions are exact and
resumable either way.

    sources.py        a split of a corpus opened as a Source (source.py), checked: line files
                      (line_files.py) or records with fields (records.py)
    cache/            the token cache: built once by the ranks together (cache/build.py),
                      verified when opened (cache/format.py), read in padded batches (rows.py)
    plan.py           the epoch's global batches, from the cache's lengths
    cached_loader.py  this rank's Batch (batch.py) from one cache; mixed_loader.py, a mixture's
    loader.py         this rank's Batch from a streamed source; mixed_stream.py, a mixture's
"""

from aiayn.data.batch import Batch
from aiayn.data.cache import TokenCache, ensure_cache
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
