"""Byte ranges of line-aligned files: how ranks share a corpus of fewer files than ranks.

A plain (uncompressed) file is cut into ranges of equal bytes, and a range holds the lines
that start in it: a rank reads its range, and the lines crossing its ends once. A file pair
(parallel data) is cut the same way on both sides, but line i of the source must meet line i
of the target, which the target's cuts place elsewhere. So reading is in two passes:

1. `scan`: each range of each file is read once, counting the lines that start in it and
   hashing its bytes (the cache records a file's sha256 as its ranges', read by the ranks
   that read them, where no rank reads the whole file).
2. `records`: with every range's counts (gathered), a piece knows its first line number; it
   reads its source lines from its own range, and its target lines from the target range
   holding the first of them, skipping the lines before it.

A gzip file cannot be cut: its stream has no place to start but its beginning.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# line_files.open_bytes is looked up at each call: benchmarks/_scale_probe.py replaces it to
# count the corpus bytes a rank reads.
from aiayn.data import line_files
from aiayn.data.source import Source
from aiayn.errors import DataError
from aiayn.runtime.durable import count_hashed

_BLOCK = 1 << 22


@dataclass(frozen=True)
class Piece:
    """Range `index` of the `of` equal-byte ranges each file of group `group` is cut into."""

    group: int
    index: int
    of: int


class LineFiles:
    """The groups of a line-aligned source (file pairs for parallel data, single files for
    text), cut into pieces by byte range."""

    def __init__(self, groups: list[list[str]], parallel: bool, strict: bool):
        self.groups = groups
        self.parallel = parallel
        self.strict = strict
        self.sizes = [[Path(f).stat().st_size for f in group] for group in groups]

    @classmethod
    def of(cls, source: Source, data_format: str, strict: bool) -> LineFiles | None:
        """The source's files, where they can be cut: parallel or text files, none gzip."""
        groups = source.shard_files
        if data_format not in ("parallel", "text") or not groups:
            return None
        if any(f.endswith(".gz") for group in groups for f in group):
            return None
        return cls(groups, data_format == "parallel", strict)

    def pieces(self, world_size: int) -> list[Piece]:
        """At least world_size pieces, each group cut in proportion to its bytes."""
        total = sum(map(sum, self.sizes)) or 1
        out = []
        for g, sizes in enumerate(self.sizes):
            of = max(1, math.ceil(world_size * sum(sizes) / total))
            out += [Piece(g, k, of) for k in range(of)]
        return out

    def _range(self, piece: Piece, f: int) -> tuple[int, int]:
        size = self.sizes[piece.group][f]
        return size * piece.index // piece.of, size * (piece.index + 1) // piece.of

    def scan(self, piece: Piece) -> dict:
        """The lines starting in the piece's range of each file of its group, and the sha256 of
        each range: {"lines": [n, ...], "sha256": {path: [start, end, hex]}}."""
        lines, hashes = [], {}
        for f, path in enumerate(self.groups[piece.group]):
            start, end = self._range(piece, f)
            n, digest = _scan_range(path, start, end)
            lines.append(n)
            hashes[str(Path(path).resolve())] = [start, end, digest]
        return {"lines": lines, "sha256": hashes}

    def check_aligned(self, pieces: list[Piece], scans: list[dict]) -> None:
        """Each file of a pair holds as many lines as the other (counted by ranges)."""
        if not self.parallel:
            return
        for g, group in enumerate(self.groups):
            counts = [s["lines"] for p, s in zip(pieces, scans, strict=True) if p.group == g]
            lines = [sum(c[f] for c in counts) for f in (0, 1)]
            if lines[0] != lines[1]:
                raise line_files.misaligned(group, lines)

    def records(self, s: int, pieces: list[Piece], scans: list[dict], skipped: list[int]):
        """The normalised records of piece s, in order, given every piece's scan. Lines that
        are not UTF-8 are counted in skipped[0] (or raise, with data.on_invalid_utf8=error)."""
        piece = pieces[s]
        group = self.groups[piece.group]
        # Lines starting in each range of the group: [source, target] (or [text]) per range.
        counts = [
            sc["lines"] for p, sc in zip(pieces, scans, strict=True) if p.group == piece.group
        ]
        first = sum(c[0] for c in counts[: piece.index])  # its first line's number
        count = counts[piece.index][0]
        src = _lines(group[0], self._range(piece, 0)[0], 0, count)
        if not self.parallel:
            for i, line in enumerate(src):
                text = line_files.decode_line(line, group[0], first + i + 1, self.strict, False)
                if text is None:
                    skipped[0] += 1
                else:
                    yield {"text": text}
            return
        # The target range whose first line is at or before ours, and the lines to skip in it.
        starts = [0, *itertools.accumulate(c[1] for c in counts)]
        k = bisect.bisect_right(starts, first) - 1
        at = self._range(Piece(piece.group, k, piece.of), 1)[0]
        tgt = _lines(group[1], at, first - starts[k], count)
        for i, (bs, bt) in enumerate(zip(src, tgt, strict=True)):
            text = line_files.decode_line(bs, group[0], first + i + 1, self.strict)
            other = None
            if text is not None:
                other = line_files.decode_line(bt, group[1], first + i + 1, self.strict)
            if text is None or other is None:
                skipped[0] += 1
            else:
                yield {"src": text, "tgt": other}


def _scan_range(path: str, start: int, end: int) -> tuple[int, str]:
    """(lines starting in [start, end), sha256 of those bytes). A line starts at 0 and after
    each line break but the file's last byte; the byte before `start` is read to see whether
    a line starts at `start`."""
    digest = hashlib.sha256()
    lo = max(start - 1, 0)
    breaks, last = 0, b""
    with line_files.open_bytes(path) as fh:
        fh.seek(lo)
        left, head = end - lo, start > 0
        while left > 0:
            block = fh.read(min(_BLOCK, left))
            if not block:
                raise _changed(path)
            left -= len(block)
            breaks += block.count(b"\n")
            last = block[-1:]
            if head:
                block, head = block[1:], False
            digest.update(block)
            count_hashed(len(block))
    # Breaks in [lo, end - 1) each start a line in [start, end); the one at end - 1 starts the
    # next range's first line (or none, at the end of the file).
    lines = breaks - (last == b"\n") + (1 if start == 0 and end > 0 else 0)
    return lines, digest.hexdigest()


def _lines(path: str, start: int, skip: int, count: int) -> Iterator[bytes]:
    """`count` lines (with their breaks) from the skip-th line starting at or after `start`."""
    with line_files.open_bytes(path) as fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # the line holding byte start - 1: only its break, if one starts here
        for _ in range(skip):
            fh.readline()
        for _ in range(count):
            line = fh.readline()
            if not line:
                raise _changed(path)
            yield line


def _changed(path: str) -> DataError:
    return DataError(
        f"{path} changed while the token cache was being built (it is shorter than when its "
        "lines were counted); build it again once the corpus is in place"
    )
