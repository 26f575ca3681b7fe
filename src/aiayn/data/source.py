"""The Source type: one split of a corpus, read the same way wherever it is read.

Its records come out normalised: {"src", "tgt"} (seq2seq), {"text"} (lm), {"text", "label"}
(classifier). Two readers, chosen by format, never both for one source:

- The project's own reader, for the formats where a line is a record (parallel and text line
  files, data/line_files.py; JSON Lines, data/records.py). Its position is the count of records
  read from the split's start: a resume reads and skips that many, the same count in training,
  evaluation, the token cache's build and a tokenizer's sample. `datasets` would only wrap this
  reader (its state for a generator is the same count), at the price of its import in every
  process that reads a split.
- A Hugging Face `IterableDataset` (tsv, parquet, and the Hub, streamed), where `datasets`' own
  builders and network reading are the point; its position is the dataset's `state_dict()`.

Sources are opened through data/splits.py (open_split).
"""

from __future__ import annotations

import glob
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiayn.corpora.catalog import missing_corpus_hint
from aiayn.errors import DataError

if TYPE_CHECKING:
    from datasets import IterableDataset

ReadShards = Callable[[list[int] | None], Iterator[dict]]
"""The raw records of some shards (None: all), in order: the project's reader of a source."""


class Stream:
    """A source's normalised records from a position on; `state()` is what resumes after the
    records taken so far besides their count (None for the project's reader: the count is
    all it needs)."""

    def __init__(self, records: Iterator[dict], state: Callable[[], dict] | None = None):
        self._records, self._state = records, state

    def __iter__(self) -> Iterator[dict]:
        return self._records

    def __next__(self) -> dict:
        return next(self._records)

    def state(self) -> dict | None:
        return None if self._state is None else self._state()


class Source:
    """One split of a corpus: `read` (the project's reader) or `make` (an IterableDataset),
    exactly one of them."""

    def __init__(
        self,
        name: str,
        normalize: Callable[[dict], dict],
        *,
        read: ReadShards | None = None,
        make: Callable[[], IterableDataset] | None = None,
        check_lines: Callable[[list[int] | None, dict | None], int] | None = None,
        shard_files: list[list[str]] | None = None,
    ):
        assert (read is None) != (make is None), "a source has one reader"
        self.name = name
        self.normalize = normalize
        self._read, self._make = read, make
        self.invalid_utf8 = 0
        """Lines (pairs, for parallel data) skipped in one pass because they are not UTF-8."""
        self._check_lines = check_lines
        self.shard_files = shard_files
        """The local files of each shard, where shard i reads files of its own (None: not
        known, e.g. a Hub dataset)."""

    def stream(self, state: dict | None = None, read: int = 0) -> Stream:
        """The normalised records after the first `read` of the split, or, for a dataset, from
        its saved `state` (the count then only says how many that is)."""
        if self._read is not None:
            return Stream(map(self.normalize, itertools.islice(self._read(None), read, None)))
        ds = self.dataset(state)
        return Stream(self._records(ds), ds.state_dict)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.stream())

    def raw(self) -> Iterator[dict]:
        """Every record from the start, unnormalised."""
        return self._read(None) if self._read is not None else iter(self.dataset())

    def num_shards(self) -> int:
        """The shards the source has (a local source's: its file groups)."""
        if self._read is not None:
            return len(self.shard_files)
        return self.dataset().num_shards

    def shard_records(self, index: int) -> Iterator[dict]:
        """The normalised records of shard `index` of `num_shards()` (contiguous: files, or a
        Hub repository's files, in order), for a rank that reads only its share."""
        if self._read is not None:
            return map(self.normalize, self._read([index]))
        return self._records(self.shard(self.num_shards(), index))

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

    # ---- a dataset's ------------------------------------------------------------------------

    def dataset(self, state: dict | None = None) -> IterableDataset:
        """The source's IterableDataset (a source of `datasets` only), at `state`."""
        # A new object each time: IterableDataset keeps a loaded state for every later pass.
        ds = self._make()
        if state is not None:
            ds.load_state_dict(state)
        return ds

    def shard(self, num_shards: int, index: int) -> IterableDataset:
        """Shard `index` of `num_shards` of the dataset (contiguous)."""
        return self._make().shard(num_shards, index, contiguous=True)

    def _records(self, ds: IterableDataset) -> Iterator[dict]:
        return map(self.normalize, ds)


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
