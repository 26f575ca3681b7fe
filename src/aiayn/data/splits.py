"""Opening a split of a corpus: every format becomes a Source (data/source.py), a stream of
normalised records read by its format's one reader.

    parallel, text               line files (data/line_files.py): checked whole when opened
    tsv, jsonl, parquet, hub     records with fields (data/records.py): the first one read

A bad corpus (missing, mis-aligned, empty, invalid UTF-8, fields not where config says) fails
when it is opened, before training starts. This module also says what a split's records are
without reading them: its files, the fields read, its identity for a saved position.
"""

from __future__ import annotations

import random
from pathlib import Path

from aiayn.config import DataConfig
from aiayn.data import line_files, records
from aiayn.data.source import Source, expand_files
from aiayn.errors import DataError
from aiayn.runtime.durable import sha256_of

KINDS = ("seq2seq", "lm", "classifier")


def open_split(
    cfg: DataConfig, split: str, kind: str, check: bool = True, local: list[str] | None = None
) -> Source:
    """Open `split` (a prefix, path, glob or hub split name) of the corpus described by cfg.

    check=False leaves out reading every line-aligned file through (alignment, UTF-8) at
    open: for a reader of some shards only, which checks those (Source.check_shard). `local`:
    the parts of a Hub split's local copy, read in its place (data/hub_copy.py)."""
    if kind not in KINDS:
        raise DataError(f"unknown model kind {kind!r}; choose from {KINDS}")
    if not split:
        raise DataError("no split given: set data.train (and data.valid / data.test to use them)")
    if cfg.format == "parallel":
        if kind != "seq2seq":
            raise DataError(f"data.format parallel is for seq2seq; a {kind} model reads text/jsonl")
        return line_files.parallel_source(cfg, split, check)
    if cfg.format == "text":
        if kind != "lm":
            raise DataError(
                f"data.format text holds bare documents (lm); a {kind} model needs fields: use "
                "data.format tsv, jsonl or parquet"
            )
        return line_files.text_source(cfg, split, check)
    source = records.record_source(cfg, split, kind, local)
    records.check_first_record(source)
    return source


def source_files(cfg: DataConfig, split: str) -> list[str]:
    """The local files a split reads, in reading order (none for a hub dataset)."""
    if cfg.format == "hub":
        return []
    if cfg.format == "parallel":
        return [
            p for pair in line_files.parallel_files(split, cfg.src_lang, cfg.tgt_lang) for p in pair
        ]
    return expand_files(split)


def read_fields(cfg: DataConfig, kind: str) -> dict[str, str | None]:
    """The settings that say which fields (or file suffixes) a split's records come from, and
    so which side is the source: swapping src_lang and tgt_lang reads other records."""
    if cfg.format == "parallel":
        names: tuple[str, ...] = ("src_lang", "tgt_lang")  # the file suffixes
    elif cfg.format == "text":
        names = ()
    elif kind == "seq2seq":
        names = ("src_lang", "tgt_lang", "src_field", "tgt_field")
    else:
        names = ("text_field", "label_field") if kind == "classifier" else ("text_field",)
    return {name: getattr(cfg, name) for name in names}


def source_identity(cfg: DataConfig, split: str, kind: str, contents: bool = False) -> dict:
    """What names the records of `split` without reading them: the hub dataset, or each local
    file's resolved path and size, and the fields read. A saved streaming position counts
    records, so it is only meaningful for the same identity (data/stream_rows.py).

    `contents` adds each file's modification time and the sha256 of its first and last MiB
    (file_ends): an edit in place that keeps the size is then seen, at a cost that does not
    grow with the corpus. Not the whole files' sha256: every rank would read the whole corpus
    at every start to hash it."""
    identity: dict = {"fields": read_fields(cfg, kind)}
    if cfg.format == "hub":
        identity["hub"] = {
            "name": cfg.hub_name,
            "config": cfg.hub_config,
            "revision": cfg.hub_revision,
        }
    else:
        files = [Path(p) for p in source_files(cfg, split)]
        identity["files"] = [
            {"path": str(f.resolve()), "bytes": f.stat().st_size}
            | (file_ends(f) if contents else {})
            for f in files
            if f.is_file()
        ]
    return identity


_END = 1 << 20  # the bytes hashed at each end of a file


def file_ends(path: Path) -> dict:
    """A file's modification time and the sha256 of its first and last MiB (the whole file, twice,
    when it is smaller)."""
    size = path.stat().st_size
    return {
        "mtime_ns": path.stat().st_mtime_ns,
        "head_sha256": sha256_of(path, 0, min(size, _END)),
        "tail_sha256": sha256_of(path, max(0, size - _END), size),
    }


def sample_sentences(
    cfg: DataConfig, kind: str, n: int, seed: int, local: list[str] | None = None
) -> list[str]:
    """A deterministic, shuffled sample of at most n sentences of the training split.

    Reservoir sampling (Algorithm R) over the stream: memory stays at n sentences however large
    the corpus. Both sides go in for seq2seq: the vocabulary is joint (§3.4). Reading stops
    after 20 n sentences so that a web-scale stream does not take hours (WMT14 en-de, 9M
    sentences, is read whole for the default n of 1M). `local` as for open_split.
    """
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for rec in open_split(cfg, cfg.train, kind, local=local):
        if seen >= 20 * n:
            break
        for text in (rec["src"], rec["tgt"]) if kind == "seq2seq" else (rec["text"],):
            if not text:
                continue
            if seen < n:
                sample.append(text)
            else:
                j = rng.randrange(seen + 1)
                if j < n:
                    sample[j] = text
            seen += 1
    rng.shuffle(sample)
    return sample
