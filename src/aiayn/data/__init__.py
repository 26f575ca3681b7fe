"""Text -> tokens -> plan -> padded Batch, through one loader. The reference path, file by file:

    splits.py, source.py    a split of a corpus opened as a Source, checked, read by one reader
                            per format (line_files.py, records.py)
    pad.py                  tokens as a table: a token cache's arrays, or a streamed chunk's in
                            the same shape; rows of tables padded into a Batch (batch.py)
    plan.py                 which rows form each global batch: a cache's epoch or a chunk
    segment.py              a planned stretch (a table and its plan), the loader's unit
    loader.py               Loader: this rank's batches, rounds of a step's units (W when
                            not training), the saved position
    forwards.py             a rank's units of a step fused into forwards (train.unit_tokens)
    cache_rows.py           the row source of token caches: an epoch a segment
    stream_rows.py          the row source of a stream: a chunk a segment
                            (stream_mixture.py: which records a mixture's chunk takes)
    make.py                 which row source a config describes, and its Loader

What the reference path buys at scale, in modules named for it:

    cache/                  the token cache: built once by the ranks together, each its share
                            of the reading, writing and hashing (cache/build.py), verified
                            when opened (cache/format.py)
    plan_files.py           each epoch's plan made by one rank of a node, read by the others
    prefetch.py             the next batches made on a thread while the step runs
    position.py             the saved position's fingerprint, and its checks on a resume
    mixture.py              a mixture's sources, weights, tags and epochs (data.sources)
    steps.py                each optimizer step's forwards, up to train.max_epochs
    split_copies.py         the run's own copies of its dev and test splits
    hub_revision.py         a Hub dataset pinned to the commit the first start read
    hub_copy.py             a Hub training split copied once to local parquet files
    prepare.py              the tokenizer and the token caches made ready before training

The corpora themselves (the demos' generated ones, the recipes' public ones and their
download) are aiayn/corpora's.
"""

from aiayn.data.batch import Batch
from aiayn.data.cache import TokenCache, ensure_cache
from aiayn.data.loader import Loader, Taken
from aiayn.data.make import make_loader
from aiayn.data.splits import Source, open_split, sample_sentences
from aiayn.data.steps import StepBatches

__all__ = [
    "Batch",
    "Loader",
    "Source",
    "StepBatches",
    "Taken",
    "TokenCache",
    "ensure_cache",
    "make_loader",
    "open_split",
    "sample_sentences",
]
