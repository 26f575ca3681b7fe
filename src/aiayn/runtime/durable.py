"""Writes that survive a crash or a power loss, and checksums: what checkpoints and the token
cache both rely on."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HASH_BLOCK = 1 << 22
_hashed = 0  # bytes sha256_of has read in this process


def sha256_of(path: Path, start: int = 0, end: int | None = None) -> str:
    """sha256 of the file, or of its bytes [start, end)."""
    digest = hashlib.sha256()
    # One buffer, read into: a save hashes a rank's shard files beside what it still holds.
    block = memoryview(bytearray(_HASH_BLOCK))
    with open(path, "rb") as fh:
        fh.seek(start)
        left = None if end is None else end - start
        while n := fh.readinto(block if left is None else block[: min(_HASH_BLOCK, left)]):
            digest.update(block[:n])
            count_hashed(n)
            if left is not None:
                left -= n
    return digest.hexdigest()


def checksums_match(path: Path, entry: dict) -> bool:
    """Whether the file has the content a manifest entry records: its `sha256`, or, for a file
    ranks wrote or read by byte range, each range's (`sha256_ranges`: [[start, end, hex]],
    which must tile the file's `bytes`)."""
    ranges = entry.get("sha256_ranges")
    if ranges is None:
        return sha256_of(path) == entry["sha256"]
    ends = [0] + [b for _, b, _ in ranges]
    if [a for a, _, _ in ranges] != ends[:-1] or ends[-1] != entry["bytes"]:
        return False
    return all(sha256_of(path, a, b) == digest for a, b, digest in ranges)


def count_hashed(n: int) -> None:
    """Count n bytes hashed, for a reader that hashes what it reads for another purpose."""
    global _hashed
    _hashed += n


def bytes_hashed() -> int:
    """Bytes hashed in this process (sha256_of, count_hashed): what verifying checkpoints and
    token caches cost it, which a start reports (train/report.py) because at scale it is read from
    shared storage."""
    return _hashed


def size_text(n: float) -> str:
    """A byte count for a person: "812 bytes", "3.4 MiB"."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str) -> None:
    """`path` holds the old content or all of `data`, whenever the process or machine stops."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also keep the part that fitted
        raise
    fsync_path(path.parent)


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """A directory to fill that appears at `path` complete, or not at all: the body writes into
    a temporary sibling, renamed to `path` when it returns and removed if it raises.
    An existing `path` is refused, so nothing a user has is overwritten."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists: choose another output, or delete it first")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for item in tmp.iterdir():
            if item.is_file():
                fsync_path(item)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(path.parent)
