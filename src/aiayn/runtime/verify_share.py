"""Verifying a manifest's checksums on W ranks, each rank its share: what checkpoints and token
caches both do at a start.

A manifest's `files` map names to {"bytes", "sha256"} or, for a file written or read by byte
range, {"bytes", "sha256_ranges": [[start, end, hex], ...]}. Its pieces (ranges, or whole
files) are dealt out so that each rank hashes about 1/W of the bytes, and every rank computes
the same split from the same manifest, with no collective: a range written by rank r of W ranks
(as many ranges as ranks now) goes back to rank r, which reads it; a file `owner` names a rank
for (a DeepSpeed partition) goes to that rank; the rest to the rank with the fewest bytes so far,
largest pieces first. The caller sums the ranks' failures once, so that all ranks go on, or
fall back, together.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable
from pathlib import Path

from aiayn.runtime.durable import count_hashed, sha256_of

Piece = tuple[str, int, int, str]
"""A file's name, a byte range [start, end) of it, and that range's sha256."""

Owner = Callable[[str], "int | None"]
"""The rank that reads a file whole, by its name in the manifest, or None."""

_MIB = 1 << 20


def share_of(files: dict[str, dict], rank: int, world: int, owner: Owner | None = None) -> list:
    """This rank's pieces of `files` (a manifest's), in manifest order."""
    pinned: list[tuple[int, int, Piece]] = []
    free: list[tuple[int, Piece]] = []
    for i, (name, entry) in enumerate(files.items()):
        ranges = entry.get("sha256_ranges") or [[0, entry["bytes"], entry["sha256"]]]
        who = owner(name) if owner is not None else None
        if who is None and len(ranges) == world > 1:  # rank r wrote (and reads) range r
            pinned += [(i, r, (name, *piece)) for r, piece in enumerate(ranges)]
        elif who is None:
            free += [(i, (name, *piece)) for piece in ranges]
        else:
            pinned += [(i, who % world, (name, *piece)) for piece in ranges]
    load = [0] * world
    mine = [(i, p) for i, who, p in pinned if who == rank]
    for _, who, (_, a, b, _) in pinned:
        load[who] += b - a
    # Ties between ranks go first to a rank named by the manifest's checksums, not always to
    # rank 0: the checkpoint and the cache of one start then load different ranks.
    first = int(hashlib.sha256("".join(p[3] for _, p in free).encode()).hexdigest()[:8], 16)
    heap = [(n, (r - first) % world, r) for r, n in enumerate(load)]
    heapq.heapify(heap)
    # Largest first, ties in manifest order: the busiest rank ends at most one piece above 1/W.
    for i, piece in sorted(free, key=lambda item: (item[1][1] - item[1][2], item[0])):
        n, turn, r = heapq.heappop(heap)
        if r == rank:
            mine.append((i, piece))
        heapq.heappush(heap, (n + piece[2] - piece[1], turn, r))
    return [p for _, p in sorted(mine, key=lambda item: (item[0], item[1][1]))]


def verify_share(
    root: Path, files: dict[str, dict], rank: int, world: int, owner: Owner | None = None
) -> str | None:
    """Hash this rank's share of `files` (under `root`): None if it holds what the manifest
    records, else the first problem found (a file missing, of another size, a range whose
    sha256 differs, ranges that do not tile their file). Every piece is hashed even after a
    problem, so what a start hashes does not depend on where a file is damaged."""
    problem = None
    sizes: dict[str, int | None] = {}
    for name, a, b, digest in share_of(files, rank, world, owner):
        entry, path = files[name], root / name
        if name not in sizes:
            sizes[name] = path.stat().st_size if path.is_file() else None
            if sizes[name] != entry["bytes"]:
                found = "missing" if sizes[name] is None else f"{sizes[name]} bytes"
                problem = problem or f"{path} is {found}, the manifest says {entry['bytes']} bytes"
            elif not _tiles(entry):
                problem = problem or f"{path}: its manifest's ranges do not cover it"
        if sizes[name] == entry["bytes"] and sha256_of(path, a, b) != digest:
            what = path if (a, b) == (0, entry["bytes"]) else f"bytes {a:,}-{b:,} of {path}"
            problem = problem or f"{what}: its sha256 is not the manifest's (corrupt)"
    return problem


def _tiles(entry: dict) -> bool:
    ranges = entry.get("sha256_ranges")
    if ranges is None:
        return True
    ends = [0] + [b for _, b, _ in ranges]
    return [a for a, _, _ in ranges] == ends[:-1] and ends[-1] == entry["bytes"]


def hashed_in_ranges(path: Path, most: int = 1024, least: int = _MIB) -> dict:
    """A manifest entry for `path`: its size, sha256 and the sha256 of each of at most `most`
    ranges of at least `least` bytes (the last shorter), all in one read, so that W ranks can
    each verify 1/W of it at a start."""
    size = path.stat().st_size
    whole, ranges = hashlib.sha256(), []
    with open(path, "rb") as fh:
        for a, b in range_bounds(size, most, least):
            block = fh.read(b - a)
            whole.update(block)
            ranges.append([a, a + len(block), hashlib.sha256(block).hexdigest()])
            count_hashed(len(block))
    return {"bytes": size, "sha256": whole.hexdigest(), "sha256_ranges": ranges}


def range_bounds(size: int, most: int = 1024, least: int = _MIB) -> list[tuple[int, int]]:
    """The byte ranges [a, b) that a manifest records of a file of `size` bytes: at most
    `most`, of at least `least` bytes each (the last shorter). A file's bytes alone decide
    them, so every rank computes the same ones."""
    step = max(least, -(-size // most))
    return [(a, min(a + step, size)) for a in range(0, size, step)]
