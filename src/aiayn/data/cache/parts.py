"""Part files: chunks of a rank's records tokenised and written to the build's work directory.

The work directory `<split>.partial/` holds build.json (the fingerprint the parts were made
from), layout.json (how the ranks shared the reading: data/cache/shares.py) and the parts, each
written atomically: part_C.npz, chunk C of the whole stream; or shard_S_part_K.npz, chunk K of
shard (or byte range) S, whose note shard_S.json, written last, marks S done. A part holds
ids, each side's lengths and tokens (labels for a classifier) and how many records it dropped
as empty.

A chunk is tokenised in pieces over a pool of threads: SentencePiece's encode releases the
GIL, so one process uses every core it is given.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from aiayn.tokenizer import Tokenizer

Tokenize = Callable[[list[dict], int], dict[str, np.ndarray]]
"""A chunk's normalised records and the records before it -> the part's arrays."""


@contextlib.contextmanager
def tokenizing(kind: str, tok: Tokenizer) -> Iterator[Tokenize]:
    """A function that tokenises a chunk of records into a part's arrays, on this rank's
    threads, for the duration of the block."""
    dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    threads = _threads_per_rank()
    encoders = ThreadPoolExecutor(threads, thread_name_prefix="aiayn-encode")

    def tokenize(records: list[dict], before: int) -> dict[str, np.ndarray]:
        return _tokenize_chunk(records, before, kind, tok, dtype, encoders, threads)

    with _no_cyclic_gc(), encoders:
        yield tokenize


@contextlib.contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The build allocates millions of lists (records, token ids) and no reference cycle: the
    cyclic collector would pass over them all, under the GIL that the reader and the encoder
    share."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


def part_name(c: int) -> str:
    return f"part_{c:08d}.npz"


def shard_part_name(s: int, k: int) -> str:
    return f"shard_{s:06d}_part_{k:08d}.npz"


def shard_name(s: int) -> str:
    return f"shard_{s:06d}.json"


def part_ok(path: Path) -> bool:
    try:
        with np.load(path) as part:
            return "ids" in part.files
    except (OSError, ValueError, EOFError):
        return False


def write_part(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_text(path: Path) -> str | None:
    """A note's or a stamp's text; None where it was never written (or cannot be read)."""
    try:
        return path.read_text()
    except OSError:
        return None
