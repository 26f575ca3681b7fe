"""The token cache: a split tokenised once into memory-mapped arrays with a length index.

format.py       what a cache is on disk (layout, manifest, fingerprint), and opening one
build.py        ensure_cache: building one, every rank at a time, in collective steps
shares.py       how the ranks share the reading, and each rank's share read and tokenised
line_ranges.py  byte ranges of line files: a share of fewer files than ranks
parts.py        a share's chunks tokenised into part files, in the build's work directory
merge.py        the parts merged in corpus order into the cache, every rank its own; the manifest
placed.py       where each part goes in the arrays, and a rank's parts written there
"""

from aiayn.data.cache.build import ensure_cache
from aiayn.data.cache.format import (
    CACHE_VERSION,
    MANIFEST,
    TokenCache,
    cache_dir,
    fingerprint,
    open_cache,
    prepare_command,
)

__all__ = [
    "CACHE_VERSION",
    "MANIFEST",
    "TokenCache",
    "cache_dir",
    "ensure_cache",
    "fingerprint",
    "open_cache",
    "prepare_command",
]
