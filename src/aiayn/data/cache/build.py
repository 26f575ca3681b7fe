"""Building a token cache (data/cache/format.py) once, on every rank at a time.

Every rank calls ensure_cache, and the ranks go through the build in collective steps: each
opens its share of the source (data/cache/shares.py) and they compare how they share it; rank
0 starts the work directory; the ranks scan their byte ranges, where the files were cut, and
gather the counts; each tokenises its share into part files (data/cache/parts.py); each
writes its parts into the cache's arrays at their offsets in corpus order and hashes its share
of them, and rank 0 writes the manifest (data/cache/merge.py): the cache does not depend on the
number of ranks. A step that fails on any rank fails on all of them, together. An interrupted build
keeps its finished parts (and shards) in `<split>.partial/` and the next build reuses them if
they were made from the same fingerprint.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from aiayn.config import Config
from aiayn.data.cache.format import MANIFEST, TokenCache, cache_dir, fingerprint, open_cache
from aiayn.data.cache.merge import log_built, merge
from aiayn.data.cache.parts import read_text
from aiayn.data.cache.shares import Share, build_parts, gather_scans, open_share, scan_ranges
from aiayn.data.together import Sync, on_every_rank
from aiayn.errors import DataError
from aiayn.runtime.durable import write_atomic
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
    local: list[str] | None = None,
) -> TokenCache:
    """Open the cache of `split`, building it first if it is missing (or if rebuild). It
    lives in the folder `folder` of the cache directory (default: the split's name; a source of
    a mixture has its own, mixture.cache_folder). `local`: the parts of a Hub split's local
    copy, read in its place (data/hub_copy.py).

    Every rank calls it; the ranks share the tokenising and rank 0 writes the result. An
    existing cache that does not fit the config is refused, never silently replaced. Each rank
    verifies its share of an existing cache's checksums, 1/W of its bytes (one rank verifying
    for all would keep the others waiting while it reads the whole cache); rank 0 compares the
    corpus, and all stop together if any rank finds something wrong.
    """
    sync = sync or (lambda value: [value])
    root = cache_dir(cfg, folder or split)
    work = root.parent / f"{root.name}.partial"
    if not rebuild and sync((root / MANIFEST).is_file())[0]:  # as rank 0 sees it, for all
        # Rank 0 compares the corpus (file sizes and times); each rank verifies its share of
        # the arrays, and the gather that says whether any failed is the step's own.
        opened: list[TokenCache] = []
        _all_ok(
            sync,
            lambda: opened.append(
                open_cache(
                    root,
                    fingerprint(cfg, split, tok) if rank == 0 else None,
                    rank=rank,
                    world=world_size,
                )
            ),
        )
        if rank == 0 and work.is_dir():  # killed after the manifest, before the clean-up
            shutil.rmtree(work, ignore_errors=True)
        return opened[0]
    expected = fingerprint(cfg, split, tok)
    started = time.perf_counter()
    share: Share | None = None

    def open_mine() -> str:
        nonlocal share
        share = open_share(cfg, split, rank, world_size, local)
        return share.described()

    layouts = _all_ok(sync, open_mine)
    if len(set(layouts)) > 1:  # the ranks would go different ways and wait for each other
        raise DataError(
            f"the ranks see different corpus files for {split} (rank 0 would read {layouts[0]}, "
            f"rank {next(r for r, x in enumerate(layouts) if x != layouts[0])} "
            f"{next(x for x in layouts if x != layouts[0])}): every rank must see the same "
            "corpus: put it on storage all nodes share"
        )
    _all_ok(
        sync,
        lambda: _start_build(cfg, split, tok, root, work, rebuild, share) if rank == 0 else None,
    )
    if share.pieces:
        share.scans = gather_scans(_all_ok(sync, lambda: scan_ranges(share, work)))
    built = _all_ok(sync, lambda: build_parts(cfg, tok, share, work))
    merged = merge(
        work, root, built, expected, cfg, rank, world_size, lambda step: _all_ok(sync, step)
    )
    cache = open_cache(root, expected, verify=False)  # just written and hashed
    if rank == 0:
        seconds = time.perf_counter() - started
        log_built(cache, seconds, world_size, max(b["read"] for b in built), merged)
    return cache


def _all_ok(sync: Sync, step: Callable[[], object]) -> list:
    return on_every_rank(sync, step, "preparing the data")


def _start_build(
    cfg: Config, split: str, tok: Tokenizer, root: Path, work: Path, rebuild: bool, share: Share
) -> None:
    """Invalidate the old cache (its manifest goes first) and make the work directory.

    The work directory is stamped with the corpus files' sizes and modification times: parts
    left by a build of other files or settings are not reused. The files' sha256 come later,
    each from the rank that reads the file (`merge`), so that no rank reads the whole corpus
    to hash it. A second stamp says how the ranks share the reading: byte ranges depend on the
    number of ranks, so the shards of a build at another world size are not reused."""
    if rebuild and (root / MANIFEST).exists():
        log.info("rebuilding the token cache %s", root)
        (root / MANIFEST).unlink()
    stamp = json.dumps(fingerprint(cfg, split, tok), indent=1, sort_keys=True)
    if work.is_dir() and read_text(work / "build.json") != stamp:
        log.info("%s was left by a build from other settings: starting over", work)
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "build.json").is_file():
        write_atomic(work / "build.json", stamp.encode())
    if read_text(work / "layout.json") != share.layout:
        for path in work.glob("shard_*"):
            path.unlink()
        write_atomic(work / "layout.json", share.layout.encode())
