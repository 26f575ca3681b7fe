"""How the ranks share building a token cache, and each rank's share read and tokenised.

A source of at least as many shards (files) as ranks is split by shard: rank r reads, checks
and tokenises shards r, r + W, ..., 1/W of the corpus. Plain line-aligned files, fewer than the
ranks, are cut into byte ranges (data/cache/line_ranges.py) and shared the same way. Otherwise
(a gzip file, a single jsonl, tsv or parquet file) every rank reads the whole stream and
tokenises chunks c with c mod W = r. A share is read in chunks of _CHUNK records, each written
as a part file (data/cache/parts.py); a shard or range already finished by an interrupted
build of the same fingerprint is not read again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from aiayn.config import Config
from aiayn.data.cache.line_ranges import LineFiles, Piece
from aiayn.data.cache.parts import (
    Tokenize,
    part_name,
    part_ok,
    read_text,
    shard_name,
    shard_part_name,
    tokenizing,
    write_part,
)
from aiayn.data.prefetch import prefetch
from aiayn.data.splits import Source, open_split
from aiayn.runtime.durable import sha256_of, write_atomic
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CHUNK = 16_384  # records per part: large enough that one encode call keeps every thread busy


@dataclass
class Share:
    """How the ranks share reading a source: by shard (its files, or a Hub repository's), by
    byte range (fewer plain line-aligned files than ranks), or not at all (every rank reads
    the whole stream and tokenises chunks c mod W: a gzip file, one jsonl file)."""

    source: Source
    rank: int
    world_size: int
    shards: int = 0
    lines: LineFiles | None = None
    pieces: list[Piece] = field(default_factory=list)
    scans: list[dict] = field(default_factory=list)

    @property
    def layout(self) -> str:
        if self.pieces:
            return json.dumps({"ranges": [[p.group, p.index, p.of] for p in self.pieces]})
        return json.dumps({"shards": self.shards} if self.shards else {"chunks": _CHUNK})

    def described(self) -> str:
        """What the ranks compare before they build: the layout's digest (not the layout, W
        ranges each, gathered on W ranks) and what it is."""
        digest = hashlib.sha256(self.layout.encode()).hexdigest()[:12]
        if self.pieces:
            return f"{len(self.lines.groups)} file(s) in {len(self.pieces)} byte ranges, {digest}"
        return f"{self.shards} shards, {digest}" if self.shards else f"the whole stream, {digest}"

    def mine(self, n: int) -> range:
        return range(self.rank, n, self.world_size)


def open_share(
    cfg: Config, split: str, rank: int, world_size: int, local: list[str] | None = None
) -> Share:
    """Open the source without checking it whole and decide how the ranks share it (`local`:
    a Hub split's local copy, data/hub_copy.py)."""
    spec = getattr(cfg.data, split)
    source = open_split(cfg.data, spec, cfg.model.kind, check=False, local=local)
    share = Share(source, rank, world_size)
    if world_size > 1:
        n_shards = source.num_shards()
        strict = cfg.data.on_invalid_utf8 == "error"
        if n_shards >= world_size:
            share.shards = n_shards
        elif (lines := LineFiles.of(source, cfg.data.format, strict)) is not None:
            share.lines, share.pieces = lines, lines.pieces(world_size)
        elif rank == 0:
            log.warning(
                "%s: %d file(s) for %d ranks, and they cannot be cut (gzip, or not line-aligned "
                "text): every rank reads all of it to build the token cache. Cut the corpus into "
                "at least %d files to share the reading (docs/data.md)",
                source.name,
                n_shards,
                world_size,
                world_size,
            )
    return share


def scan_ranges(share: Share, work: Path) -> dict[int, dict]:
    """Count the lines of this rank's byte ranges and hash them (a finished piece's note
    already holds its scan)."""
    scans = {}
    for s in share.mine(len(share.pieces)):
        note = json.loads(read_text(work / shard_name(s)) or "null")
        scans[s] = note["scan"] if note else share.lines.scan(share.pieces[s])
    return scans


def gather_scans(per_rank: list[dict[int, dict]]) -> list[dict]:
    merged = {s: scan for scans in per_rank for s, scan in scans.items()}
    return [merged[s] for s in range(len(merged))]


def build_parts(cfg: Config, tok: Tokenizer, share: Share, work: Path) -> dict:
    """Tokenise this rank's share into part files; return what the merge needs.

    Split by shard or by byte range, each rank checks and reads only its pieces, 1/W of the
    corpus. Otherwise every rank reads the whole stream and tokenises its chunks (c mod W).
    Either way the merge concatenates the same records in corpus order: the cache is the same
    for any W."""
    source = share.source
    with tokenizing(cfg.model.kind, tok) as tokenize:
        if share.pieces:
            share.lines.check_aligned(share.pieces, share.scans)
            return _build_shards(share, len(share.pieces), _read_range, tokenize, work)
        if share.shards:
            return _build_shards(share, share.shards, _read_shard, tokenize, work)
        hashes: dict[str, str] = {}
        # Whole: every rank reads it all; rank 0 hashes it as it reads (the merge's hashes).
        source.check(hashes if share.rank == 0 else None)
        n_chunks, read = 0, 0
        for c, before, records, size in prefetch(
            _my_chunks(source, share.rank, share.world_size, work)
        ):
            n_chunks, read = c + 1, read + size
            if records is None:  # another rank's chunk, or one a previous build finished
                continue
            write_part(work / part_name(c), tokenize(records, before))
    return {"chunks": n_chunks, "invalid_utf8": source.invalid_utf8, "read": read, "sha256": hashes}


Reader = Callable[["Share", int], tuple[Iterator[dict], Callable[[], dict]]]
"""A shard's records, and what its note records once they are read."""


def _read_shard(share: Share, s: int) -> tuple[Iterator[dict], Callable[[], dict]]:
    """Shard s of a source of shards: checked (alignment, UTF-8) and hashed first, in one read
    of line-aligned files."""
    hashes: dict[str, str] = {}
    skipped = share.source.check_shard(s, hashes)
    hashes = hashes or _shard_hashes(share.source, share.shards, s)
    records = share.source.shard_records(s)
    return records, lambda: {"invalid_utf8": skipped, "sha256": hashes}


def _read_range(share: Share, s: int) -> tuple[Iterator[dict], Callable[[], dict]]:
    """Piece s of a source cut by byte range: checked (UTF-8) as it is read, hashed by its
    scan."""
    skipped = [0]
    records = share.lines.records(s, share.pieces, share.scans, skipped)
    scan = share.scans[s]
    return records, lambda: {
        "invalid_utf8": skipped[0],
        "sha256_ranges": scan["sha256"],
        "scan": scan,
    }


def _build_shards(share: Share, n: int, reader: Reader, tokenize: Tokenize, work: Path) -> dict:
    """This rank's shards (s mod W), each in chunks of local ids, then a note of its size."""
    read = 0
    for s in share.mine(n):
        done = work / shard_name(s)
        if read_text(done) is not None:  # a previous build finished it
            continue
        records, finish = reader(share, s)
        n_chunks, count = 0, 0
        for k, before, block, _ in prefetch(_chunks(records)):
            write_part(work / shard_part_name(s, k), tokenize(block, before))
            n_chunks, count = k + 1, before + len(block)
        note = {"chunks": n_chunks, "records": count, **finish()}
        write_atomic(done, json.dumps(note).encode())  # last: marks the shard done
        read += count
    return {"shards": n, "read": read}


def _shard_hashes(source, n_shards: int, s: int) -> dict[str, str]:
    """sha256 of the files only shard s reads, by resolved path (the fingerprint's keys)."""
    if source.shard_files is None or len(source.shard_files) != n_shards:
        return {}  # not known which files the shard reads: the merge hashes them
    return {str(Path(f).resolve()): sha256_of(Path(f)) for f in source.shard_files[s]}


def _chunks(records: Iterator[dict]) -> Iterator:
    """(chunk index, records before it, normalised records, size) of one shard's records."""
    for k in itertools.count():
        block = list(itertools.islice(records, _CHUNK))
        if not block:
            return
        yield k, k * _CHUNK, block, len(block)


def _my_chunks(source, rank: int, world_size: int, work: Path) -> Iterator:
    """(chunk index, records before it, normalised records or None, size) for every chunk."""
    raw = source.raw()
    for c in itertools.count():
        block = list(itertools.islice(raw, _CHUNK))
        if not block:
            return
        todo = c % world_size == rank and not part_ok(work / part_name(c))
        yield c, c * _CHUNK, [source.normalize(r) for r in block] if todo else None, len(block)
