"""Building a token cache (data/cache.py) once, on every rank at a time.

Building streams the source through `datasets` in chunks of _CHUNK records, tokenised in
pieces over a pool of threads (SentencePiece's encode releases the GIL, so one process uses
every core it is given), each written as a part file, atomically. A source of at least as many
shards (files) as ranks is split by shard: rank r reads, checks and tokenises shards r, r + W,
..., 1/W of the corpus. Plain line-aligned files, fewer than the ranks, are cut into byte
ranges (data/line_ranges.py) and shared the same way. Otherwise (a gzip file, a single jsonl,
tsv or parquet file) every rank reads the whole stream and tokenises chunks c with
c mod W = r. Rank 0 then concatenates the parts in corpus order: the cache does not depend on
the number of ranks. An interrupted build keeps its finished parts (and shards) in
`<split>.partial/` and the next build reuses them if they were made from the same fingerprint.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aiayn.config import Config
from aiayn.data.cache import (
    CACHE_VERSION,
    MANIFEST,
    TokenCache,
    cache_dir,
    fingerprint,
    open_cache,
)
from aiayn.data.line_ranges import LineFiles, Piece
from aiayn.data.prefetch import prefetch
from aiayn.data.sources import Source, open_split
from aiayn.errors import AiaynError, DataError
from aiayn.files import fsync_path, sha256_of, write_atomic
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CHUNK = 16_384  # records per part: large enough that one encode call keeps every thread busy

Sync = Callable[[object], list]
"""Every rank calls it with a value and gets every rank's value, in rank order (DistEnv.gather)."""


def ensure_cache(
    cfg: Config,
    split: str,
    tok: Tokenizer,
    *,
    rank: int = 0,
    world_size: int = 1,
    sync: Sync | None = None,
    rebuild: bool = False,
    folder: str | None = None,
) -> TokenCache:
    """Open the cache of `split`, building it first if it is missing (or if rebuild). It
    lives in the folder `folder` of the cache directory (default: the split's name; a source of
    a mixture has its own, mixture.cache_folder).

    Every rank calls it; the ranks share the tokenising and rank 0 writes the result. An
    existing cache that does not fit the config is refused, never silently replaced. Rank 0
    alone verifies an existing cache's checksums (every rank hashing every array would read
    the cache once per rank); the others check its manifest and sizes, and all stop together
    if any rank finds it wrong.
    """
    sync = sync or (lambda value: [value])
    root = cache_dir(cfg, folder or split)
    work = root.parent / f"{root.name}.partial"
    if not rebuild and sync((root / MANIFEST).is_file())[0]:  # as rank 0 sees it, for all
        # Rank 0 compares the corpus (file sizes and times) and verifies for all.
        opened: list[TokenCache] = []
        _all_ok(
            sync,
            lambda: opened.append(
                open_cache(root, fingerprint(cfg, split, tok), verify=True)
                if rank == 0
                else open_cache(root, None, verify=False)
            ),
        )
        if rank == 0 and work.is_dir():  # killed after the manifest, before the clean-up
            shutil.rmtree(work, ignore_errors=True)
        return opened[0]
    expected = fingerprint(cfg, split, tok)
    started = time.perf_counter()
    shares: list[_Share] = []
    layouts = _all_ok(sync, lambda: _open_share(cfg, split, rank, world_size, shares))
    if len(set(layouts)) > 1:  # the ranks would go different ways and wait for each other
        raise DataError(
            f"the ranks see different corpus files for {split} (rank 0 would read {layouts[0]}, "
            f"rank {next(r for r, x in enumerate(layouts) if x != layouts[0])} "
            f"{next(x for x in layouts if x != layouts[0])}): every rank must see the same "
            "corpus: put it on storage all nodes share"
        )
    share = shares[0]
    _all_ok(
        sync,
        lambda: _start_build(cfg, split, tok, root, work, rebuild, share) if rank == 0 else None,
    )
    if share.pieces:
        share.scans = _gather_scans(_all_ok(sync, lambda: _scan_ranges(share, work)))
    built = _all_ok(sync, lambda: _build_parts(cfg, tok, share, work))
    _all_ok(sync, lambda: _merge(work, root, built, expected, cfg) if rank == 0 else None)
    cache = open_cache(root, expected, verify=False)  # just written and hashed
    if rank == 0:
        _log_built(cache, time.perf_counter() - started, world_size, max(b["read"] for b in built))
    return cache


def _all_ok(sync: Sync, step: Callable[[], object]) -> list:
    """Run `step` on every rank; if it failed on any, raise there and on every other rank (a
    rank that raised alone would leave the others waiting at the next collective)."""
    try:
        result, error = step(), None
    except AiaynError as exc:
        result, error = None, str(exc)
    outcomes = sync((result, error))
    errors = [(r, e) for r, (_, e) in enumerate(outcomes) if e is not None]
    if errors:
        rank, msg = errors[0]
        raise DataError(msg if len(outcomes) == 1 else f"preparing the data, rank {rank}: {msg}")
    return [r for r, _ in outcomes]


def _start_build(
    cfg: Config, split: str, tok: Tokenizer, root: Path, work: Path, rebuild: bool, share: _Share
) -> None:
    """Invalidate the old cache (its manifest goes first) and make the work directory.

    The work directory is stamped with the corpus files' sizes and modification times: parts
    left by a build of other files or settings are not reused. The files' sha256 come later,
    each from the rank that reads the file (`_merge`), so that no rank reads the whole corpus
    to hash it. A second stamp says how the ranks share the reading: byte ranges depend on the
    number of ranks, so the shards of a build at another world size are not reused."""
    if rebuild and (root / MANIFEST).exists():
        log.info("rebuilding the token cache %s", root)
        (root / MANIFEST).unlink()
    stamp = json.dumps(fingerprint(cfg, split, tok), indent=1, sort_keys=True)
    if work.is_dir() and _read_text(work / "build.json") != stamp:
        log.info("%s was left by a build from other settings: starting over", work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "build.json").is_file():
        write_atomic(work / "build.json", stamp.encode())
    if _read_text(work / "layout.json") != share.layout:
        for path in work.glob("shard_*"):
            path.unlink()
        write_atomic(work / "layout.json", share.layout.encode())


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


@dataclass
class _Share:
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

    def mine(self, n: int) -> range:
        return range(self.rank, n, self.world_size)


def _open_share(cfg: Config, split: str, rank: int, world_size: int, out: list) -> str:
    """Open the source without checking it whole and decide how the ranks share it."""
    source = open_split(cfg.data, getattr(cfg.data, split), cfg.model.kind, check=False)
    share = _Share(source, rank, world_size)
    if world_size > 1:
        n_shards = source.dataset().num_shards
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
    out.append(share)
    # What the ranks compare: a digest, not the layout (W ranges each, gathered on W ranks).
    digest = hashlib.sha256(share.layout.encode()).hexdigest()[:12]
    if share.pieces:
        return f"{len(share.lines.groups)} file(s) in {len(share.pieces)} byte ranges, {digest}"
    return f"{share.shards} shards, {digest}" if share.shards else f"the whole stream, {digest}"


def _scan_ranges(share: _Share, work: Path) -> dict[int, dict]:
    """Count the lines of this rank's byte ranges and hash them (a finished piece's note
    already holds its scan)."""
    scans = {}
    for s in share.mine(len(share.pieces)):
        note = json.loads(_read_text(work / _shard_name(s)) or "null")
        scans[s] = note["scan"] if note else share.lines.scan(share.pieces[s])
    return scans


def _gather_scans(per_rank: list[dict[int, dict]]) -> list[dict]:
    merged = {s: scan for scans in per_rank for s, scan in scans.items()}
    return [merged[s] for s in range(len(merged))]


def _build_parts(cfg: Config, tok: Tokenizer, share: _Share, work: Path) -> dict:
    """Tokenise this rank's share into part files; return what the merge needs.

    Split by shard or by byte range, each rank checks and reads only its pieces, 1/W of the
    corpus. Otherwise every rank reads the whole stream and tokenises its chunks (c mod W).
    Either way the merge concatenates the same records in corpus order: the cache is the same
    for any W."""
    kind, source = cfg.model.kind, share.source
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    threads = _threads_per_rank()
    encoders = ThreadPoolExecutor(threads, thread_name_prefix="aiayn-encode")

    def tokenize(records: list[dict], before: int) -> dict[str, np.ndarray]:
        return _tokenize_chunk(records, before, kind, tok, dtype, encoders, threads)

    with _no_cyclic_gc(), encoders:
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
            _write_part(work / _part_name(c), tokenize(records, before))
    return {"chunks": n_chunks, "invalid_utf8": source.invalid_utf8, "read": read, "sha256": hashes}


Reader = Callable[["_Share", int], tuple[Iterator[dict], Callable[[], dict]]]
"""A shard's records, and what its note records once they are read."""


def _read_shard(share: _Share, s: int) -> tuple[Iterator[dict], Callable[[], dict]]:
    """Shard s of a source of shards: checked (alignment, UTF-8) and hashed first, in one read
    of line-aligned files."""
    hashes: dict[str, str] = {}
    skipped = share.source.check_shard(s, hashes)
    hashes = hashes or _shard_hashes(share.source, share.shards, s)
    records = share.source.records(share.source.shard(share.shards, s))
    return records, lambda: {"invalid_utf8": skipped, "sha256": hashes}


def _read_range(share: _Share, s: int) -> tuple[Iterator[dict], Callable[[], dict]]:
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


def _build_shards(share: _Share, n: int, reader: Reader, tokenize, work: Path) -> dict:
    """This rank's shards (s mod W), each in chunks of local ids, then a note of its size."""
    read = 0
    for s in share.mine(n):
        done = work / _shard_name(s)
        if _read_text(done) is not None:  # a previous build finished it
            continue
        records, finish = reader(share, s)
        n_chunks, count = 0, 0
        for k, before, block, _ in prefetch(_chunks(records)):
            _write_part(work / _shard_part_name(s, k), tokenize(block, before))
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


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The build allocates millions of lists (records, token ids) and no reference cycle: the
    cyclic collector's passes over them cost ~10% of the build, under the GIL that the reader
    and the encoder share."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _my_chunks(source, rank: int, world_size: int, work: Path) -> Iterator:
    """(chunk index, records before it, normalised records or None, size) for every chunk."""
    raw = iter(source.dataset())
    for c in itertools.count():
        block = list(itertools.islice(raw, _CHUNK))
        if not block:
            return
        todo = c % world_size == rank and not _part_ok(work / _part_name(c))
        yield c, c * _CHUNK, [source.normalize(r) for r in block] if todo else None, len(block)


def _threads_per_rank() -> int:
    """Cores for this rank's encode calls: the ranks of one node share its cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (cores or 1) // max(local, 1))


def _tokenize_chunk(
    records: list[dict],
    read: int,
    kind: str,
    tok: Tokenizer,
    dtype,
    pool: ThreadPoolExecutor,
    threads: int,
) -> dict[str, np.ndarray]:
    fields = {"src": "src", "tgt": "tgt"} if kind == "seq2seq" else {"src": "text"}
    encoded = {
        side: _encode([r[f] for r in records], tok, dtype, pool, threads, side)
        for side, f in fields.items()
    }
    side_lengths = {side: lengths for side, (lengths, _) in encoded.items()}
    tokens = np.concatenate([t for _, t in encoded.values()])
    # A pair or an example with an empty side has nothing to learn. An lm keeps its empty lines:
    # in corpus order (data.lm_order stream) each is a line break of the text.
    keep = np.minimum.reduce(list(side_lengths.values())) > 0
    if kind == "lm":
        keep[:] = True
    out = {"ids": read + np.flatnonzero(keep), "empty": np.array(int((~keep).sum()))}
    start = 0
    for side, side_len in side_lengths.items():
        end = start + int(side_len.sum())
        out[f"{side}_lengths"] = side_len[keep]
        out[f"{side}_tokens"] = tokens[start:end][np.repeat(keep, side_len)]
        start = end
    if kind == "classifier":
        out["labels"] = np.array([r["label"] for r in records], dtype=np.int64)[keep]
    return out


def _encode(
    texts: list[str], tok: Tokenizer, dtype, pool: ThreadPoolExecutor, threads: int, side: str
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, concatenated tokens) of `texts`, in pieces over the pool's threads. Each
    piece is encoded by one SentencePiece thread and turned into arrays in its Python thread:
    one piece's list building, which holds the GIL, overlaps the others' encoding. (One encode
    call with native threads builds all its lists at the end, in one thread.)"""
    size = max(1, -(-len(texts) // (2 * threads)))

    def piece(lo: int) -> tuple[np.ndarray, np.ndarray]:
        rows = tok.encode(
            texts[lo : lo + size], threads=1, side="target" if side == "tgt" else "source"
        )
        lengths = np.fromiter(map(len, rows), np.int64, len(rows))
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype, int(lengths.sum()))
        return lengths, flat

    if not texts:
        return np.zeros(0, np.int64), np.zeros(0, dtype)
    done = list(pool.map(piece, range(0, len(texts), size)))
    return np.concatenate([ln for ln, _ in done]), np.concatenate([t for _, t in done])


def _part_name(c: int) -> str:
    return f"part_{c:08d}.npz"


def _shard_part_name(s: int, k: int) -> str:
    return f"shard_{s:06d}_part_{k:08d}.npz"


def _shard_name(s: int) -> str:
    return f"shard_{s:06d}.json"


def _part_ok(path: Path) -> bool:
    try:
        with np.load(path) as part:
            return "ids" in part.files
    except (OSError, ValueError, EOFError):
        return False


def _write_part(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _merge(work: Path, root: Path, built: list[dict], expected: dict, cfg: Config) -> None:
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
    # Sizes from the small arrays alone: a side's token count is the sum of its lengths, so
    # the token arrays are read once, by the copy below.
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
    n = sizes["ids"]
    outputs = {}
    for name in names:
        if name.endswith("_lengths"):  # stored as offsets: n + 1 entries
            side = name.removesuffix("_lengths")
            outputs[f"{side}_offsets"] = (name, np.int64, sizes[name] + 1)
        else:
            outputs[name] = (name, dtypes[name], sizes[name])
    files = {}
    for out_name, (name, dtype, size) in outputs.items():
        path = root / f"{out_name}.npy"
        tmp = path.with_name(f".{path.name}.tmp")
        arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(size,))
        at, total = 0, 0
        if out_name.endswith("_offsets"):
            arr[0], at = 0, 1
        for p, offset in zip(parts, offsets, strict=True):
            with np.load(p) as part:
                chunk = part[name]
            if name == "ids":  # a shard's part counts its records from the shard's start
                chunk = chunk + offset
            if out_name.endswith("_offsets"):
                chunk = total + np.cumsum(chunk)
                total = int(chunk[-1]) if len(chunk) else total
            arr[at : at + len(chunk)] = chunk
            at += len(chunk)
        arr.flush()
        del arr
        fsync_path(tmp)
        os.replace(tmp, path)
        files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    counts = {
        "records_read": n + empty,
        "examples": n,
        "dropped_empty": empty,
        "invalid_utf8_skipped": invalid_utf8,
    }
    for side in ("src", "tgt"):
        if f"{side}_tokens" in sizes:
            counts[f"{side}_tokens"] = sizes[f"{side}_tokens"]
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


def _parts_in_order(work: Path, built: list[dict]) -> tuple[list[Path], list[int], int, dict, dict]:
    """The part files in corpus order, the record index each one's ids count from, the lines
    skipped as not UTF-8, and the source files' sha256 that the shards' readers took: whole
    files', and byte ranges' ([start, end, sha256] by file) where files were cut."""
    if "shards" not in built[0]:  # chunks of the whole stream, ids already global
        parts = [work / _part_name(c) for c in range(built[0]["chunks"])]
        return parts, [0] * len(parts), built[0]["invalid_utf8"], built[0]["sha256"], {}
    parts, offsets, start, invalid, hashes, ranges = [], [], 0, 0, {}, {}
    for s in range(built[0]["shards"]):
        note = json.loads(_read_text(work / _shard_name(s)) or "null")
        if note is None:
            raise DataError(f"the data preparation lost shard {s}'s note; run it again")
        parts += [work / _shard_part_name(s, k) for k in range(note["chunks"])]
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


def _log_built(cache: TokenCache, seconds: float, world_size: int, most_read: int) -> None:
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
