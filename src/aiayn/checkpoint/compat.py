"""The checkpoints of an earlier aiayn that a test pins (tests/fixtures/resume_v1): each older
form is turned into today's here, once, as it is read, so that no other module reads around it.

Pinned today, from the checkpoints of that fixture:
- every rank's RNG state in trainer.pt's "rng" list (today: rng.safetensors, each rank reading
  its own), and a manifest without the world size (the list's length is it);
- the data position of a token-cache run saved before caches were named by their content (the
  fingerprint named the cache by the digest of its whole manifest) and before `pad_to_multiple`
  was recorded. Any other older position is compared as it is, and refused where it differs,
  with the message saying what differs.
"""

from __future__ import annotations

import hashlib
import json

from aiayn.data.cache import TokenCache
from aiayn.runtime.durable import sha256_of


def world_size(manifest: dict, trainer_state: dict) -> int:
    """The world size a checkpoint was written at: its manifest's, or the number of RNG states
    in trainer.pt, where the manifest did not record it."""
    return manifest["world_size"] if "world_size" in manifest else len(trainer_state["rng"])


def rng_in_trainer_state(trainer_state: dict, rank: int) -> tuple[int, dict | None] | None:
    """(ranks saved, this rank's RNG state or None) from trainer.pt's list, where a checkpoint
    holds them there; None for one of today's (rng.safetensors)."""
    if "rng" not in trainer_state:
        return None
    states = trainer_state["rng"]
    return len(states), states[rank] if rank < len(states) else None


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
