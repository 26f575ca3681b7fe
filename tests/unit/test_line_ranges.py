"""Byte ranges of line-aligned files (data/cache/line_ranges.py): cut anywhere, at any number of
pieces, they give the lines one reader gives, in order, and count what `_scan` counts."""

from __future__ import annotations

import random

import pytest

from aiayn.data import line_files
from aiayn.data.cache.line_ranges import LineFiles
from aiayn.errors import DataError


def _line(rng: random.Random) -> str:
    return "".join(rng.choice("ab \tcé") for _ in range(rng.randrange(0, rng.choice((3, 12, 200)))))


@pytest.mark.parametrize("seed", range(4))
def test_pieces_read_what_one_reader_reads_for_any_cut(tmp_path, seed):
    rng = random.Random(seed)
    for trial in range(60):
        n = rng.randrange(0, 40)
        texts = {}
        for name in ("a.en", "a.de"):
            rows = [_line(rng) for _ in range(n)]
            ending = "\n" if n and (rng.random() < 0.7 or "" in rows[-1:]) else ""
            texts[name] = "\n".join(rows) + ending
            (tmp_path / name).write_text(texts[name])
        (tmp_path / "b.en").write_text("x\ny\n")
        (tmp_path / "b.de").write_text("X\nY\n")
        groups = [[str(tmp_path / f"{p}.{lang}") for lang in ("en", "de")] for p in "ab"]
        world = rng.randrange(1, 12)
        pairs = LineFiles(groups, parallel=True, strict=False)
        pieces = pairs.pieces(world)
        assert len(pieces) >= world
        scans = [pairs.scan(p) for p in pieces]
        counts = [line_files._scan(path)[0] for path in groups[0]]
        assert [
            sum(s["lines"][f] for p, s in zip(pieces, scans, strict=True) if p.group == 0)
            for f in (0, 1)
        ] == counts, trial
        if counts[0] != counts[1]:
            with pytest.raises(DataError, match="not line-aligned"):
                pairs.check_aligned(pieces, scans)
            continue
        pairs.check_aligned(pieces, scans)
        got = [r for s in range(len(pieces)) for r in pairs.records(s, pieces, scans, [0])]
        assert got == list(line_files._parallel_examples(groups, strict=False)), (trial, world)

        text = LineFiles([groups[0][:1]], parallel=False, strict=False)
        pieces = text.pieces(world)
        scans = [text.scan(p) for p in pieces]
        got = [r for s in range(len(pieces)) for r in text.records(s, pieces, scans, [0])]
        assert got == list(line_files._text_examples(groups[0][:1], strict=False)), (trial, world)
