"""A Hub training split copied once into local parquet files, which every later read uses.

Streamed from the Hub, a split is downloaded by every rank that reads it: W times the download
at W ranks, and the Hub's rate limits can end the job. So the first preparation copies the
pinned revision's split once, beside the token cache:

    <cache root>/hub/<name>@<revision>/<config>/<split>/
        part-SSSSS-KKKKK.parquet   the records of the Hub's data file S, KKKKK-th block of
                                   _PART_ROWS, as the Hub serves them (fields untouched)
        manifest.json              written last: the dataset, revision and split, each part's
                                   rows, bytes and sha256, and the rank that wrote it

The ranks share the copying by the Hub's own data files: rank r downloads files r, r + W, ...
(one rank all of them where the split is one file). The parts sort in the stream's order, so
the records read from the copy are the Hub's, in the Hub's order, and the token cache built
from them is the cache built from the stream, byte for byte. Each part is a shard of the copy,
so the ranks then share building the cache, or the stream, by file (data/cache/shares.py).
With data.cache_scope=node each node makes its own copy beside its own cache.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from aiayn.config import Config
from aiayn.data.cache.format import cache_dir
from aiayn.data.records import hub_errors, record_source
from aiayn.data.together import Sync, on_every_rank
from aiayn.errors import DataError
from aiayn.runtime.durable import sha256_of, write_atomic

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_PART_ROWS = 16_384
"""Records per local part: the token cache's chunk, so that a copy of N records has N / 16,384
files to share among the ranks, where the Hub has a few."""


def copy_dir(cfg: Config) -> Path:
    """Where the copy of the training split lives: beside the token cache (node-local with
    data.cache_scope=node), named by the dataset, its revision, config and split."""
    data = cfg.data
    name = re.sub(r"[^\w.-]+", "--", str(data.hub_name)).strip("-")[-120:]
    revision = data.hub_revision or "unpinned"
    return (
        cache_dir(cfg, "hub") / f"{name}@{revision}" / (data.hub_config or "default") / data.train
    )


def local_parts(cfg: Config) -> list[str] | None:
    """The parquet parts of the training split's finished copy, in stream order; None where
    the run reads no Hub split or there is no finished copy (the Hub is streamed, as before)."""
    if cfg.data.format != "hub" or cfg.data.sources or not cfg.data.train:
        return None
    folder = copy_dir(cfg)
    if not (folder / MANIFEST).is_file():
        return None
    manifest = json.loads((folder / MANIFEST).read_text())
    return [str(folder / p["file"]) for p in manifest["parts"]]


def materialise(
    cfg: Config, rank: int = 0, world: int = 1, sync: Sync | None = None
) -> list[str] | None:
    """Copy the training split from the Hub unless a finished copy exists; return its parts
    (None where the run reads no Hub split). Every rank of `sync` calls it; each copies its
    share of the Hub's data files, and rank 0 writes the manifest once all have finished."""
    sync = sync or (lambda value: [value])
    if cfg.data.format != "hub" or cfg.data.sources or not cfg.data.train:
        return None
    folder = copy_dir(cfg)
    if sync((folder / MANIFEST).is_file())[0]:  # as rank 0 sees it, for all
        return local_parts(cfg)
    work = folder.with_name(f"{folder.name}.partial")
    source = record_source(cfg.data, cfg.data.train, cfg.model.kind)
    n_files = _together(sync, lambda: _start(source, work) if rank == 0 else None)[0]
    notes = _together(
        sync,
        lambda: [_copy_file(source, n_files, s, work, rank) for s in range(rank, n_files, world)],
    )
    files = sorted((note for mine in notes for note in mine), key=lambda note: note["file"])
    _together(sync, lambda: _finish(cfg, work, folder, files) if rank == 0 else None)
    return local_parts(cfg)


def _start(source, work: Path) -> int:
    """Rank 0: a fresh work folder, and the number of the split's data files."""
    with hub_errors(source.name):
        n_files = source.dataset().num_shards
    shutil.rmtree(work, ignore_errors=True)  # a copy interrupted before: started over
    work.mkdir(parents=True)
    return n_files


def _copy_file(source, n_files: int, s: int, work: Path, rank: int) -> dict:
    """Copy the Hub's data file s into parts of _PART_ROWS records; return its note."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = source.shard(n_files, s)
    # The types datasets states (a parquet file's, or inferred from a JSON file's start);
    # None: each part's own, which the parquet reader reconciles (a column null in one part).
    schema = ds.features.arrow_schema if ds.features is not None else None
    parts = []
    with hub_errors(source.name):
        for k, rows in enumerate(_blocks(iter(ds))):
            path = work / f"part-{s:05d}-{k:05d}.parquet"
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
            parts.append({"file": path.name, "rows": len(rows), "bytes": path.stat().st_size,
                          "sha256": sha256_of(path), "rank": rank})  # fmt: skip
    return {"file": f"{s:05d}", "parts": parts}


def _blocks(records: Iterator[dict]) -> Iterator[list[dict]]:
    block: list[dict] = []
    for rec in records:
        block.append(rec)
        if len(block) == _PART_ROWS:
            yield block
            block = []
    if block:
        yield block


def _finish(cfg: Config, work: Path, folder: Path, notes: list[dict]) -> None:
    """Rank 0: the manifest, then the finished folder in place of any old one."""
    data = cfg.data
    parts = [p for note in notes for p in note["parts"]]
    if not parts:
        raise DataError(f"the Hub dataset {data.hub_name} split {data.train} holds no records")
    manifest = {
        "hub": {
            "name": data.hub_name,
            "config": data.hub_config,
            "revision": data.hub_revision,
            "split": data.train,
        },  # fmt: skip
        "hub_files": len(notes),
        "rows": sum(p["rows"] for p in parts),
        "parts": parts,
    }
    write_atomic(work / MANIFEST, json.dumps(manifest, indent=1).encode())
    shutil.rmtree(folder, ignore_errors=True)
    work.rename(folder)
    log.info(
        "copied %d records of %s (%d Hub file(s)) to %d local part(s) in %s",
        manifest["rows"],
        data.hub_name,
        len(notes),
        len(parts),
        folder,
    )


def _together(sync: Sync, step: Callable[[], object]) -> list:
    return on_every_rank(sync, step, "copying the Hub split")
