"""Which records each chunk of a streamed mixture takes (data.sources with data.cache false):
the mixture half of stream_rows.py.

Each source is read as an endless sequence of passes over its stream, from where it stopped:
a pass is the stream in its own order (there is no index to permute), so nothing repeats
within a pass, and a source taken in part in one epoch goes on from there in the next. An
epoch is data.epoch_size examples read (the sizes of streams are not known without reading
them whole), each source's count by largest remainder of the weights (mixture.py).

The epoch is read in chunks of data.shuffle_buffer examples, as the single-stream loader reads
one stream. Chunk c takes from each source a count drawn from what the epoch still owes it
(a multivariate hypergeometric draw seeded by (seed, epoch, c), so that the counts add up to
the epoch's exactly), in an order permuted with the same generator; the chunk is then
tokenised, planned and padded as one split's chunk is (a tagged source's tag is put by pad.py).
A chunk's anchor holds its start: the epoch's counts still owed, and every source's reader
position and pass. Every rank reads every source and builds the same chunks, so the batches are
the same at any world size, and a position resumes on another.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import numpy as np

from aiayn.config import Config
from aiayn.data.mixture import Mixture, as_train, mixture_fingerprint, tag_ids
from aiayn.data.position import Settings
from aiayn.data.splits import Source, open_split, source_identity
from aiayn.errors import DataError

log = logging.getLogger(__name__)

_CHUNKS = 0x63686B  # "chk": keeps the chunks' draws apart from other streams of the seed


class _Reader:
    """One source's stream, read pass after pass from a saved position."""

    def __init__(self, name: str, source: Source, pos: dict):
        self.name, self.source = name, source
        self.passes, self.state, self.read = pos["pass"], pos["state"], pos["read"]
        self._records = None

    def position(self) -> dict:
        return {"pass": self.passes, "state": self.state, "read": self.read}

    def take(self, n: int) -> list[dict]:
        """The next n records, each with its source's index in the pass ("_id")."""
        out: list[dict] = []
        while len(out) < n:
            if self._records is None:
                self._records = self.source.stream(self.state, self.read)
            got = list(itertools.islice(self._records, n - len(out)))
            for i, rec in enumerate(got):
                rec["_id"] = self.read + i
            out += got
            self.read += len(got)
            self.state = self._records.state()
            if len(out) < n:  # the pass ended: the next starts at the stream's beginning
                if self.read == 0:
                    raise DataError(f"data.sources {self.name} holds no records")
                self.passes, self.state, self.read, self._records = self.passes + 1, None, 0, None
        return out


class StreamMixture:
    """The streamed sources of data.sources, and the records of each chunk."""

    def __init__(self, cfg: Config, settings: Settings, chunk_size: int):
        if settings.kind == "lm":
            raise ValueError("a mixture of sources is for training seq2seq or classifier models")
        data = cfg.data
        self.run_cfg, self.cfg, self.settings, self.chunk_size = cfg, data, settings, chunk_size
        self.seed, self.rank = settings.seed, settings.rank
        self.names = [s.name for s in data.sources]
        self.tags = tag_ids(data, settings.tok)
        kind = settings.kind
        self.sources = [open_split(as_train(cfg, s).data, s.path, kind) for s in data.sources]
        self.counts: np.ndarray | None = None  # per epoch; known once the sizes are, if needed
        self.sizes: list[int] | None = None
        if data.epoch == "examples" and data.temperature is None:  # no size needed
            self._set_counts(None)
        self._shares: dict[tuple[int, int], list[float]] = {}  # (epoch, chunk): token shares

    def fingerprint(self) -> dict:
        """What names the mixture in a saved position."""
        cfg, kind = self.run_cfg, self.settings.kind
        identities = [
            source_identity(as_train(cfg, s).data, s.path, kind, contents=True)
            for s in self.cfg.sources
        ]
        return mixture_fingerprint(self.cfg, "source", identities)

    def start(self, epoch: int = 0) -> dict:
        first = {"pass": 0, "state": None, "read": 0}
        return {
            "epoch": epoch,
            "chunk": 0,
            "left": None,  # the epoch's counts, still owed: None at its start
            "sizes": None,
            "sources": [dict(first) for _ in self.names],
            "read": 0,
            "next_id": 0,
        }

    def _set_counts(self, sizes: list[int] | None) -> None:
        """Each source's examples per epoch, as mixture.py's Mixture counts them: from the
        weights alone for data.epoch examples (`sizes` None: the streams are not read), from
        the sources' sizes for every other definition and a temperature."""
        known = [1] * len(self.names) if sizes is None else sizes  # None: the weights decide
        mixture = Mixture.of(self.cfg, self.seed, known, None)
        self.counts, self.sizes = mixture.counts, sizes
        if self.rank == 0:
            mixture.log(self.cfg, sizes_known=sizes is not None)

    def _count_sizes(self) -> list[int]:
        """Every source's records, read through once: what data.epoch (other than examples)
        and data.temperature need of a stream. Once per run: the position keeps them."""
        log.info("counting each streamed source's records (data.epoch %s)", self.cfg.epoch)
        sizes = [sum(1 for _ in source) for source in self.sources]
        empty = [n for n, size in zip(self.names, sizes, strict=True) if not size]
        if empty:
            raise DataError(f"data.sources {', '.join(empty)} hold no records")
        return sizes

    def scalars(self, pos: dict) -> dict[str, float]:
        """Examples read from each source by the start of the chunk the group is in, the
        passes it has completed, and its share of that chunk's target tokens: the same on every
        rank (each reads every source)."""
        out = {}
        if self.counts is None:  # nothing read yet
            return out
        left = pos["left"] if pos["left"] is not None else self.counts
        shares_now = self._shares.get((pos["epoch"], pos["chunk"]), [0.0] * len(self.names))
        for s, name in enumerate(self.names):
            taken = pos["epoch"] * int(self.counts[s]) + int(self.counts[s]) - int(left[s])
            out[f"{name}/examples"] = float(taken)
            out[f"{name}/passes"] = float(pos["sources"][s]["pass"])
            out[f"{name}/token_share"] = shares_now[s]
        return out

    # ---- chunks -------------------------------------------------------------------------------

    def record_shares(self, anchor: dict, which: np.ndarray, tgt_lengths) -> None:
        """The chunk's target tokens per source (TensorBoard)."""
        if tgt_lengths is None:
            return
        tokens = np.bincount(which, tgt_lengths + 1, len(self.names))
        key = (anchor["epoch"], anchor["chunk"])
        # Built a few ahead of the loop (a thread): keep the last few chunks'.
        self._shares = {k: v for k, v in self._shares.items() if k >= (key[0], key[1] - 4)}
        self._shares[key] = (tokens / max(tokens.sum(), 1)).tolist()

    def chunks(self, pos: dict) -> Iterator[tuple[list[dict], dict]]:
        """(records, anchor) of every chunk from `pos` on, each record with its id in its
        source ("_id") and its source ("_source")."""
        if self.counts is None:  # the sizes: from the position, or counted once
            self._set_counts(pos["sizes"] or self._count_sizes())
        epoch, chunk = pos["epoch"], pos["chunk"]
        left = [int(c) for c in (self.counts if pos["left"] is None else pos["left"])]
        at = zip(self.names, self.sources, pos["sources"], strict=True)
        readers = [_Reader(name, source, where) for name, source, where in at]
        read, next_id = pos["read"], pos["next_id"]
        while True:
            while sum(left):
                rng = np.random.default_rng([self.seed, _CHUNKS, epoch, chunk])
                take = rng.multivariate_hypergeometric(left, min(self.chunk_size, sum(left)))
                anchor = dict(epoch=epoch, chunk=chunk, left=list(left), read=read)
                anchor["sizes"] = self.sizes
                anchor.update(sources=[r.position() for r in readers], next_id=next_id)
                parts = [r.take(int(k)) for r, k in zip(readers, take, strict=True)]
                for s, part in enumerate(parts):
                    for rec in part:
                        rec["_source"] = s
                # The sources interleaved in an order of the chunk's own, so that batches mix
                # them even with data.shuffle_buffer 0 (which keeps the order).
                order = np.repeat(np.arange(len(parts)), take)[rng.permutation(int(take.sum()))]
                cursors = [iter(part) for part in parts]
                examples = [next(cursors[s]) for s in order]
                yield examples, anchor
                left = [int(a - b) for a, b in zip(left, take, strict=True)]
                read, next_id, chunk = read + len(examples), next_id + len(examples), chunk + 1
            epoch, chunk, left, read, next_id = epoch + 1, 0, [int(c) for c in self.counts], 0, 0
