"""Token-budget batches from a streamed corpus, shuffled and bucketed, resumable exactly.

The stream is read in chunks of data.shuffle_buffer examples. Each chunk is tokenized with one
`encode` call into a table of the token cache's shape (pad.py's `table`), and planned as a token
cache's epoch is, by plan.py, with a generator seeded by (seed, epoch, chunk): pairs shuffled,
sorted by width into batches of at most max_tokens tokens (padding included, like fairseq
--max-tokens), the batches shuffled; a language model's documents joined into blocks. Batches
are padded by pad.py, as the token cache's are. We do not use datasets' `.shuffle(buffer_size)`:
its buffer is not restored by `state_dict` (NOTES.md), so resume would not be exact.

Position: the chunk where the current round of batches starts (epoch, chunk index, the source's
`state_dict()` at that chunk's start, counters) plus how many global batches from that chunk's
start the ranks have consumed. Resuming rebuilds that one chunk (deterministic) and skips.

Ranks: every rank builds the same global sequence of batches and rank r takes global batches
r, r+W, r+2W, ... The position is that of the whole group, so it does not depend on the world
size and a checkpoint from N ranks resumes on M. The price: every rank reads and tokenizes the
whole stream. That is cheap next to the model (about 60k translation pairs/s in one process on
two CPU cores, with the next chunk prepared in a thread while the current one trains), and it
avoids datasets' node splitting, which leaves ranks with unequal batch counts (NOTES.md). The
batches of a chunk are padded a few ahead in another thread, pinned when bound for a GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from aiayn.config import DataConfig
from aiayn.data.batch import Batch, round_width
from aiayn.data.pad import Specials, lm_batch, one_batch, table
from aiayn.data.plan import LmPlan, Plan, lm_plan, pair_plan
from aiayn.data.position import check_loader_args, fingerprint, saved_position, saved_state
from aiayn.data.prefetch import AHEAD, BATCH_THREAD, prefetch
from aiayn.data.splits import KINDS, open_split, source_identity
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer

STATE_VERSION = 1
_ORDERED_CHUNK = 4096  # chunk size when data.shuffle_buffer is 0 (stream order kept)


@dataclass
class Chunk:
    """A tokenised chunk (a table of the token cache's shape: pad.py) and its plan."""

    anchor: dict
    table: dict[str, np.ndarray]
    plan: Plan | LmPlan
    n_ids: int  # the ids it takes: examples read, or a language model's blocks
    which: np.ndarray | None = None  # a mixture: the data.sources index of each row


class StreamLoader:
    """Batches of one streamed split for one rank (a Loader: data/loader_protocol.py). Iterate
    it; save and restore it with state_dict.

    train=True loops over epochs forever (the trainer decides when to stop), reshuffling each
    epoch, and each `for` continues where the last one stopped. train=False makes one pass in
    stream order (still length-bucketed within a chunk; Batch.ids give the original order), and
    each `for` starts a new pass, unless a state was just loaded.

    Lengths: data.max_len counts the tokens of a text without bos/eos, so src, tgt_in and
    tgt_out rows have at most max_len + 1 tokens (the config checks model.max_len has room).
    data.pad_to_multiple rounds a batch's width up, but not past max_len + 1. pin_memory=True
    hands out batches in page-locked memory (needs CUDA), for asynchronous copies to the GPU.
    """

    def __init__(
        self,
        data_cfg: DataConfig,
        split: str,
        tokenizer: Tokenizer,
        *,
        kind: str,
        max_tokens: int,
        seed: int,
        train: bool,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
        local: list[str] | None = None,
    ):
        self._setup(data_cfg, tokenizer, kind, max_tokens, seed, train, rank, world_size)
        self.split, self.pin_memory = split, pin_memory
        self.source = open_split(data_cfg, split, kind, local=local)
        self._pos = self._start()
        source = source_identity(data_cfg, split, kind, contents=train)
        data = {"split": split, "format": data_cfg.format, "source": source}
        self._fingerprint = fingerprint(self, "stream", data)

    def _setup(self, data_cfg, tokenizer, kind, max_tokens, seed, train, rank, world_size) -> None:
        """What every streaming loader holds besides its stream (mixed_stream_loader.py too)."""
        if kind not in KINDS:
            raise DataError(f"unknown model kind {kind!r}; choose from {KINDS}")
        check_loader_args(max_tokens, rank, world_size)
        self.cfg, self.tok, self.kind = data_cfg, tokenizer, kind
        self.max_tokens, self.seed, self.train = max_tokens, seed, train
        self.rank, self.world_size = rank, world_size
        self.multiple = data_cfg.pad_to_multiple or 1
        self.chunk_size = data_cfg.shuffle_buffer or _ORDERED_CHUNK
        self.epoch = 0
        self.round: tuple[int, int] | None = None  # each rank knows only its own batches
        self._resume_pending = False
        self._stats = dict.fromkeys(
            ("examples_read", "dropped_too_long", "dropped_empty", "batches"), 0
        )

    # ---- position ---------------------------------------------------------------------------

    @staticmethod
    def _start(epoch: int = 0) -> dict:
        return {"epoch": epoch, "chunk": 0, "source": None, "read": 0, "next_id": 0, "done": 0}

    def state_dict(self) -> dict:
        return saved_state(STATE_VERSION, self._fingerprint, self._pos)

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` at the next iter(); refuses a state made for other settings."""
        self._pos = saved_position(state, STATE_VERSION, self._fingerprint, self.split)
        self.epoch = self._pos["epoch"]
        self._resume_pending = True

    def stats(self) -> dict[str, int]:
        """Counts since this loader was built (a resumed loader re-reads its current chunk)."""
        return {**self._stats, "invalid_utf8_skipped": self.source.invalid_utf8}

    def mixture_scalars(self) -> dict[str, float]:
        """One source: nothing to say per source (mixed_stream_loader.py says it for a mixture)."""
        return {}

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if not self.train and not self._resume_pending:
            self._pos = self._start()
        self._resume_pending = False
        # Made ahead in a thread; the position moves only when the loop takes a batch, so a
        # checkpoint never counts the batches still waiting in the queue.
        ahead = prefetch(self._rank_batches(self._pos), AHEAD, BATCH_THREAD)
        try:
            for batch, pos, epoch in ahead:
                self._pos, self.epoch = pos, epoch
                self._stats["batches"] += 1
                yield batch
        finally:
            ahead.close()
        if not self.train:
            self._pos = self._start()

    def _rank_batches(self, pos: dict) -> Iterator[tuple[Batch, dict, int]]:
        """This rank's batches from `pos` on, each with the position after it and its epoch;
        chunks are read and tokenised one ahead, in a thread of their own."""
        W = self.world_size
        chunks = prefetch(self._chunks(pos))
        try:
            stream = ((chunk, i) for chunk in chunks for i in range(len(chunk.plan)))
            stream = itertools.islice(stream, pos["done"], None)  # consumed before the save
            for k, (chunk, i) in enumerate(stream):
                if k % W == 0:  # a round of W batches starts: the group's position moves past it
                    round_pos = {**chunk.anchor, "done": i + W}
                if k % W == self.rank:
                    batch = self._make_batch(chunk, i)
                    batch = batch.pin_memory() if self.pin_memory else batch
                    yield batch, round_pos, chunk.anchor["epoch"]
        finally:
            chunks.close()

    def largest_batches(self) -> list[Batch]:
        """A batch of the widest rows the data allows (max_len + 1 tokens), as many as the
        token budget holds: a stream has no plan to search, and no batch of it needs more
        memory than this. To try before training; the position does not move."""
        width, fill, anchor = self.cfg.max_len + 1, self.tok.eos_id, self._start()
        if self.kind == "lm":
            rows = max(1, self.max_tokens // self.cfg.max_len)
            full = table([[fill] * self.cfg.max_len] * rows, None, np.arange(rows))
            plan = LmPlan(
                np.arange(rows), np.arange(1, rows + 1) * width, rows * width, width, rows
            )
            return [self._make_batch(Chunk(anchor, full, plan, rows), 0)]
        rows = max(1, self.max_tokens // width)
        full = [[fill] * self.cfg.max_len] * rows
        labels = np.zeros(rows, dtype=np.int64) if self.kind == "classifier" else None
        full = table(full, full if self.kind == "seq2seq" else None, np.arange(rows), labels)
        plan = Plan(np.arange(rows), np.array([0, rows]))
        return [self._make_batch(Chunk(anchor, full, plan, rows), 0)]

    def _chunks(self, pos: dict) -> Iterator[Chunk]:
        """Every chunk from the one at `pos` on: epoch after epoch if training."""
        epoch, chunk, state = pos["epoch"], pos["chunk"], pos["source"]
        read, next_id = pos["read"], pos["next_id"]
        while True:
            records = self.source.stream(state, read)
            epoch_batches = 0
            while examples := list(itertools.islice(records, self.chunk_size)):
                anchor = dict(epoch=epoch, chunk=chunk, source=state, read=read, next_id=next_id)
                state = records.state()  # the next chunk starts here
                built = self._build_chunk(examples, anchor)
                yield built
                epoch_batches += len(built.plan)
                read, next_id, chunk = read + len(examples), next_id + built.n_ids, chunk + 1
            if pos["chunk"] == 0 and epoch_batches == 0:
                raise self._nothing_left()
            if not self.train:
                return
            epoch, chunk, state, read, next_id = epoch + 1, 0, None, 0, 0
            pos = self._start(epoch)

    def _nothing_left(self) -> DataError:
        s = self.stats()
        return DataError(
            f"{self.split} gives no batches: of {s['examples_read']} examples read, "
            f"{s['dropped_too_long']} are longer than data.max_len={self.cfg.max_len} tokens and "
            f"{s['dropped_empty']} are empty; raise data.max_len or check the corpus"
        )

    # ---- one chunk ----------------------------------------------------------------------------

    def _rng(self, anchor: dict) -> np.random.Generator | None:
        if not (self.train and self.cfg.shuffle_buffer):
            return None
        return np.random.default_rng([self.seed, anchor["epoch"], anchor["chunk"]])

    def _build_chunk(self, examples: list[dict], anchor: dict) -> Chunk:
        self._stats["examples_read"] += len(examples)
        if self.kind == "lm":
            return self._lm_chunk(examples, anchor)
        ids = anchor["read"] + np.arange(len(examples), dtype=np.int64)
        return self._pair_chunk(self._table(examples, ids), anchor)

    def _table(self, examples: list[dict], ids: np.ndarray) -> dict[str, np.ndarray]:
        """The examples tokenised, with their ids (and labels): the chunk's rows."""
        src, tgt = self._encoded(examples)
        labels = None
        if self.kind == "classifier":
            labels = np.array([e["label"] for e in examples], dtype=np.int64)
        return table(src, tgt, ids, labels)

    def _pair_chunk(self, rows: dict, anchor: dict, which: np.ndarray | None = None) -> Chunk:
        """The chunk's plan (plan.py's pair_plan, as a token cache's epoch's): rows with an
        empty side, and rows longer than data.max_len, dropped and counted. `which`: a
        mixture's source of each row, whose tag (self.tags) counts in the row's width."""
        src_len = rows["src_lengths"]
        tgt_len = rows.get("tgt_lengths", src_len)
        tagged = 0 if which is None else np.array([t is not None for t in self.tags])[which]
        empty = np.minimum(src_len, tgt_len) == 0
        longest = np.maximum(src_len + tagged, tgt_len)
        too_long = ~empty & (longest > self.cfg.max_len)
        self._stats["dropped_empty"] += int(empty.sum())
        self._stats["dropped_too_long"] += int(too_long.sum())
        keep = np.flatnonzero(~empty & ~too_long)
        # Every row gains one special token (eos, or bos for tgt_in); the budget counts the
        # width a row is padded to.
        width = round_width(longest + 1, self.multiple, self.cfg.max_len + 1)
        plan = pair_plan(width, keep, self.max_tokens, self.cfg.shuffle_buffer, self._rng(anchor))
        return Chunk(anchor, rows, plan, len(src_len), which)

    def _encoded(self, examples: list[dict]) -> tuple[list[list[int]], list[list[int]] | None]:
        """The token ids of each example's source (or text) and target (None: no target)."""
        if self.kind == "seq2seq":
            src = self.tok.encode([e["src"] for e in examples])
            return src, self.tok.encode([e["tgt"] for e in examples], side="target")
        return self.tok.encode([e["text"] for e in examples]), None

    def _lm_chunk(self, examples: list[dict], anchor: dict) -> Chunk:
        """Documents joined by eos and cut into blocks of max_len + 1 tokens (plan.py's
        lm_plan, as a token cache's epoch; the chunk's last block padded, not dropped)."""
        docs = table(self.tok.encode([e["text"] for e in examples]), None, np.zeros(0))
        self._stats["dropped_empty"] += int((docs["src_lengths"] == 0).sum())
        rows = max(1, self.max_tokens // self.cfg.max_len)
        plan = lm_plan(docs["src_lengths"], self.cfg.max_len + 1, rows, self._rng(anchor))
        return Chunk(anchor, docs, plan, plan.n_blocks)

    def _make_batch(self, chunk: Chunk, i: int) -> Batch:
        tok = self.tok
        special = Specials(tok.pad_id, tok.bos_id, tok.eos_id, self.multiple, self.cfg.max_len + 1)
        if self.kind == "lm":
            return lm_batch(chunk.table, chunk.plan, i, special, chunk.anchor["next_id"])
        rows = chunk.plan.batch(i)
        if chunk.which is None:
            return one_batch([chunk.table], rows, special)
        tags = self.tags
        return one_batch([chunk.table] * len(tags), rows, special, chunk.which[rows], tags)
