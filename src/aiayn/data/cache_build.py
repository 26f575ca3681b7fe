"""Building a token cache (data/cache.py) once, on every rank at a time.

Building streams the source through `datasets` in chunks of _CHUNK records, tokenised in
pieces over a pool of threads (SentencePiece's encode releases the GIL, so one process uses
every core it is given), each written as a part file, atomically. A source of at least as many
shards (files) as ranks is split by shard: rank r reads, checks and tokenises shards r, r + W,
..., 1/W of the corpus. Otherwise every rank reads the whole stream and tokenises chunks c with
c mod W = r. Rank 0 then concatenates the parts in corpus order: the cache does not depend on
the number of ranks. An interrupted build keeps its finished parts (and shards) in
`<split>.partial/` and the next build reuses them if they were made from the same fingerprint.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
from aiayn.data.prefetch import prefetch
from aiayn.data.sources import open_split
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
) -> TokenCache:
    """Open the cache of `split`, building it first if it is missing (or if rebuild).

    Every rank calls it; the ranks share the tokenising and rank 0 writes the result. An
    existing cache that does not fit the config is refused, never silently replaced. Rank 0
    alone verifies an existing cache's checksums (every rank hashing every array would read
    the cache once per rank); the others check its manifest and sizes, and all stop together
    if any rank finds it wrong.
    """
    sync = sync or (lambda value: [value])
    root = cache_dir(cfg, split)
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
    _all_ok(sync, lambda: _start_build(cfg, split, tok, root, work, rebuild) if rank == 0 else None)
    built = _all_ok(sync, lambda: _build_parts(cfg, split, tok, work, rank, world_size))
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
    cfg: Config, split: str, tok: Tokenizer, root: Path, work: Path, rebuild: bool
) -> None:
    """Invalidate the old cache (its manifest goes first) and make the work directory.

    The work directory is stamped with the corpus files' sizes and modification times: parts
    left by a build of other files or settings are not reused. The files' sha256 come later,
    each from the rank that reads the file (`_merge`), so that no rank reads the whole corpus
    to hash it."""
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


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _build_parts(
    cfg: Config, split: str, tok: Tokenizer, work: Path, rank: int, world_size: int
) -> dict:
    """Tokenise this rank's share into part files; return what the merge needs.

    A source of at least as many shards (files) as ranks is split by shard: each rank opens,
    checks and reads only its shards, 1/W of the corpus. Otherwise every rank reads the whole
    stream and tokenises its chunks (c mod W). Either way the merge concatenates the same
    records in corpus order: the cache is the same for any W.
    """
    kind = cfg.model.kind
    source = open_split(cfg.data, getattr(cfg.data, split), kind, check=False)
    n_shards = source.dataset().num_shards
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    threads = _threads_per_rank()
    encoders = ThreadPoolExecutor(threads, thread_name_prefix="aiayn-encode")

    def tokenize(records: list[dict], before: int) -> dict[str, np.ndarray]:
        return _tokenize_chunk(records, before, kind, tok, dtype, encoders, threads)

    with _no_cyclic_gc(), encoders:
        if world_size > 1 and n_shards >= world_size:
            return _build_shards(source, n_shards, tokenize, work, rank, world_size)
        source.check()  # whole: every rank reads it all
        n_chunks, read = 0, 0
        for c, before, records, size in prefetch(_my_chunks(source, rank, world_size, work)):
            n_chunks, read = c + 1, read + size
            if records is None:  # another rank's chunk, or one a previous build finished
                continue
            _write_part(work / _part_name(c), tokenize(records, before))
    return {"chunks": n_chunks, "invalid_utf8": source.invalid_utf8, "read": read}


def _build_shards(source, n_shards: int, tokenize, work: Path, rank: int, world_size: int) -> dict:
    """This rank's shards (s mod W), each in chunks of local ids, then a note of its size."""
    read = 0
    for s in range(rank, n_shards, world_size):
        done = work / _shard_name(s)
        if _read_text(done) is not None:  # a previous build finished it
            continue
        skipped = source.check_shard(s)
        hashes = _shard_hashes(source, n_shards, s)
        n_chunks, records = 0, 0
        for k, before, block, _ in prefetch(_shard_chunks(source, n_shards, s)):
            _write_part(work / _shard_part_name(s, k), tokenize(block, before))
            n_chunks, records = k + 1, before + len(block)
        note = {"chunks": n_chunks, "records": records, "invalid_utf8": skipped}
        note["sha256"] = hashes
        write_atomic(done, json.dumps(note).encode())  # last: marks the shard done
        read += records
    return {"shards": n_shards, "read": read}


def _shard_hashes(source, n_shards: int, s: int) -> dict[str, str]:
    """sha256 of the files only shard s reads, by resolved path (the fingerprint's keys)."""
    if source.shard_files is None or len(source.shard_files) != n_shards:
        return {}  # not known which files the shard reads: the merge hashes them
    return {str(Path(f).resolve()): sha256_of(Path(f)) for f in source.shard_files[s]}


def _shard_chunks(source, n_shards: int, s: int) -> Iterator:
    """(chunk index, records of the shard before it, normalised records, size) of shard s."""
    records = source.records(source.shard(n_shards, s))
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
    lengths, tokens = _encode(
        [r[f] for f in fields.values() for r in records], tok, dtype, pool, threads
    )
    n = len(records)
    side_lengths = {side: lengths[i * n : (i + 1) * n] for i, side in enumerate(fields)}
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
    texts: list[str], tok: Tokenizer, dtype, pool: ThreadPoolExecutor, threads: int
) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, concatenated tokens) of `texts`, in pieces over the pool's threads. Each
    piece is encoded by one SentencePiece thread and turned into arrays in its Python thread:
    one piece's list building, which holds the GIL, overlaps the others' encoding. (One encode
    call with native threads builds all its lists at the end, in one thread.)"""
    size = max(1, -(-len(texts) // (2 * threads)))

    def piece(lo: int) -> tuple[np.ndarray, np.ndarray]:
        rows = tok.encode(texts[lo : lo + size], threads=1)
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
    parts, offsets, invalid_utf8, hashes = _parts_in_order(work, built)
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
        "fingerprint": _with_hashes(json.loads((work / "build.json").read_text()), hashes),
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


def _parts_in_order(work: Path, built: list[dict]) -> tuple[list[Path], list[int], int, dict]:
    """The part files in corpus order, the record index each one's ids count from, the lines
    skipped as not UTF-8, and the source files' sha256 that the shards' readers took."""
    if "shards" not in built[0]:  # chunks of the whole stream, ids already global
        parts = [work / _part_name(c) for c in range(built[0]["chunks"])]
        return parts, [0] * len(parts), built[0]["invalid_utf8"], {}
    parts, offsets, start, invalid, hashes = [], [], 0, 0, {}
    for s in range(built[0]["shards"]):
        note = json.loads(_read_text(work / _shard_name(s)) or "null")
        if note is None:
            raise DataError(f"the data preparation lost shard {s}'s note; run it again")
        parts += [work / _shard_part_name(s, k) for k in range(note["chunks"])]
        offsets += [start] * note["chunks"]
        start += note["records"]
        invalid += note["invalid_utf8"]
        hashes.update(note["sha256"])
    return parts, offsets, invalid, hashes


def _with_hashes(stamp: dict, hashes: dict[str, str]) -> dict:
    """The build's fingerprint with each source file's sha256: from its shard's reader, or
    hashed here (a build that read the whole stream, where every rank read every file)."""
    for entry in stamp.get("files") or []:
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
