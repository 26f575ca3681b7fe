"""Sources -> tokenised cache (arrays + length index) -> global batch plan -> this rank's Batch,
or, without a cache, streamed sources tokenised as they are read. Positions are exact and
resumable either way.

    splits.py               a split of a corpus opened as a Source (source.py), checked: line
                            files (line_files.py) or records with fields (records.py)
    cache/                  the token cache: built once by the ranks together (cache/build.py),
                            verified when opened (cache/format.py)
    pad.py                  the one padder: rows of a cache's arrays, or of a streamed
                            chunk's in the same shape, into padded Batches
    plan.py                 the epoch's global batches, from the cache's lengths
    plan_files.py           each epoch's plan made by one rank of a node, read by the others
    loader_protocol.py      Loader: what every loader offers its callers; make.py picks one:
    cache_loader.py         this rank's Batch (batch.py) from one source's cache
    mixed_cache_loader.py   ... from the caches of a mixture's sources (data.sources)
    stream_loader.py        ... from one source, streamed and tokenised as it is read
    mixed_stream_loader.py  ... from a mixture's sources, streamed
    mixture.py              a mixture's sources, weights, tags and epochs (data.sources)
    position.py             the saved position in the data, and its checks on a resume
    steps.py                each optimizer step's micro-batches, up to train.max_epochs
    prefetch.py             the next batches read on a thread while the step runs
    run_splits.py           the run's own copies of its dev and test splits
    hub_revision.py         a Hub dataset pinned to the commit the first start read
    hub_copy.py             a Hub training split copied once to local parquet files
    prepare.py              the tokenizer and the token caches made ready before training
    demo.py                 the generated corpora of the demos and the tests
    corpora.py              the recipes' public corpora: files, pinned URLs, sha256, where
                            a recipe reads them (../shared/data or data/corpora)
    download.py             `aiayn data download`: those files fetched and checked
"""

from aiayn.data.batch import Batch
from aiayn.data.cache import TokenCache, ensure_cache
from aiayn.data.cache_loader import CacheLoader
from aiayn.data.loader_protocol import Loader
from aiayn.data.make import make_loader
from aiayn.data.mixed_cache_loader import MixedCacheLoader
from aiayn.data.mixed_stream_loader import MixedStreamLoader
from aiayn.data.splits import Source, open_split, sample_sentences
from aiayn.data.steps import StepBatches
from aiayn.data.stream_loader import StreamLoader

__all__ = [
    "Batch",
    "CacheLoader",
    "Loader",
    "MixedCacheLoader",
    "MixedStreamLoader",
    "Source",
    "StepBatches",
    "StreamLoader",
    "TokenCache",
    "ensure_cache",
    "make_loader",
    "open_split",
    "sample_sentences",
]
