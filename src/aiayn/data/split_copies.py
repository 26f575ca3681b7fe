"""The run's own copies of its validation and test splits, so that a restart reads nothing but
the run directory and the token cache, and `aiayn evaluate` of the run's checkpoints no source.

The first start copies each split's records, as the loaders see them (normalised fields, empty
and undecodable lines already handled), into `run_dir/data/valid.jsonl`, on rank 0, with what
it was copied from; every later start validates on the copy. A corpus moved away, a Hub that
cannot be reached from the compute nodes, or a dev set edited mid-run then changes nothing:
the run keeps scoring the same sentences, so its curves stay comparable. A dev set is small
(newstest2013: 3,000 pairs, under 1 MB), so a copy costs nothing worth caching in tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

from aiayn.config import Config
from aiayn.data.splits import open_split, source_identity
from aiayn.errors import AiaynError, DataError
from aiayn.runtime.durable import write_atomic

log = logging.getLogger(__name__)

COPY_DIR = "data"  # under run_dir
# The copy's fields: the names the loaders normalise every format's records to.
FIELDS = {
    "seq2seq": {"src_field": "src", "tgt_field": "tgt"},
    "lm": {"text_field": "text"},
    "classifier": {"text_field": "text", "label_field": "label"},
}


def with_run_copy(
    cfg: Config, split: str, decide: Callable = lambda choose: choose(), name: str | None = None
) -> Config:
    """`cfg` with data.<split> read from the run's copy, which rank 0 makes from the source if
    the run has none yet (DistEnv.decide); all ranks raise together if it cannot be made. The
    copy is data/<name>.jsonl (default: the split's name; a source's own dev set has its own)."""
    path = Path(cfg.run_dir) / COPY_DIR / f"{name or split}.jsonl"
    decide(lambda: _copied(cfg, split, path))
    return _reading(cfg, split, path)


def copied_split(cfg: Config, split: str, run_dir: Path) -> Config | None:
    """`cfg` reading data.<split> from the copy a training run made in `run_dir`, where it made
    one of the split the config names (an override that names another split reads that);
    None where there is none. Makes no copy: evaluating must not write into a run."""
    path = run_dir / COPY_DIR / f"{split}.jsonl"
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if not path.is_file() or meta.get("split") != getattr(cfg.data, split, None):
        return None
    _warn_if_changed(cfg, split, meta, path)
    return _reading(cfg, split, path)


def _reading(cfg: Config, split: str, path: Path) -> Config:
    data = dataclasses.replace(
        cfg.data, format="jsonl", **{split: str(path)}, **FIELDS[cfg.model.kind]
    )
    return dataclasses.replace(cfg, data=data)


def _copied(cfg: Config, split: str, path: Path) -> None:
    try:
        _ensure_copy(cfg, split, path)
    except (AiaynError, OSError) as exc:
        raise DataError(f"copying data.{split} into the run: {exc}") from None


def _ensure_copy(cfg: Config, split: str, path: Path) -> None:
    spec, kind = getattr(cfg.data, split), cfg.model.kind
    meta_path = path.with_suffix(".json")
    if path.is_file() and meta_path.is_file():
        _warn_if_changed(cfg, split, json.loads(meta_path.read_text()), path)
        return
    records = list(open_split(cfg.data, spec, kind))
    if not records:
        raise DataError(f"data.{split} ({spec}) holds no records")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "split": spec,
        "format": cfg.data.format,
        "source": source_identity(cfg.data, spec, kind),
    }
    lines = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    write_atomic(path, lines.encode())
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())  # last: marks the copy done
    log.info("data.%s copied into the run: %s (%d records)", split, path, len(records))


def _warn_if_changed(cfg: Config, split: str, meta: dict, path: Path) -> None:
    """A source still there that differs from the copy is reported; the run keeps its copy."""
    spec = getattr(cfg.data, split)
    try:
        now = {"split": spec, "format": cfg.data.format}
        now["source"] = source_identity(cfg.data, spec, cfg.model.kind)
    except (AiaynError, OSError):  # gone or unreachable: the copy is what the run reads
        return
    if now["source"].get("files") == [] or now == meta:
        return
    log.warning(
        "data.%s differs from the copy the run made at its first start (%s); the run goes on "
        "reading its copy, so that its scores stay comparable. For the new one, delete "
        "%s and %s",
        split,
        meta["split"],
        path,
        path.with_suffix(".json"),
    )
