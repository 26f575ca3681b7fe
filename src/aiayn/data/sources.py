"""Streaming corpus sources: every format becomes a Hugging Face `IterableDataset`.

A Source checks its files when it is opened (missing, mis-aligned, empty, invalid UTF-8) so a
bad corpus fails before training starts, then hands out fresh streams on demand. Records come
out normalised: {"src", "tgt"} (seq2seq), {"text"} (lm), {"text", "label"} (classifier).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.config import DataConfig
from aiayn.errors import DataError
from aiayn.files import count_hashed

if TYPE_CHECKING:
    from datasets import IterableDataset

# `datasets` is imported where a stream is made, not here: it takes about 0.5 s, and a run
# that reads its token cache (a restart, most of all) makes no stream.

log = logging.getLogger(__name__)

KINDS = ("seq2seq", "lm", "classifier")
_SCAN_BLOCK = 1 << 22  # bytes read at a time when checking a file


class Source:
    """One split of a corpus. `dataset(state)` gives a fresh stream; `records` normalises it."""

    def __init__(
        self,
        name: str,
        make: Callable[[], IterableDataset],
        normalize: Callable[[dict], dict],
        invalid_utf8: int = 0,
        check_lines: Callable[[list[int] | None, dict | None], int] | None = None,
        shard_files: list[list[str]] | None = None,
    ):
        self.name = name
        self._make = make
        self.normalize = normalize
        self.invalid_utf8 = invalid_utf8
        """Lines (pairs, for parallel data) skipped in one pass because they are not UTF-8."""
        self._check_lines = check_lines
        self.shard_files = shard_files
        """The local files of each shard, where shard i reads files of its own (None: not
        known, e.g. a Hub dataset)."""

    def shard(self, num_shards: int, index: int) -> IterableDataset:
        """Shard `index` of `num_shards` (contiguous: files, or a Hub repository's files, in
        order), for a rank that reads only its share."""
        return self._make().shard(num_shards, index, contiguous=True)

    def check(self, hashes: dict[str, str] | None = None) -> None:
        """Read every line-aligned file through (alignment, UTF-8, some usable line) and count
        the lines that will be skipped; open_split does it unless told check=False. `hashes`
        gets each file's sha256 by resolved path, taken in the same read."""
        if self._check_lines:
            self.invalid_utf8 = self._check_lines(None, hashes)

    def check_shard(self, index: int, hashes: dict[str, str] | None = None) -> int:
        """For a source opened with check=False: check the line-aligned files of one shard as
        the whole check would (alignment, UTF-8) and return its lines that will be skipped;
        `hashes` as for check."""
        return self._check_lines([index], hashes) if self._check_lines else 0

    def dataset(self, state: dict | None = None) -> IterableDataset:
        # A new object each time: IterableDataset keeps a loaded state for every later pass.
        ds = self._make()
        if state is not None:
            ds.load_state_dict(state)
        return ds

    def records(self, ds: IterableDataset) -> Iterator[dict]:
        return map(self.normalize, ds)

    def __iter__(self) -> Iterator[dict]:
        return self.records(self.dataset())


class HubSource(Source):
    """A Hub dataset: its records arrive over the network as they are read, so a network
    error can come at any record (hub_errors)."""

    def records(self, ds: IterableDataset) -> Iterator[dict]:
        with hub_errors(self.name):
            yield from super().records(ds)


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


def open_split(cfg: DataConfig, split: str, kind: str, check: bool = True) -> Source:
    """Open `split` (a prefix, path, glob or hub split name) of the corpus described by cfg.

    check=False leaves out reading every line-aligned file through (alignment, UTF-8) at
    open: for a reader of some shards only, which checks those (Source.check_shard)."""
    if kind not in KINDS:
        raise DataError(f"unknown model kind {kind!r}; choose from {KINDS}")
    if not split:
        raise DataError("no split given: set data.train (and data.valid / data.test to use them)")
    if cfg.format == "parallel":
        if kind != "seq2seq":
            raise DataError(f"data.format parallel is for seq2seq; a {kind} model reads text/jsonl")
        return _parallel_source(cfg, split, check)
    if cfg.format == "text":
        if kind != "lm":
            raise DataError(
                f"data.format text holds bare documents (lm); a {kind} model needs fields: use "
                "data.format tsv, jsonl or parquet"
            )
        return _text_source(cfg, split, check)
    source = _builder_source(cfg, split, kind)
    _check_first_record(source)
    return source


def source_files(cfg: DataConfig, split: str) -> list[str]:
    """The local files a split reads, in reading order (none for a hub dataset)."""
    if cfg.format == "hub":
        return []
    if cfg.format == "parallel":
        return [p for pair in _parallel_files(split, cfg.src_lang, cfg.tgt_lang) for p in pair]
    return _expand(split)


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


def source_identity(cfg: DataConfig, split: str, kind: str) -> dict:
    """What names the records of `split` without reading them: the hub dataset, or each local
    file's resolved path and size, and the fields read. A saved streaming position counts
    records, so it is only meaningful for the same identity (data/loader.py). Sizes, not
    checksums: every rank would read the whole corpus at every start to hash it."""
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
            {"path": str(f.resolve()), "bytes": f.stat().st_size} for f in files if f.is_file()
        ]
    return identity


def sample_sentences(cfg: DataConfig, kind: str, n: int, seed: int) -> list[str]:
    """A deterministic, shuffled sample of at most n sentences of the training split.

    Reservoir sampling (Algorithm R) over the stream: memory stays at n sentences however large
    the corpus. Both sides go in for seq2seq: the vocabulary is joint (§3.4). Reading stops
    after 20 n sentences so that a web-scale stream does not take hours (WMT14 en-de, 9M
    sentences, is read whole for the default n of 1M).
    """
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for rec in open_split(cfg, cfg.train, kind):
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


# ---- line-aligned files (parallel, text) --------------------------------------------------


def _parallel_source(cfg: DataConfig, split: str, check: bool = True) -> Source:
    pairs = [list(p) for p in _parallel_files(split, cfg.src_lang, cfg.tgt_lang)]
    kwargs = {"pairs": pairs, "strict": cfg.on_invalid_utf8 == "error"}
    # No `features=`: datasets would re-encode every example through them, at many times the
    # cost of reading it (benchmarks/README.md). The generator yields plain strings anyway.
    make = partial(_from_generator, _parallel_examples, kwargs)
    return _line_source(cfg, split, make, pairs, check)


def _text_source(cfg: DataConfig, split: str, check: bool = True) -> Source:
    files = _expand(split)
    kwargs = {"files": files, "strict": cfg.on_invalid_utf8 == "error"}
    make = partial(_from_generator, _text_examples, kwargs)
    return _line_source(cfg, split, make, [[f] for f in files], check)


def _line_source(cfg: DataConfig, split: str, make, groups: list, check: bool) -> Source:
    """A source of line-aligned files; each group (a file pair, or a file) is one shard of the
    generator's stream, in order (datasets shards a list argument by its items)."""

    def check_lines(shards: list[int] | None, hashes: dict | None) -> int:  # None: all
        chosen = groups if shards is None else [groups[i] for i in shards]
        # The whole source must hold some usable line; one shard may hold none.
        return _check_lines(chosen, split, cfg.on_invalid_utf8, shards is None, hashes)

    source = Source(
        split, make, normalize=lambda rec: rec, check_lines=check_lines, shard_files=groups
    )
    if check:
        source.check()
    return source


def _from_generator(generator: Callable, kwargs: dict) -> IterableDataset:
    from datasets import IterableDataset

    return IterableDataset.from_generator(generator, gen_kwargs=kwargs)


def _check_lines(
    groups: list,
    split: str,
    on_invalid_utf8: str,
    require_usable: bool = True,
    hashes: dict[str, str] | None = None,
) -> int:
    """Check groups of line-aligned files (a pair, or one file) before training reads them:
    equal line counts, some usable line, UTF-8. Returns the lines (pairs) that will be skipped.
    `hashes` gets each file's sha256 (of its own bytes, compressed or not), from the same read."""
    skipped = usable = 0
    for group in groups:
        scans = []
        for path in group:
            digest = None if hashes is None else hashlib.sha256()
            scans.append(_scan(path, digest))
            if digest is not None:
                hashes[str(Path(path).resolve())] = digest.hexdigest()
        if len({n for n, _ in scans}) > 1:
            (a, (na, _)), (b, (nb, _)) = zip(group, scans, strict=True)
            raise DataError(
                f"parallel files are not line-aligned: {a} has {na} lines but {b} has {nb}; "
                "line i of one must be the translation of line i of the other"
            )
        bad = sorted({line for _, lines in scans for line in lines})
        if bad and on_invalid_utf8 == "error":
            path = next(p for p, (_, lines) in zip(group, scans, strict=True) if bad[0] in lines)
            raise utf8_error(path, bad[0])
        skipped += len(bad)
        usable += scans[0][0] - len(bad)
    if usable == 0 and require_usable:
        names = ", ".join(p for group in groups for p in group)
        raise DataError(f"corpus {split} is empty: {names} hold no usable lines")
    if skipped:
        log.warning("%s: skipping %d lines (pairs) that are not valid UTF-8", split, skipped)
    return skipped


def _parallel_examples(pairs: list[list[str]], strict: bool) -> Iterator[dict]:
    # `pairs` is a list, so datasets treats each (src, tgt) file pair as one shard.
    for src_path, tgt_path in pairs:
        with open_bytes(src_path) as fs, open_bytes(tgt_path) as ft:
            # Line counts were compared when the source was opened.
            for lineno, (bs, bt) in enumerate(zip(fs, ft, strict=False), start=1):
                src = decode_line(bs, src_path, lineno, strict)
                tgt = decode_line(bt, tgt_path, lineno, strict) if src is not None else None
                if tgt is not None:
                    yield {"src": src, "tgt": tgt}


def _text_examples(files: list[str], strict: bool) -> Iterator[dict]:
    for path in files:
        with open_bytes(path) as fh:
            for lineno, line in enumerate(fh, start=1):
                text = decode_line(line, path, lineno, strict, strip=False)
                if text is not None:
                    yield {"text": text}


def decode_line(
    line: bytes, path: str, lineno: int, strict: bool, strip: bool = True
) -> str | None:
    """The line as text, or None when it is not UTF-8 and such lines are skipped. strip=False
    keeps its spaces (an lm's text is scored character for character) and drops only the line
    break."""
    try:
        text = line.decode("utf-8")
        return text.strip() if strip else text.rstrip("\r\n")
    except UnicodeDecodeError:
        if strict:
            raise utf8_error(path, lineno) from None
        return None


def _parallel_files(prefix: str, src_lang: str, tgt_lang: str) -> list[tuple[str, str]]:
    """(src, tgt) file pairs of a prefix, or of every prefix a glob matches; .gz allowed."""
    if glob.has_magic(prefix):
        found = set()
        for suffix in (f".{src_lang}", f".{src_lang}.gz"):
            found |= {p[: -len(suffix)] for p in glob.glob(prefix + suffix)}
        if not found:
            raise DataError(
                f"no corpus files match {prefix}.{src_lang} or {prefix}.{src_lang}.gz; check the "
                "split prefix in data.train/valid/test and data.src_lang"
            )
        prefixes = sorted(found)
    else:
        prefixes = [prefix]
    pairs, missing = [], []
    for p in prefixes:
        paths = [_existing(p, lang) for lang in (src_lang, tgt_lang)]
        missing += [
            f"{p}.{lang} (or {p}.{lang}.gz)"
            for lang, x in zip((src_lang, tgt_lang), paths, strict=True)
            if x is None
        ]
        pairs.append(tuple(paths))
    if missing:
        raise DataError(
            f"corpus file not found: looked for {', '.join(missing)}; check data.train/valid/test "
            "(a file prefix) and data.src_lang/tgt_lang (the file suffixes)"
        )
    return pairs


def _existing(prefix: str, lang: str) -> str | None:
    for path in (f"{prefix}.{lang}", f"{prefix}.{lang}.gz"):
        if Path(path).is_file():
            return path
    return None


def _expand(spec: str) -> list[str]:
    files = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
    files = [f for f in files if Path(f).is_file()]
    if not files:
        raise DataError(f"corpus file not found: {spec}; check data.train/valid/test")
    return files


def open_bytes(path: str, digest=None):
    """A corpus file's lines as bytes (decompressed, for .gz). With a hashlib `digest`, the
    file's own bytes are hashed as they are read, and to its end."""
    if digest is not None:
        return _hashing_open(path, digest)
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


class _Hashed:
    """A binary file whose bytes are hashed as they are read."""

    def __init__(self, fh, digest):
        self._fh, self._digest = fh, digest

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self._digest.update(data)
        count_hashed(len(data))
        return data


@contextmanager
def _hashing_open(path: str, digest) -> Iterator:
    with open(path, "rb") as raw:
        hashed = _Hashed(raw, digest)
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=hashed, mode="rb") as fh:
                yield fh
        else:
            yield hashed
        while hashed.read(_SCAN_BLOCK):  # what the reader left (after gzip's last member)
            pass


def _scan(path: str, digest=None) -> tuple[int, list[int]]:
    """Line count of a file and the 1-based numbers of its lines that are not UTF-8; with a
    hashlib `digest`, the file's sha256 from the same read.

    Reads blocks cut at a newline and decodes each whole block: fast on clean files; only a
    block that fails is split into lines to find the culprits.
    """
    n, bad, carry = 0, [], b""
    with open_bytes(path, digest) as fh:
        while True:
            block = fh.read(_SCAN_BLOCK)
            data = carry + block
            cut = len(data) if not block else data.rfind(b"\n") + 1
            whole, carry = data[:cut], data[cut:]
            try:
                whole.decode("utf-8")
            except UnicodeDecodeError:
                bad += [n + i + 1 for i, line in enumerate(whole.split(b"\n")) if not _utf8(line)]
            n += whole.count(b"\n") + (1 if whole and not whole.endswith(b"\n") else 0)
            if not block:
                return n, bad


def _utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def utf8_error(path: str, lineno: int) -> DataError:
    return DataError(
        f"{path} line {lineno} is not valid UTF-8; fix or remove that line, or set "
        "data.on_invalid_utf8=skip to skip such lines (they are counted)"
    )


# ---- records with fields (tsv, jsonl, parquet, hub) ----------------------------------------


def _string_features(types: dict[str, str]):
    from datasets import Features, Value

    return Features({column: Value(t) for column, t in types.items()})


def _builder_source(cfg: DataConfig, split: str, kind: str) -> Source:
    if cfg.format == "hub":
        name = f"{cfg.hub_name} ({cfg.hub_config or 'default'}, split {split})"

        def make() -> IterableDataset:
            import datasets

            pinned = {"revision": cfg.hub_revision} if cfg.hub_revision else {}
            with hub_errors(name):
                return datasets.load_dataset(
                    cfg.hub_name, cfg.hub_config, split=split, streaming=True, **pinned
                )

        return HubSource(name, make, _normalizer(cfg, kind, name))
    files = _expand(split)
    name = ", ".join(files)
    if all(Path(f).stat().st_size == 0 for f in files):  # datasets fails obscurely on these
        raise DataError(f"corpus {name} is empty: it holds no records")
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
        normalize = _field_reader(kind, [[f] for f in fields[kind]], name)
        builder = "csv"
    else:
        kw, normalize = {}, _normalizer(cfg, kind, name)
        builder = {"jsonl": "json", "parquet": "parquet"}[cfg.format]

    def make() -> IterableDataset:
        import datasets

        return datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kw)

    return Source(name, make, normalize, shard_files=[[f] for f in files])


def _normalizer(cfg: DataConfig, kind: str, name: str) -> Callable[[dict], dict]:
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
    return _field_reader(kind, paths, name)


def _field_reader(kind: str, paths: list[list[str]], name: str) -> Callable[[dict], dict]:
    keys = {"seq2seq": ("src", "tgt"), "lm": ("text",), "classifier": ("text", "label")}[kind]

    def normalize(rec: dict) -> dict:
        out = {
            key: _get(rec, candidates, name) for key, candidates in zip(keys, paths, strict=True)
        }
        for key in keys:
            if key == "label":
                out[key] = _label(out[key], name)
            else:
                out[key] = "" if out[key] is None else str(out[key]).strip()
        return out

    return normalize


def _get(rec: dict, candidates: list[str], name: str):
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


def _check_first_record(source: Source) -> None:
    """Fail at open, not mid-run: an empty corpus, or fields that are not where config says."""
    first = next(iter(source.dataset()), None)
    if first is None:
        raise DataError(f"corpus {source.name} is empty: it holds no records")
    source.normalize(first)
