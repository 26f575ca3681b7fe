"""What a token cache is on disk, and opening one: a split tokenised once into memory-mapped
arrays with a length index.

Layout of `<data.cache_dir>/<split>/` (fairseq's and Megatron's design: flat token arrays and
offsets, read with numpy memory maps):

    manifest.json       written last: a cache without it is never read
    src_tokens.npy      every example's source (or text) token ids, back to back (uint16/uint32)
    src_offsets.npy     int64, n + 1: example i is src_tokens[src_offsets[i]:src_offsets[i + 1]]
    tgt_tokens.npy      tgt_offsets.npy   (seq2seq)
    labels.npy          int64 (classifier)
    ids.npy             int64: the example's index in the stream, for audits
    src_lengths.npy     int32, n: example i's tokens, the offsets' differences stored so that a
    tgt_lengths.npy     start plans without reading the offsets

The manifest holds the fingerprint of what the cache was built from (source files with their
sizes and sha256, or their byte ranges' sha256 where ranks shared a file by range; format,
fields, the tokenizer's sha256), the counts of what was read and dropped and why, and each
array's size and its ranges' sha256. Opening checks all of it: a cache built from other data or
another tokenizer is refused with the differing fields named, and a truncated or altered array
is refused before training reads it.

Building one is data/cache/build.py's; padding batches out of one, data/pad.py's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiayn.config import Config
from aiayn.data.splits import read_fields, source_files
from aiayn.errors import DataError
from aiayn.runtime.durable import checksums_match, sha256_of, write_atomic
from aiayn.runtime.verify_share import verify_share
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 1
MANIFEST = "manifest.json"


def cache_dir(cfg: Config, split: str) -> Path:
    """Where the cache of `split` (train, valid or test) lives. Environment variables in
    data.cache_dir are this node's: a node-local disk is often named by one ($SLURM_TMPDIR)."""
    if not cfg.data.cache_dir:
        return Path(cfg.run_dir) / "data_cache" / split
    root = os.path.expandvars(cfg.data.cache_dir)
    if "$" in root:
        raise DataError(
            f"data.cache_dir {cfg.data.cache_dir} names an environment variable that is not set "
            f"here ({root}): set it on every node, or give a path"
        )
    return Path(root).expanduser() / split


def prepare_command(cfg_path: str = "FILE") -> str:
    return f"`aiayn data prepare --config {cfg_path} --force`"


# ---- the cache as training reads it --------------------------------------------------------


@dataclass
class TokenCache:
    """An opened, verified cache: memory maps of its arrays and its manifest."""

    root: Path
    manifest: dict
    src_tokens: np.ndarray
    src_offsets: np.ndarray
    ids: np.ndarray
    tgt_tokens: np.ndarray | None = None
    tgt_offsets: np.ndarray | None = None
    labels: np.ndarray | None = None
    src_lengths: np.ndarray | None = None
    tgt_lengths: np.ndarray | None = None

    def lengths(self, side: str) -> np.ndarray | None:
        """int32 tokens of each example on `side` (src or tgt; None where the cache has no
        such side), memory-mapped."""
        return getattr(self, f"{side}_lengths")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def kind(self) -> str:
        return self.manifest["fingerprint"]["kind"]

    @property
    def digest(self) -> str:
        """Identifies the cache's content: every array's size and its ranges' sha256. The same
        tokens give the same digest wherever the corpus lies (a job that stages its data to a
        local disk under another path resumes), and a cache rebuilt from changed text another."""
        files = self.manifest["files"]
        return _arrays_digest(files, {k: _ranges_sha256(f) for k, f in files.items()})

    def counts(self) -> dict[str, int]:
        return dict(self.manifest["counts"])


def open_cache(
    root: Path, expected: dict | None, verify: bool = True, rank: int = 0, world: int = 1
) -> TokenCache:
    """Open the cache at root, refusing one that does not fit `expected` or is damaged.

    expected=None skips the comparison, for a rank that another rank has compared for (a
    start: data/cache/build.py). An `expected` whose corpus files are gone (None) compares
    everything else: once built, the cache stands for its corpus, and a run whose corpus was
    moved away resumes from it. A corpus file whose modification time changed but whose
    content did not has its new time recorded, so that the next start does not hash it again.
    `verify` hashes this rank's share of the arrays, 1/`world` of them
    (runtime/verify_share.py): the ranks' verdicts are to be combined by the caller."""
    manifest = _read_manifest(root)
    if manifest.get("version") != CACHE_VERSION or "lengths" not in manifest:
        raise DataError(
            f"token cache {root} was built by another aiayn (format version "
            f"{manifest.get('version')}{'' if 'lengths' in manifest else ', no stored lengths'}), "
            f"this code reads version {CACHE_VERSION}; rebuild it with {prepare_command()}"
        )
    diffs = [] if expected is None else _fingerprint_diffs(manifest["fingerprint"], expected)
    if expected is not None and not diffs:
        _record_new_times(root, manifest)
    if expected is not None and expected.get("files", []) is None:
        log.info(
            "token cache %s: its corpus is no longer where it was built from (%s); training "
            "from the cache as built",
            root,
            ", ".join(f["path"] for f in manifest["fingerprint"].get("files", [])[:3]),
        )
    if diffs:
        raise DataError(
            f"token cache {root} was built from other data or another tokenizer:\n"
            + "\n".join(f"  - {d}" for d in diffs)
            + f"\nRebuild it with {prepare_command()}, or set data.cache_dir to another directory"
        )
    files = {**manifest["files"], **manifest["lengths"]}
    if verify and (problem := verify_share(root, files, rank, world)):
        raise _damaged(root, problem)
    arrays = {}
    for name, meta in files.items():
        path = root / name
        size = path.stat().st_size if path.is_file() else None
        if size != meta["bytes"]:
            found = "missing" if size is None else f"{size} bytes"
            raise _damaged(root, f"{name} is {found}, the manifest says {meta['bytes']} bytes")
        # A plain ndarray view of the map: np.memmap's indexing runs Python code on every
        # call, several times per batch (benchmarks/README.md).
        arrays[name.removesuffix(".npy")] = np.load(path, mmap_mode="r").view(np.ndarray)
    cache = TokenCache(root, manifest, **arrays)
    _check_index(cache)
    return cache


def _arrays_digest(files: dict[str, dict], sha256: dict[str, str]) -> str:
    """The digest of arrays of these sizes (`files`, a manifest's) and sha256."""
    arrays = {k: {"bytes": f["bytes"], "sha256": sha256[k]} for k, f in files.items()}
    return hashlib.sha256(json.dumps(arrays, sort_keys=True).encode()).hexdigest()


def _ranges_sha256(entry: dict) -> str:
    """One sha256 for a file recorded by its ranges' alone."""
    ranges = "".join(f"{a}:{b}:{h}\n" for a, b, h in entry["sha256_ranges"])
    return hashlib.sha256(ranges.encode()).hexdigest()


def _damaged(root: Path, what: str) -> DataError:
    return DataError(
        f"token cache {root} is damaged: {what}. Nothing was read from it; rebuild it with "
        f"{prepare_command()}"
    )


def _read_manifest(root: Path) -> dict:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"token cache {root} has no readable manifest ({exc}); rebuild it with "
            f"{prepare_command()}"
        ) from None


def _check_index(cache: TokenCache) -> None:
    """Offsets that point outside their arrays would read other examples' tokens."""
    n = len(cache)
    sides = [("src", cache.src_tokens, cache.src_offsets)]
    if cache.tgt_tokens is not None:
        sides.append(("tgt", cache.tgt_tokens, cache.tgt_offsets))
    for side, tokens, offsets in sides:
        if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
            raise _damaged(cache.root, f"{side}_offsets does not index {side}_tokens")
    if cache.labels is not None and len(cache.labels) != n:
        raise _damaged(cache.root, "labels and ids have different lengths")
    for side in ("src", "tgt"):
        stored = getattr(cache, f"{side}_lengths")
        if stored is not None and len(stored) != n:
            raise _damaged(cache.root, f"{side}_lengths and ids have different lengths")


def _record_new_times(root: Path, manifest: dict) -> None:
    """Write the manifest again if _file_diffs found corpus files touched but unchanged."""
    touched = [f for f in manifest["fingerprint"].get("files") or [] if f.pop("touched", False)]
    if touched:
        write_atomic(root / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        log.info(
            "token cache %s: %d corpus file(s) modified but with the same content (%s): their "
            "new modification times recorded",
            root,
            len(touched),
            ", ".join(f["path"] for f in touched[:3]),
        )


def _fingerprint_diffs(saved: dict, expected: dict) -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(expected)):
        if key == "files":
            if expected.get("files") is None:  # the corpus is gone: the cache stands for it
                continue
            diffs += _file_diffs(saved.get("files", []), expected.get("files", []))
        elif saved.get(key) != expected.get(key):
            diffs.append(f"{key}: cache {saved.get(key)!r}, now {expected.get(key)!r}")
    return diffs


def _file_diffs(saved: list[dict], now: list[dict]) -> list[str]:
    if [f["path"] for f in saved] != [f["path"] for f in now]:
        return [f"files: cache {[f['path'] for f in saved]}, now {[f['path'] for f in now]}"]
    diffs = []
    for old, new in zip(saved, now, strict=True):
        if old["bytes"] != new["bytes"]:
            diffs.append(f"{new['path']}: cache {old['bytes']} bytes, now {new['bytes']} bytes")
        elif old["mtime_ns"] != new["mtime_ns"]:
            # Only a changed modification time costs a hash: a copy or `touch` is not a change,
            # and its time is recorded (open_cache), to cost it once.
            if not checksums_match(Path(new["path"]), old):
                diffs.append(f"{new['path']}: its content changed since the cache was built")
            else:
                old["mtime_ns"], old["touched"] = new["mtime_ns"], True
    return diffs


def fingerprint(cfg: Config, split: str, tok: Tokenizer, hashes: bool = False) -> dict:
    """What the cache of `split` depends on. hashes=False leaves the files' sha256 out (opening
    compares sizes and modification times first)."""
    data, kind = cfg.data, cfg.model.kind
    spec = getattr(data, split)
    out = {
        "kind": kind,
        "format": data.format,
        "split": spec,
        "fields": read_fields(data, kind),
        "on_invalid_utf8": data.on_invalid_utf8,
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
    }
    if data.format == "hub":
        out["hub"] = {"name": data.hub_name, "config": data.hub_config}
        if data.hub_revision:  # a Hub dataset pinned to a commit (data/hub_revision.py)
            out["hub"]["revision"] = data.hub_revision
        return out
    try:
        files = source_files(data, spec)
    except DataError:  # the corpus is gone (moved, or staged away): None, checked by the caller
        files = None
    out["files"] = None if files is None else [_file_entry(Path(p), hashes) for p in files]
    return out


def _file_entry(path: Path, with_hash: bool) -> dict:
    st = path.stat()
    entry = {"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    entry["sha256"] = sha256_of(path) if with_hash else None
    return entry
