"""Where each part of a build goes in the cache's arrays, and each rank's parts written there.

The parts are a build's units in corpus order: a shard or byte range (its notes and chunks,
`shard_S_part_K.npz`), or a chunk of the whole stream (`part_C.npz`). Unit u is merged by
rank u mod W, the rank that tokenised it in a build of this world size. Each rank measures its
units (the lengths of their small arrays: a side's token count is the sum of its lengths), the
ranks gather these counts, and every rank computes the same `Layout` from them: each part's
element offset in each array, the token count before it on each side (an offsets array counts
from there) and the records before its unit (a shard's ids count from the shard's start). A
rank then writes its parts' slices at those offsets with pwrite, which writes only its own
bytes (a memory map would write back whole pages, a neighbour's bytes included, on a shared
filesystem whose nodes do not share a page cache).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiayn.data.cache.parts import part_name, read_text, shard_name, shard_part_name
from aiayn.errors import DataError
from aiayn.runtime.durable import fsync_path


def measure(work: Path, built: list[dict], rank: int, world: int) -> dict:
    """This rank's units: their parts, the length of each part's arrays, and what their notes
    say (records, records skipped, the source's hashes). Read from this rank's files only."""
    units, names = [], None
    shards = "shards" in built[0]
    for u in range(rank, built[0]["shards" if shards else "chunks"], world):
        note = {"chunks": 1, "records": 0}
        if shards:
            note = json.loads(read_text(work / shard_name(u)) or "null")
            if note is None:
                raise DataError(f"the data preparation lost shard {u}'s note; run it again")
        parts = [shard_part_name(u, k) if shards else part_name(u) for k in range(note["chunks"])]
        sizes, empty = [], 0
        for name in parts:
            if not (work / name).is_file():
                raise DataError(f"the data preparation lost its part {name}; run it again")
            with np.load(work / name) as part:
                names = names or {n: part[n].dtype.str for n in part.files if n != "empty"}
                sizes.append(_part_sizes(part))
                empty += int(part["empty"])
        units.append(
            {
                "unit": u,
                "parts": parts,
                "sizes": sizes,
                "records": note["records"],
                "empty": empty,
                "invalid_utf8": note.get("invalid_utf8", 0),
                "sha256": note.get("sha256", {}),
                "sha256_ranges": note.get("sha256_ranges"),
            }
        )
    return {"units": units, "names": names}


def _part_sizes(part) -> dict[str, int]:
    """Each array's length in one part, from its small arrays only: a side's tokens number the
    sum of its lengths, so the token arrays are read once, by the write."""
    sizes = {}
    for name in part.files:
        if name.endswith("_lengths"):
            lengths = part[name]
            sizes[name] = len(lengths)
            sizes[f"{name.removesuffix('_lengths')}_tokens"] = int(lengths.sum())
        elif name not in ("empty",) and not name.endswith("_tokens"):
            sizes[name] = len(part[name])
    return sizes


@dataclass
class Output:
    """One array of the cache: the part array it comes from, its dtype and its length."""

    source: str
    dtype: np.dtype
    size: int

    @property
    def header(self) -> bytes:
        """The .npy header that np.lib.format.open_memmap writes for this array (version 1.0,
        which holds any 1-D array's): every rank computes it, and so where the data starts."""
        out = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            out,
            {
                "descr": np.lib.format.dtype_to_descr(self.dtype),
                "fortran_order": False,
                "shape": (self.size,),
            },  # fmt: skip
        )
        return out.getvalue()

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.size * self.dtype.itemsize


@dataclass
class Layout:
    """Every rank's units in corpus order and where each part goes (`Layout.of`)."""

    outputs: dict[str, Output]
    units: list[dict]
    at: list[list[dict[str, int]]]  # per unit, per part: element offset in each output
    base: list[list[dict[str, int]]]  # per unit, per part: tokens before it on each side
    first_id: list[int]  # per unit: records before it (a shard's ids count from its start)
    shards: bool

    @classmethod
    def of(cls, gathered: list[dict], shards: bool, split: str) -> Layout:
        """The layout from every rank's `measure`, the same on every rank (its errors too)."""
        units = sorted((u for g in gathered for u in g["units"]), key=lambda u: u["unit"])
        names = next((g["names"] for g in gathered if g["names"]), None)
        if names is None:
            raise DataError(f"corpus {split} holds no records; check the data section")
        totals = {n: 0 for n in names}
        for u in units:
            for sizes in u["sizes"]:
                for n, k in sizes.items():
                    totals[n] += k
        outputs = _outputs({n: np.dtype(d) for n, d in names.items()}, totals)
        pos = {o: int(o.endswith("_offsets")) for o in outputs}  # offsets start with a 0
        tokens = {n.removesuffix("_tokens"): 0 for n in names if n.endswith("_tokens")}
        at, base, first_id, records = [], [], [], 0
        for u in units:
            at.append([]), base.append([])
            for sizes in u["sizes"]:
                at[-1].append(dict(pos))
                base[-1].append(dict(tokens))
                for o, out in outputs.items():
                    pos[o] += sizes[out.source]
                for side in tokens:
                    tokens[side] += sizes[f"{side}_tokens"]
            first_id.append(records if shards else 0)
            records += u["records"]
        return cls(outputs, units, at, base, first_id, shards)

    def totals(self) -> dict[str, int]:
        """Each part array's length in the cache (lengths: the examples), for the counts."""
        return {o.source: o.size for n, o in self.outputs.items() if not n.endswith("_offsets")}


def _outputs(dtypes: dict[str, np.dtype], totals: dict[str, int]) -> dict[str, Output]:
    """The cache's arrays, in the order they are written: a side's lengths are stored twice,
    as offsets (n + 1 entries, the index rows are read by) and as int32 lengths (what a start
    plans from, data/cache/format.py)."""
    outputs = {}
    for name in sorted(dtypes):
        if name.endswith("_lengths"):
            side = name.removesuffix("_lengths")
            outputs[f"{side}_offsets"] = Output(name, np.dtype(np.int64), totals[name] + 1)
            outputs[name] = Output(name, np.dtype(np.int32), totals[name])
        else:
            outputs[name] = Output(name, dtypes[name], totals[name])
    return outputs


def tmp_path(root: Path, name: str) -> Path:
    return root / f".{name}.npy.tmp"


def preallocate(root: Path, layout: Layout) -> None:
    """Rank 0: each array's file at its final size, its header and first offset written, before
    any rank writes its slices into it."""
    root.mkdir(parents=True, exist_ok=True)
    for name, out in layout.outputs.items():
        with open(tmp_path(root, name), "wb") as fh:
            fh.write(out.header)
            if name.endswith("_offsets"):
                fh.write(np.zeros(1, np.int64).tobytes())
            fh.truncate(out.nbytes)


def write_mine(work: Path, root: Path, layout: Layout, rank: int, world: int) -> int:
    """Write this rank's units' parts at their offsets and sync the files; the bytes written."""
    fds = {n: os.open(tmp_path(root, n), os.O_WRONLY) for n in layout.outputs}
    written = 0
    try:
        for i, unit in enumerate(layout.units):
            if unit["unit"] % world != rank:
                continue
            for k, name in enumerate(unit["parts"]):
                with np.load(work / name) as part:
                    for o, out in layout.outputs.items():
                        chunk = _chunk(part, o, out, layout.base[i][k], layout.first_id[i])
                        at = len(out.header) + layout.at[i][k][o] * out.dtype.itemsize
                        written += _pwrite_all(fds[o], chunk.tobytes(), at)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def _chunk(part, name: str, out: Output, base: dict[str, int], first_id: int) -> np.ndarray:
    chunk = part[out.source]
    if name == "ids":
        chunk = chunk + first_id
    elif name.endswith("_offsets"):
        chunk = base[name.removesuffix("_offsets")] + np.cumsum(chunk)
    return np.asarray(chunk, dtype=out.dtype)  # the cast an assignment into the array made


def _pwrite_all(fd: int, data: bytes, at: int) -> int:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    return len(data)


def put_in_place(root: Path, layout: Layout) -> None:
    """Rank 0, once every rank wrote and hashed: the arrays renamed into place."""
    for name in layout.outputs:
        os.replace(tmp_path(root, name), root / f"{name}.npy")
    fsync_path(root)
