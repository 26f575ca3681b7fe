"""Line files: parallel data (a file per side, line i of one the translation of line i of the
other) and text (one document or line of text per line), plain or gzip.

Opening checks the files (missing, mis-aligned, empty, invalid UTF-8) so a bad corpus fails
before training starts, in one read that also takes each file's sha256 for the token cache.
Lines that are not UTF-8 raise, or are skipped and counted (data.on_invalid_utf8).
"""

from __future__ import annotations

import bz2
import glob
import gzip
import hashlib
import logging
import lzma
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from aiayn.config import DataConfig
from aiayn.corpora.catalog import missing_corpus_hint
from aiayn.data.source import Source, expand_files
from aiayn.errors import DataError
from aiayn.runtime.durable import count_hashed

log = logging.getLogger(__name__)

_SCAN_BLOCK = 1 << 22  # bytes read at a time when checking a file


def parallel_source(cfg: DataConfig, split: str, check: bool = True) -> Source:
    """The (source, target) file pairs of `split`, a prefix or a glob of prefixes."""
    pairs = [list(p) for p in parallel_files(split, cfg.src_lang, cfg.tgt_lang)]
    return _line_source(cfg, split, _parallel_examples, "pairs", pairs, pairs, check)


def text_source(cfg: DataConfig, split: str, check: bool = True) -> Source:
    """The text files of `split`, a path or a glob."""
    files = expand_files(split)
    return _line_source(cfg, split, _text_examples, "files", files, [[f] for f in files], check)


def _line_source(
    cfg: DataConfig,
    split: str,
    generator: Callable[..., Iterator[dict]],
    argument: str,
    items: list,
    groups: list,
    check: bool,
) -> Source:
    """A source of line-aligned files read by `generator(argument=items, strict=...)`; each
    group (a file pair, or a file: items[i]) is one shard of its stream, in order."""
    strict = cfg.on_invalid_utf8 == "error"

    def read(shards: list[int] | None) -> Iterator[dict]:
        chosen = items if shards is None else [items[i] for i in shards]
        return generator(**{argument: chosen, "strict": strict})

    def check_lines(shards: list[int] | None, hashes: dict | None) -> int:  # None: all
        chosen = groups if shards is None else [groups[i] for i in shards]
        # The whole source must hold some usable line; one shard may hold none.
        return _check_lines(chosen, split, cfg.on_invalid_utf8, shards is None, hashes)

    source = Source(split, lambda rec: rec, read=read, check_lines=check_lines, shard_files=groups)
    if check:
        source.check()
    return source


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
            raise misaligned(group, [n for n, _ in scans])
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


def parallel_files(prefix: str, src_lang: str, tgt_lang: str) -> list[tuple[str, str]]:
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
    pairs, missing, hint = [], [], ""
    for p in prefixes:
        paths = [_existing(p, lang) for lang in (src_lang, tgt_lang)]
        if None in paths and not hint:
            hint = missing_corpus_hint(p)  # a recipe's corpus not yet downloaded
        missing += [
            f"{p}.{lang} (or {p}.{lang}.gz)"
            for lang, x in zip((src_lang, tgt_lang), paths, strict=True)
            if x is None
        ]
        pairs.append(tuple(paths))
    if missing:
        raise DataError(
            f"corpus file not found: looked for {', '.join(missing)}; check data.train/valid/test "
            f"(a file prefix) and data.src_lang/tgt_lang (the file suffixes){hint}"
        )
    return pairs


def _existing(prefix: str, lang: str) -> str | None:
    for path in (f"{prefix}.{lang}", f"{prefix}.{lang}.gz"):
        if Path(path).is_file():
            return path
    return None


_DECOMPRESS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # a path or a file


def open_bytes(path: str, digest=None):
    """A corpus file's lines as bytes (decompressed, for .gz, .bz2 and .xz). With a hashlib
    `digest`, the file's own bytes are hashed as they are read, and to its end."""
    if digest is not None:
        return _hashing_open(path, digest)
    opener = _DECOMPRESS.get(Path(path).suffix)
    return open(path, "rb") if opener is None else opener(path, "rb")


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
        opener = _DECOMPRESS.get(Path(path).suffix)
        if opener is not None:
            with opener(hashed, "rb") as fh:
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


def misaligned(pair: list[str], lines: list[int]) -> DataError:
    return DataError(
        f"parallel files are not line-aligned: {pair[0]} has {lines[0]} lines but {pair[1]} has "
        f"{lines[1]}; line i of one must be the translation of line i of the other"
    )


def utf8_error(path: str, lineno: int) -> DataError:
    return DataError(
        f"{path} line {lineno} is not valid UTF-8; fix or remove that line, or set "
        "data.on_invalid_utf8=skip to skip such lines (they are counted)"
    )
