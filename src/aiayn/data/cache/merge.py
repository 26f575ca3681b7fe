"""Merging a build's parts into the token cache, every rank its own parts at known offsets.

The parts are placed in corpus order, whatever the number of ranks that wrote them, so the
cache does not depend on it (data/cache/placed.py says where each part goes). The merge is
collective, in steps that fail on every rank together: each rank measures its parts and the
ranks gather the counts; rank 0 creates each array's file at its final size; each rank writes
its parts' slices and syncs them, 1/W of the bytes; each rank hashes its share of each array's
ranges (at least 1 MiB each, at most 1,024: the same share it verifies at a start,
runtime/verify_share.py); rank 0 renames the arrays into place and writes the manifest
(data/cache/format.py) last, with the ranges' sha256 and every source file's sha256, taken by
the rank that read the file (its byte ranges' where the file was cut). The manifest records no
sha256 of a whole array: it would take one rank reading every byte, which is what the ranks
share. The work directory goes once the manifest is written.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from aiayn.config import Config
from aiayn.data.cache.format import CACHE_VERSION, MANIFEST, TokenCache
from aiayn.data.cache.placed import Layout, measure, preallocate, put_in_place, tmp_path, write_mine
from aiayn.errors import DataError
from aiayn.runtime.durable import sha256_of, size_text, write_atomic
from aiayn.runtime.verify_share import range_bounds, share_of

log = logging.getLogger(__name__)

Together = Callable[[Callable[[], object]], list]
"""Runs a step on every rank and returns its results in rank order, raising on every rank if it
failed on any (data/cache/build.py)."""


def merge(
    work: Path,
    root: Path,
    built: list[dict],
    expected: dict,
    cfg: Config,
    rank: int = 0,
    world: int = 1,
    together: Together | None = None,
) -> dict:
    """Every rank calls it: the parts written into the cache's arrays, then its manifest.
    Returns what each rank wrote and hashed ("written", "hashed": bytes by rank; "bytes": the
    arrays' total), for the build's log."""
    together = _storage_errors(together or (lambda step: [step()]), root)
    gathered = together(lambda: measure(work, built, rank, world))
    layout = Layout.of(gathered, "shards" in built[0], expected["split"])
    together(lambda: preallocate(root, layout) if rank == 0 else None)
    written = together(lambda: write_mine(work, root, layout, rank, world))
    hashed = together(lambda: _hash_mine(root, layout, rank, world))
    together(
        lambda: _finish(work, root, layout, hashed, built, expected, cfg) if rank == 0 else None
    )
    return {
        "written": written,
        "hashed": [n for _, n in hashed],
        "bytes": sum(o.nbytes for o in layout.outputs.values()),
    }


def _storage_errors(together: Together, root: Path) -> Together:
    """A step whose storage fails (a full disk, a lost mount) fails on every rank, with a
    message the user can act on: a rank that raised alone would leave the others waiting."""

    def run(step: Callable[[], object]) -> list:
        def guarded() -> object:
            try:
                return step()
            except OSError as exc:
                raise DataError(
                    f"writing the token cache {root} failed: {exc}. Free space there or set "
                    "data.cache_dir to storage every rank can write, then run the data "
                    "preparation again (its finished parts are kept)"
                ) from None

        return together(guarded)

    return run


def _placeholders(layout: Layout) -> dict[str, dict]:
    """The arrays as manifest entries whose ranges are not hashed yet: what share_of deals."""
    return {
        f"{name}.npy": {
            "bytes": out.nbytes,
            "sha256_ranges": [[a, b, ""] for a, b in range_bounds(out.nbytes)],
        }
        for name, out in layout.outputs.items()
    }


def _hash_mine(root: Path, layout: Layout, rank: int, world: int) -> tuple[dict, int]:
    """This rank's ranges of the written arrays and their sha256, and the bytes it hashed."""
    ranges: dict[str, list] = {}
    hashed = 0
    for name, a, b, _ in share_of(_placeholders(layout), rank, world):
        path = tmp_path(root, name.removesuffix(".npy"))
        ranges.setdefault(name, []).append([a, b, sha256_of(path, a, b)])
        hashed += b - a
    return ranges, hashed


def _finish(
    work: Path,
    root: Path,
    layout: Layout,
    hashed: list[tuple[dict, int]],
    built: list[dict],
    expected: dict,
    cfg: Config,
) -> None:
    """Rank 0: the arrays renamed into place, then the manifest, then the work directory gone."""
    files, lengths = {}, {}
    for name, entry in _placeholders(layout).items():
        ranges = sorted(r for by_rank, _ in hashed for r in by_rank.get(name, []))
        to = lengths if name.endswith("_lengths.npy") else files
        to[name] = {"bytes": entry["bytes"], "sha256_ranges": ranges}
    put_in_place(root, layout)
    invalid_utf8, hashes, ranges = _source_hashes(layout, built)
    empty = sum(u["empty"] for u in layout.units)
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
        "counts": _counts(layout.totals(), empty, invalid_utf8),
        "files": files,
        # Apart from `files`: derived from the offsets, so not part of the cache's digest.
        "lengths": lengths,
    }
    write_atomic(root / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    shutil.rmtree(work)


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


def _source_hashes(layout: Layout, built: list[dict]) -> tuple[int, dict, dict]:
    """The lines skipped as not UTF-8, and the source files' sha256 that the readers took:
    whole files', and byte ranges' ([start, end, sha256] by file) where files were cut."""
    if not layout.shards:  # chunks of the whole stream: rank 0 read and hashed it all
        return built[0]["invalid_utf8"], built[0]["sha256"], {}
    invalid, hashes, ranges = 0, {}, {}
    for unit in layout.units:  # in corpus order
        invalid += unit["invalid_utf8"]
        hashes.update(unit["sha256"])
        for path, piece in (unit["sha256_ranges"] or {}).items():
            ranges.setdefault(path, []).append(piece)
    return invalid, hashes, ranges


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


def log_built(
    cache: TokenCache, seconds: float, world_size: int, most_read: int, merged: dict
) -> None:
    c = cache.counts()
    log.info(
        "token cache %s: %d examples of %d records (%d empty dropped, %d not UTF-8 skipped), "
        "%d source tokens, built in %.1f s by %d rank(s), the busiest reading %d records; "
        "merged at known offsets: rank 0 wrote %d and hashed %d of the %d bytes (%s), the "
        "busiest wrote %d and hashed %d",
        cache.root,
        c["examples"],
        c["records_read"],
        c["dropped_empty"],
        c["invalid_utf8_skipped"],
        c["src_tokens"],
        seconds,
        world_size,
        most_read,
        merged["written"][0],
        merged["hashed"][0],
        merged["bytes"],
        size_text(merged["bytes"]),
        max(merged["written"]),
        max(merged["hashed"]),
    )
