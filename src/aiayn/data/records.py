"""Records with fields: JSON Lines files read by the project's reader (a line is a record, as
in line files: data/source.py says why), tsv and parquet files by `datasets`' builders, and Hub
datasets streamed over the network.

A record's fields are found where data.src_field/tgt_field (or text_field/label_field) say,
dots reaching into nested records, and normalised as data/source.py describes. Opening reads
the first record, so that an empty corpus or a field that is not there fails before training.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.config import DataConfig
from aiayn.data.line_files import open_bytes
from aiayn.data.source import ReadShards, Source, expand_files
from aiayn.errors import DataError

if TYPE_CHECKING:
    from datasets import IterableDataset

# `datasets` is imported where a dataset is made, not here: a run that reads its token cache (a
# restart, most of all) or JSON Lines makes none.


class HubSource(Source):
    """A Hub dataset: its records arrive over the network as they are read, so a network
    error can come at any record (hub_errors)."""

    def _records(self, ds: IterableDataset) -> Iterator[dict]:
        with hub_errors(self.name):
            yield from super()._records(ds)


@contextmanager
def hub_errors(name: str) -> Iterator[None]:
    """A Hub or network error reading `name` as a DataError: one line that says what to check,
    exit 2. As an exception it would count as a fault: restarted in place, and blaming the
    node that met it, when any node would meet it (slurm/train.sbatch's node exclusion)."""
    try:
        yield
    except (OSError, RuntimeError, ValueError) as exc:  # requests' and huggingface_hub's
        script = "script" in str(exc)  # datasets 4 refusing a repository's loading script
        if isinstance(exc, RuntimeError | ValueError) and not script:
            raise  # not the Hub's: a bug, to be seen whole
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = (
            "datasets 4 and later load no dataset scripts: use a script-free (parquet) "
            "repository or a local copy"
            if script
            else "check data.hub_name, hub_config and the split, and the network; a node "
            "without internet needs HF_HUB_OFFLINE=1 and the dataset in the Hub cache, or a "
            "local copy (data.format jsonl or parquet), or the token cache built elsewhere"
        )
        text = f"{type(exc).__name__}: {first}"[:300]
        raise DataError(f"could not read the Hub dataset {name} ({text}): {hint}") from None


def _string_features(types: dict[str, str]):
    from datasets import Features, Value

    return Features({column: Value(t) for column, t in types.items()})


def record_source(cfg: DataConfig, split: str, kind: str, local: list[str] | None = None) -> Source:
    """`split` of a Hub dataset, or of tsv, jsonl or parquet files (a path or a glob).

    `local`: the parquet parts of a Hub split's local copy (data/hub_copy.py), read in its
    place: the same records in the same order, from local files shared among ranks by file."""
    if cfg.format == "hub":
        name = f"{cfg.hub_name} ({cfg.hub_config or 'default'}, split {split})"
        if local:
            return Source(
                f"{name}, copied to {Path(local[0]).parent}",
                _normalizer(cfg, kind, name),
                make=lambda: _stream("parquet", local, {}),
                shard_files=[[f] for f in local],
            )

        def make() -> IterableDataset:
            import datasets

            pinned = {"revision": cfg.hub_revision} if cfg.hub_revision else {}
            with hub_errors(name):
                return datasets.load_dataset(
                    cfg.hub_name, cfg.hub_config, split=split, streaming=True, **pinned
                )

        return HubSource(name, _normalizer(cfg, kind, name), make=make)
    files = expand_files(split)
    name = ", ".join(files)
    if all(Path(f).stat().st_size == 0 for f in files):  # datasets' builders fail obscurely
        raise DataError(f"corpus {name} is empty: it holds no records")
    shard_files = [[f] for f in files]
    if cfg.format == "jsonl":
        normalize = _normalizer(cfg, kind, name)
        return Source(name, normalize, read=_jsonl_reader(files), shard_files=shard_files)
    if cfg.format == "tsv":
        # No header, no quoting (a '"' is text, not a quote), and no NA guessing ("NA" is text).
        columns = {"seq2seq": ["src", "tgt"], "lm": ["text"], "classifier": ["text", "label"]}[kind]
        types = {"src": "string", "tgt": "string", "text": "string", "label": "int64"}
        kw = dict(
            delimiter="\t",
            header=None,
            names=columns,
            quoting=3,
            na_filter=False,
            features=_string_features({c: types[c] for c in columns}),
        )
        fields = {"seq2seq": ("src", "tgt"), "lm": ("text",), "classifier": ("text", "label")}
        normalize = _FieldReader(kind, [[f] for f in fields[kind]], name)
        builder = "csv"
    else:
        kw, normalize, builder = {}, _normalizer(cfg, kind, name), "parquet"
    return Source(
        name, normalize, make=lambda: _stream(builder, files, kw), shard_files=shard_files
    )


_UNREAD_COMPRESSION = (".zst", ".lz4", ".zip", ".tar")


def _jsonl_reader(files: list[str]) -> ReadShards:
    """The reader of JSON Lines files, each file a shard: one JSON object a line, blank lines
    skipped; plain, or compressed by gzip, bzip2 or xz. A field a record lacks reads as empty
    (the normaliser's `_get`)."""
    for f in files:
        if f.endswith(_UNREAD_COMPRESSION):
            raise DataError(
                f"{f}: data.format jsonl reads plain, .gz, .bz2 or .xz files; decompress it, or "
                "compress it with gzip"
            )

    def read(shards: list[int] | None) -> Iterator[dict]:
        for path in files if shards is None else [files[i] for i in shards]:
            with open_bytes(path) as fh:
                for lineno, line in enumerate(fh, start=1):
                    if line.strip():
                        yield _json_record(line, path, lineno)

    return read


def _json_record(line: bytes, path: str, lineno: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError as exc:  # UnicodeDecodeError is one
        raise DataError(
            f"{path} line {lineno} is not a JSON record ({exc}); data.format jsonl reads one "
            "JSON object a line, in UTF-8 (a JSON array or a pretty-printed file is not JSON "
            "Lines: convert it, e.g. `jq -c '.[]' FILE > FILE.jsonl`)"
        ) from None
    if not isinstance(record, dict):
        raise DataError(
            f"{path} line {lineno} holds a JSON {type(record).__name__}, not an object; "
            "data.format jsonl reads one JSON object a line (a JSON array is not JSON Lines: "
            "convert it, e.g. `jq -c '.[]' FILE > FILE.jsonl`)"
        )
    return record


def _stream(builder: str, files: list[str], kw: dict) -> IterableDataset:
    import datasets

    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kw)


def _normalizer(cfg: DataConfig, kind: str, name: str) -> _FieldReader:
    if kind == "seq2seq":
        # WMT-style hub records nest both sides under "translation"; find them there by default.
        paths = [
            [field] if field else [lang, f"translation.{lang}"]
            for field, lang in ((cfg.src_field, cfg.src_lang), (cfg.tgt_field, cfg.tgt_lang))
        ]
    elif kind == "lm":
        paths = [[cfg.text_field]]
    else:
        paths = [[cfg.text_field], [cfg.label_field]]
    return _FieldReader(kind, paths, name)


class _FieldReader:
    """A record's fields, normalised (data/source.py). A field a record lacks reads as empty,
    as `datasets` gives None for a field that some other record of the file has; `check`, for
    the first record, says which field is not there and how to name another."""

    KEYS = {"seq2seq": ("src", "tgt"), "lm": ("text",), "classifier": ("text", "label")}

    def __init__(self, kind: str, paths: list[list[str]], name: str):
        self.keys, self.paths, self.name = self.KEYS[kind], paths, name

    def check(self, rec: dict) -> dict:
        return self._read(rec, strict=True)

    def __call__(self, rec: dict) -> dict:
        return self._read(rec, strict=False)

    def _read(self, rec: dict, strict: bool) -> dict:
        pairs = zip(self.keys, self.paths, strict=True)
        out = {key: _get(rec, candidates, self.name, strict) for key, candidates in pairs}
        for key in self.keys:
            if key == "label":
                out[key] = _label(out[key], self.name)
            else:
                out[key] = "" if out[key] is None else str(out[key]).strip()
        return out


def _get(rec: dict, candidates: list[str], name: str, strict: bool):
    for path in candidates:
        if path in rec:  # a key that itself holds a dot
            return rec[path]
        node = rec
        for part in path.split("."):
            if not (isinstance(node, dict) and part in node):
                break
            node = node[part]
        else:
            return node
    if not strict:
        return None
    raise DataError(
        f"{name}: a record has no field {' or '.join(candidates)} (it has {sorted(rec)}); set "
        "data.src_field/tgt_field (dots reach into nested records: translation.de) or "
        "data.text_field/label_field"
    )


def _label(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise DataError(f"{name}: label {value!r} is not an integer class; check data.label_field")
    try:
        return int(value)
    except ValueError:
        raise DataError(
            f"{name}: label {value!r} is not an integer class; map labels to 0..num_classes-1"
        ) from None


def check_first_record(source: Source) -> None:
    """Fail at open, not mid-run: an empty corpus, or fields that are not where config says."""
    first = next(source.raw(), None)
    if first is None:
        raise DataError(f"corpus {source.name} is empty: it holds no records")
    source.normalize.check(first)
