"""Streamed splits as a row source (data/loader.py): each chunk of data.shuffle_buffer examples
is one segment, tokenised as it is read into a table of the token cache's shape (pad.py) and
planned as a cache's epoch of one window is (plan.py). We do not use datasets'
`.shuffle(buffer_size)`: its buffer is not restored by `state_dict` (NOTES.md), so resume would
not be exact.

One split, or a mixture's sources (data.sources, stream_mixture.py says which records each
chunk takes). The anchor of a chunk (where a saved position starts) is its epoch and index, the
records read before it, the ids handed out before it, and the source's state at its start
(a dataset's `state_dict`; None where the count of records read is all a reader needs).

Ranks: every rank reads and tokenises the whole stream and builds the same chunks, so the
batches are the same at any world size, and a position resumes on another. The price is that
every rank reads everything, which is cheap next to the model at a node's scale (the token
cache is the path for more); the next chunk is prepared in a thread while the current one
trains, and avoids datasets' node splitting, which leaves ranks with unequal batch counts
(NOTES.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from aiayn.config import Config
from aiayn.data.batch import Batch
from aiayn.data.pad import table
from aiayn.data.plan import LmPlan, Plan, lm_plan, pair_plan
from aiayn.data.position import Settings, fingerprint
from aiayn.data.prefetch import prefetch
from aiayn.data.segment import Segment, nothing_left, row_widths, specials, target_sums
from aiayn.data.splits import open_split, source_identity
from aiayn.data.stream_mixture import StreamMixture
from aiayn.errors import DataError

_ORDERED_CHUNK = 4096  # chunk size when data.shuffle_buffer is 0 (stream order kept)


class StreamRows:
    """The chunks of one streamed split, or, given the run's `cfg` naming data.sources, of a
    mixture's streamed sources (training only). `local`: a Hub split's local copy's parts."""

    def __init__(
        self,
        settings: Settings,
        split: str | None,
        local: list[str] | None = None,
        cfg: Config | None = None,
    ):
        s = self.settings = settings
        self.train = s.train
        self.chunk_size = s.cfg.shuffle_buffer or _ORDERED_CHUNK
        self._stats = dict.fromkeys(("examples_read", "dropped_too_long", "dropped_empty"), 0)
        if cfg is not None and cfg.data.sources and s.train:
            self.mixture: StreamMixture | None = StreamMixture(cfg, s, self.chunk_size)
            self.tags, self.what = self.mixture.tags, "data.sources"
            data = {"mixture": self.mixture.fingerprint()}
        else:
            self.mixture, self.tags, self.what = None, None, split
            self.source = open_split(s.cfg, split, s.kind, local=local)
            identity = source_identity(s.cfg, split, s.kind, contents=s.train)
            data = {"split": split, "format": s.cfg.format, "source": identity}
        self.fingerprint = fingerprint(s, "stream", data)

    def start(self, epoch: int = 0) -> dict:
        if self.mixture is not None:
            return self.mixture.start(epoch)
        return {"epoch": epoch, "chunk": 0, "source": None, "read": 0, "next_id": 0}

    def stats(self) -> dict[str, int]:
        """Counts since this source was made (a resumed loader re-reads its current chunk)."""
        sources = self.mixture.sources if self.mixture is not None else [self.source]
        return {**self._stats, "invalid_utf8_skipped": sum(s.invalid_utf8 for s in sources)}

    def mixture_scalars(self, position: dict) -> dict[str, float]:
        return {} if self.mixture is None else self.mixture.scalars(position)

    def segments(self, anchor: dict) -> Iterator[Segment]:
        """Every chunk from the anchor's on, epoch after epoch if training; read and tokenised
        one ahead, in a thread of their own."""
        if self.mixture is None:
            return prefetch(self._chunks(anchor))
        chunks = self.mixture.chunks(anchor)
        return prefetch(self._segment(examples, at) for examples, at in chunks)

    def _chunks(self, pos: dict) -> Iterator[Segment]:
        """Every chunk of one split from `pos` on."""
        epoch, chunk, state = pos["epoch"], pos["chunk"], pos["source"]
        read, next_id, first = pos["read"], pos["next_id"], pos["chunk"]
        while True:
            records, batches = self.source.stream(state, read), 0
            while examples := list(itertools.islice(records, self.chunk_size)):
                anchor = dict(epoch=epoch, chunk=chunk, source=state, read=read, next_id=next_id)
                state = records.state()  # the next chunk starts here
                segment = self._segment(examples, anchor)
                yield segment
                batches += len(segment)
                ids = segment.plan.n_blocks if self.settings.kind == "lm" else len(examples)
                read, next_id, chunk = read + len(examples), next_id + ids, chunk + 1
            if first == 0 and batches == 0:
                raise self._nothing_left()
            if not self.train:
                return
            epoch, chunk, state, read, next_id, first = epoch + 1, 0, None, 0, 0, 0

    def _nothing_left(self) -> DataError:
        return nothing_left(self.what, self.stats(), self.settings.cfg.max_len)

    # ---- one chunk --------------------------------------------------------------------------

    def _segment(self, examples: list[dict], anchor: dict) -> Segment:
        self._stats["examples_read"] += len(examples)
        s = self.settings
        rng = None
        if s.train and s.cfg.shuffle_buffer:
            rng = np.random.default_rng([s.seed, anchor["epoch"], anchor["chunk"]])
        if s.kind == "lm":  # documents joined by eos, cut into blocks of max_len + 1 tokens
            docs = table(s.tok.encode([e["text"] for e in examples]), None, np.zeros(0))
            self._stats["dropped_empty"] += int((docs["src_lengths"] == 0).sum())
            rows = max(1, s.max_tokens // s.cfg.max_len)
            plan = lm_plan(docs["src_lengths"], s.cfg.max_len + 1, rows, rng)
            return self._made(anchor, plan, [docs], first_id=anchor["next_id"])
        if self.mixture is None:
            ids, which = anchor["read"] + np.arange(len(examples), dtype=np.int64), None
        else:
            ids = np.array([rec["_id"] for rec in examples], dtype=np.int64)
            which = np.array([rec["_source"] for rec in examples], dtype=np.int64)
        rows = self._table(examples, ids)
        width, keep = self._widths(rows, which)
        plan = pair_plan(width, keep, s.max_tokens, s.cfg.shuffle_buffer, rng)
        if self.mixture is not None:
            self.mixture.record_shares(anchor, which, rows.get("tgt_lengths"))
        tables = [rows] * (1 if which is None else len(self.tags))
        return self._made(anchor, plan, tables, which, width=width)

    def _table(self, examples: list[dict], ids: np.ndarray) -> dict[str, np.ndarray]:
        """The examples tokenised, with their ids (and labels): the chunk's rows."""
        tok, kind = self.settings.tok, self.settings.kind
        if kind == "seq2seq":
            src = tok.encode([e["src"] for e in examples])
            tgt = tok.encode([e["tgt"] for e in examples], side="target")
            return table(src, tgt, ids)
        labels = None
        if kind == "classifier":
            labels = np.array([e["label"] for e in examples], dtype=np.int64)
        return table(tok.encode([e["text"] for e in examples]), None, ids, labels)

    def _widths(self, rows: dict, which: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Each row's padded width (a tag counted), and the rows kept: those with no empty
        side and within data.max_len, the others dropped and counted."""
        src_len, tgt_len = rows["src_lengths"], rows.get("tgt_lengths")
        tagged = 0 if which is None else np.array([t is not None for t in self.tags])[which]
        empty = src_len == 0 if tgt_len is None else np.minimum(src_len, tgt_len) == 0
        longest, width = row_widths(self.settings, src_len, tgt_len, tagged)
        too_long = ~empty & (longest > self.settings.cfg.max_len)
        self._stats["dropped_empty"] += int(empty.sum())
        self._stats["dropped_too_long"] += int(too_long.sum())
        return width, np.flatnonzero(~empty & ~too_long)

    def _made(self, anchor, plan, tables, which=None, first_id=0, width=None) -> Segment:
        sums = target_sums(plan, tables[0].get("tgt_lengths"))
        tags = None if which is None else self.tags
        return Segment(
            anchor, anchor["epoch"], plan, sums, tables, specials(self.settings), tags, which,
            first_id=first_id, width=width,
        )  # fmt: skip

    def largest_batches(self, anchor: dict, fuse_to: int | None) -> list[Batch]:
        """A batch of the widest rows the data allows (max_len + 1 tokens), as many as the
        token budget holds (a forward's, `fuse_to`, where a rank fuses units): a stream has no
        plan to search, and no batch of it needs more memory than this. To try before
        training; the position does not move."""
        s = self.settings
        budget = s.max_tokens if fuse_to is None else fuse_to
        width, fill, anchor = s.cfg.max_len + 1, s.tok.eos_id, self.start()
        if s.kind == "lm":
            rows = max(1, budget // s.cfg.max_len)
            full = table([[fill] * s.cfg.max_len] * rows, None, np.arange(rows))
            ends = np.arange(1, rows + 1) * width  # each document a block: max_len + eos
            plan = LmPlan(np.arange(rows), ends, rows * width, width, rows)
            return [self._made(anchor, plan, [full]).lm_batch(0)]
        rows = max(1, budget // width)
        full = [[fill] * s.cfg.max_len] * rows
        labels = np.zeros(rows, dtype=np.int64) if s.kind == "classifier" else None
        full = table(full, full if s.kind == "seq2seq" else None, np.arange(rows), labels)
        plan = Plan(np.arange(rows), np.array([0, rows]))
        return [self._made(anchor, plan, [full]).read(np.array([0])).batch(0)]
