"""The checkpoints of an earlier aiayn that a test pins (tests/fixtures/resume_v1): each older
form is turned into today's here, once, as it is read, so that no other module reads around it.

Pinned today: the data position of a token-cache run saved before caches were named by their
content (the fingerprint named the cache by the digest of its whole manifest) and before
`pad_to_multiple` was recorded. Any other older position is compared as it is, and refused
where it differs, with the message saying what differs.
"""

from __future__ import annotations

import hashlib
import json

from aiayn.data.cache import TokenCache
from aiayn.runtime.durable import sha256_of


def data_state(state: dict, caches: list[TokenCache]) -> dict:
    """`state`, a saved data position, as today's loaders save it: `pad_to_multiple` 1 where it
    was not recorded, and a cache named by its manifest's digest renamed to its content's
    digest where it is one of `caches` (the run's token caches)."""
    fingerprint = dict(state.get("fingerprint", {}))
    if not fingerprint or "pad_to_multiple" in fingerprint:
        return state
    fingerprint["pad_to_multiple"] = 1
    named = fingerprint.get("cache")
    for cache in caches:
        if named not in (None, cache.digest) and named == _manifest_digest(cache):
            fingerprint["cache"] = cache.digest
    return {**state, "fingerprint": fingerprint}


def _manifest_digest(cache: TokenCache) -> str:
    """The name an earlier aiayn gave `cache`: the sha256 of its manifest as that aiayn wrote
    it, each array with its size and whole sha256 and no stored lengths (the arrays are read
    once, for a position saved so)."""
    files = {
        name: {"bytes": entry["bytes"], "sha256": sha256_of(cache.root / name)}
        for name, entry in cache.manifest["files"].items()
    }
    written = {k: v for k, v in cache.manifest.items() if k != "lengths"} | {"files": files}
    return hashlib.sha256(json.dumps(written, sort_keys=True).encode()).hexdigest()
