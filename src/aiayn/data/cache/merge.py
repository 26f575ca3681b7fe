"""Merging a build's parts into the token cache, on rank 0.

The parts are concatenated in corpus order, whatever the number of ranks that wrote them, so
the cache does not depend on it. Each array is written to a temporary file, flushed and renamed
into place, then the manifest (data/cache/format.py) last: it records each array's sha256 and
its ranges' (at least 1 MiB each, at most 1,024: each rank verifies its share of them at a
start), and every source file's sha256, taken by the rank that read the file (its byte ranges'
where the file was cut). The work directory goes once the manifest is written.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from aiayn.config import Config
from aiayn.data.cache.format import CACHE_VERSION, MANIFEST, TokenCache
from aiayn.data.cache.parts import part_name, read_text, shard_name, shard_part_name
from aiayn.errors import DataError
from aiayn.runtime.durable import fsync_path, sha256_of, write_atomic
from aiayn.runtime.verify_share import hashed_in_ranges

log = logging.getLogger(__name__)


def merge(work: Path, root: Path, built: list[dict], expected: dict, cfg: Config) -> None:
    """Concatenate the parts in corpus order into the cache's arrays, then write its manifest."""
    parts, offsets, invalid_utf8, hashes, ranges = _parts_in_order(work, built)
    if not parts:
        raise DataError(f"corpus {expected['split']} holds no records; check the data section")
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise DataError(f"the data preparation lost its parts {missing[:3]}; run it again")
    with np.load(parts[0]) as first:
        names = sorted(k for k in first.files if k != "empty")
        dtypes = {name: first[name].dtype for name in names}
    root.mkdir(parents=True, exist_ok=True)
    sizes, empty = _sizes(parts, names)
    files = {}
    for out_name, (name, dtype, size) in _outputs(names, dtypes, sizes).items():
        path = root / f"{out_name}.npy"
        _concatenate(path, parts, offsets, name, dtype, size)
        files[path.name] = hashed_in_ranges(path)  # ranges: each rank verifies its share
    counts = _counts(sizes, empty, invalid_utf8)
    manifest = {
        "version": CACHE_VERSION,
        "fingerprint": _with_hashes(json.loads((work / "build.json").read_text()), hashes, ranges),
        "filters": {
            "empty": "an lm keeps its empty lines"
            if cfg.model.kind == "lm"
            else "an example with an empty side is dropped",
            "not_utf8": f"data.on_invalid_utf8={cfg.data.on_invalid_utf8}",
            "too_long": "kept here; the batch plan drops examples longer than data.max_len",
        },
        "counts": counts,
        "files": files,
    }
    write_atomic(root / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    shutil.rmtree(work)


def _sizes(parts: list[Path], names: list[str]) -> tuple[dict[str, int], int]:
    """Each array's length in the cache, and the records the parts dropped as empty."""
    # From the small arrays alone: a side's token count is the sum of its lengths, so the
    # token arrays are read once, by the copy (_concatenate).
    sizes = {name: 0 for name in names}
    empty = 0
    for path in parts:
        with np.load(path) as part:
            for name in names:
                if not name.endswith("_tokens"):
                    sizes[name] += len(part[name])
            for side in (n.removesuffix("_lengths") for n in names if n.endswith("_lengths")):
                sizes[f"{side}_tokens"] += int(part[f"{side}_lengths"].sum())
            empty += int(part["empty"])
    return sizes, empty


def _outputs(names: list[str], dtypes: dict, sizes: dict[str, int]) -> dict[str, tuple]:
    """{cache array: (part array, dtype, length)}, in the order they are written."""
    outputs = {}
    for name in names:
        if name.endswith("_lengths"):  # stored as offsets: n + 1 entries
            side = name.removesuffix("_lengths")
            outputs[f"{side}_offsets"] = (name, np.int64, sizes[name] + 1)
        else:
            outputs[name] = (name, dtypes[name], sizes[name])
    return outputs


def _concatenate(
    path: Path, parts: list[Path], offsets: list[int], name: str, dtype, size: int
) -> None:
    """Array `name` of every part, one after another, as the cache's array at `path` (offsets,
    for lengths), written to a temporary file, synced and renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(size,))
    at, total = 0, 0
    to_offsets = path.stem.endswith("_offsets")
    if to_offsets:
        arr[0], at = 0, 1
    for p, offset in zip(parts, offsets, strict=True):
        with np.load(p) as part:
            chunk = part[name]
        if name == "ids":  # a shard's part counts its records from the shard's start
            chunk = chunk + offset
        if to_offsets:
            chunk = total + np.cumsum(chunk)
            total = int(chunk[-1]) if len(chunk) else total
        arr[at : at + len(chunk)] = chunk
        at += len(chunk)
    arr.flush()
    del arr
    fsync_path(tmp)
    os.replace(tmp, path)


def _counts(sizes: dict[str, int], empty: int, invalid_utf8: int) -> dict[str, int]:
    n = sizes["ids"]
    counts = {
        "records_read": n + empty,
        "examples": n,
        "dropped_empty": empty,
        "invalid_utf8_skipped": invalid_utf8,
    }
    for side in ("src", "tgt"):
        if f"{side}_tokens" in sizes:
            counts[f"{side}_tokens"] = sizes[f"{side}_tokens"]
    return counts


def _parts_in_order(work: Path, built: list[dict]) -> tuple[list[Path], list[int], int, dict, dict]:
    """The part files in corpus order, the record index each one's ids count from, the lines
    skipped as not UTF-8, and the source files' sha256 that the shards' readers took: whole
    files', and byte ranges' ([start, end, sha256] by file) where files were cut."""
    if "shards" not in built[0]:  # chunks of the whole stream, ids already global
        parts = [work / part_name(c) for c in range(built[0]["chunks"])]
        return parts, [0] * len(parts), built[0]["invalid_utf8"], built[0]["sha256"], {}
    parts, offsets, start, invalid, hashes, ranges = [], [], 0, 0, {}, {}
    for s in range(built[0]["shards"]):
        note = json.loads(read_text(work / shard_name(s)) or "null")
        if note is None:
            raise DataError(f"the data preparation lost shard {s}'s note; run it again")
        parts += [work / shard_part_name(s, k) for k in range(note["chunks"])]
        offsets += [start] * note["chunks"]
        start += note["records"]
        invalid += note["invalid_utf8"]
        hashes.update(note.get("sha256", {}))
        for path, piece in note.get("sha256_ranges", {}).items():
            ranges.setdefault(path, []).append(piece)
    return parts, offsets, invalid, hashes, ranges


def _with_hashes(stamp: dict, hashes: dict[str, str], ranges: dict[str, list]) -> dict:
    """The build's fingerprint with each source file's sha256: taken by the rank that checked
    the file (its shard's reader, or rank 0 where every rank read the whole stream), or its
    ranges' where it was cut (sha256 None), or hashed here (a tsv, jsonl or parquet file,
    which has no line check to take it in)."""
    for entry in stamp.get("files") or []:
        if entry["path"] in ranges:
            entry["sha256"], entry["sha256_ranges"] = None, ranges[entry["path"]]
        else:
            entry["sha256"] = hashes.get(entry["path"]) or sha256_of(Path(entry["path"]))
    return stamp


def log_built(cache: TokenCache, seconds: float, world_size: int, most_read: int) -> None:
    c = cache.counts()
    log.info(
        "token cache %s: %d examples of %d records (%d empty dropped, %d not UTF-8 skipped), "
        "%d source tokens, built in %.1f s by %d rank(s), the busiest reading %d records",
        cache.root,
        c["examples"],
        c["records_read"],
        c["dropped_empty"],
        c["invalid_utf8_skipped"],
        c["src_tokens"],
        seconds,
        world_size,
        most_read,
    )
