"""The Source type: one split of a corpus, a Hugging Face `IterableDataset` made on demand.

Its records come out normalised: {"src", "tgt"} (seq2seq), {"text"} (lm), {"text", "label"}
(classifier). Sources are made by data/line_files.py (parallel and text files) and
data/records.py (tsv, jsonl, parquet, Hub), and opened through data/splits.py (open_split).
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.data.corpora import missing_corpus_hint
from aiayn.errors import DataError

if TYPE_CHECKING:
    from datasets import IterableDataset


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
        generate: Callable[[list[int] | None], Iterator[dict]] | None = None,
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
        # The records of some shards (None: all), unnormalised, in the dataset's order, read
        # by the source's own reader: for local line files, whose dataset only wraps that
        # reader, and JSON Lines files (data/records.py). What reads a split from start to end
        # (the token cache's build, a tokenizer's sample, the run's dev and test copies, an
        # evaluation pass) then needs no `datasets`, whose import is 0.7 s of a process; a
        # training StreamLoader keeps the dataset, for its saved positions.
        self._generate = generate

    @property
    def reads_directly(self) -> bool:
        """Whether the source reads its records without `datasets` (local line and JSON Lines
        files): then a pass from the start needs no dataset."""
        return self._generate is not None

    def shard(self, num_shards: int, index: int) -> IterableDataset:
        """Shard `index` of `num_shards` (contiguous: files, or a Hub repository's files, in
        order), for a rank that reads only its share."""
        return self._make().shard(num_shards, index, contiguous=True)

    def num_shards(self) -> int:
        """The shards the dataset has (a local source's: its file groups)."""
        if self.reads_directly and self.shard_files is not None:
            return len(self.shard_files)
        return self.dataset().num_shards

    def shard_records(self, num_shards: int, index: int) -> Iterator[dict]:
        """The normalised records of `shard(num_shards, index)`."""
        if self.reads_directly and num_shards == self.num_shards():
            return map(self.normalize, self._generate([index]))
        return self.records(self.shard(num_shards, index))

    def raw(self) -> Iterator[dict]:
        """Every record from the start, unnormalised: `iter(dataset())`, read directly where
        the source can."""
        return self._generate(None) if self.reads_directly else iter(self.dataset())

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
        if self.reads_directly:
            return map(self.normalize, self.raw())
        return self.records(self.dataset())  # a Hub source's records name its network errors


def expand_files(spec: str) -> list[str]:
    """The files a split names: a path, or every file a glob matches, sorted."""
    files = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
    files = [f for f in files if Path(f).is_file()]
    if not files:
        raise DataError(
            f"corpus file not found: {spec}; check data.train/valid/test"
            + missing_corpus_hint(spec)
        )
    return files
