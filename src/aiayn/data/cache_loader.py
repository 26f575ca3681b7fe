"""Batches of one rank from the token cache: planned from lengths, read from memory maps.

Every rank uses the same global plan of an epoch, made from the cache's length index (plan.py),
and builds only its own batches, global batches r, r + W, r + 2W, ... of the stream of epochs:
what a rank reads and pads falls as 1/W. A plan costs a few passes over the lengths, under a
second for millions of examples but O(N) all the same: while training, one rank per node makes
the next epoch's plan in a background thread and keeps it beside the cache (plan_files.py), and
the node's other ranks memory-map it, so that a rank's work per epoch is its own batches and
O(N / batch size); a rank that finds no file makes the plan itself, the same bits. The
batches themselves are made a few ahead in another thread (prefetch.py), pinned when they are
bound for a GPU, so that neither reading nor the copy waits on the loop; a rank's next batches
of the epoch are read from the memory maps and padded together (pad.py).

Position: (epoch, global batches of that epoch the group has consumed), a count that may run
past the epoch's end into the next ones. It is the group's, not the rank's, so a checkpoint from
N ranks resumes on M with the same global order; resuming replans the epoch and skips without
reading any token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from aiayn.config import DataConfig
from aiayn.data.batch import Batch, round_width
from aiayn.data.cache import TokenCache
from aiayn.data.pad import (
    RowsRead,
    Specials,
    cache_arrays,
    lm_batch,
    ragged_index,
    read_batches,
    read_count,
)
from aiayn.data.plan import LmPlan, Plan, epoch_rng, lm_plan, pair_plan
from aiayn.data.plan_files import PlanFiles, plans_folder
from aiayn.data.position import check_loader_args, fingerprint, saved_position, saved_state
from aiayn.data.prefetch import AHEAD, BATCH_THREAD, prefetch
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATE_VERSION = 1


class CacheLoader:
    """Batches of one split's TokenCache for one rank (a Loader: data/loader_protocol.py).

    train=True loops over epochs forever, each planned with its own seed; train=False makes one
    pass in cache order (bucketed by width within data.shuffle_buffer windows). pin_memory=True
    hands out batches in page-locked memory (needs CUDA), for asynchronous copies to the GPU.
    local_rank and local_world_size place the rank on its node (DistEnv's; by default the
    whole world is one node): they say which rank of the node plans which epoch.
    """

    def __init__(
        self,
        cache: TokenCache,
        data_cfg: DataConfig,
        tokenizer: Tokenizer,
        *,
        kind: str,
        max_tokens: int,
        seed: int,
        train: bool,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
        local_rank: int | None = None,
        local_world_size: int | None = None,
    ):
        if cache.kind != kind:
            raise DataError(
                f"token cache {cache.root} holds {cache.kind} data, this model is {kind}; "
                "set data.cache_dir to another directory"
            )
        self._setup(data_cfg, tokenizer, kind, max_tokens, seed, train, rank, world_size)
        self.cache, self.caches, self.pin_memory = cache, [cache], pin_memory
        self._arrays = [cache_arrays(cache)]
        # int32 throughout (examples < 2^31, a row < 2^31 tokens): the index and the plan of
        # millions of examples are per-rank memory. Pairs keep only widths; rows read their
        # lengths from the offsets of their own batch. The lengths are the cache's stored
        # array, memory-mapped (computed from the offsets for a cache built without it).
        src_len = cache.lengths("src")
        if kind == "lm":
            self._doc_len, self._too_long = src_len, 0
        else:
            tgt_len = cache.lengths("tgt")
            # A new array either way: it is changed in place below, and the map is read-only.
            longest = np.array(src_len) if tgt_len is None else np.maximum(src_len, tgt_len)
            self._keep = np.flatnonzero(longest <= data_cfg.max_len).astype(np.int32)
            self._too_long = len(longest) - len(self._keep)
            # Every row gains one special token (eos, or bos for tgt_in); the plan counts the
            # width a row is padded to, so the token budget includes the rounding.
            longest += 1
            self._width = round_width(longest, self.multiple, data_cfg.max_len + 1)
        self._fingerprint = fingerprint(self, "cache", {"cache": cache.digest})
        if train:  # an evaluation pass plans once, in cache order: nothing to share
            self._plan_files = PlanFiles(
                plans_folder(cache.root, self._fingerprint),
                rank if local_rank is None else local_rank,
                world_size if local_world_size is None else local_world_size,
            )

    def _setup(self, data_cfg, tokenizer, kind, max_tokens, seed, train, rank, world_size) -> None:
        """What every loader over token caches holds besides its index (mixed_cache_loader.py
        too)."""
        check_loader_args(max_tokens, rank, world_size)
        self.cfg, self.tok, self.kind = data_cfg, tokenizer, kind
        self.max_tokens, self.seed, self.train = max_tokens, seed, train
        self.rank, self.world_size = rank, world_size
        self.multiple = data_cfg.pad_to_multiple or 1
        self.epoch = 0
        self._pos = {"epoch": 0, "done": 0}
        self._resume_pending = False
        # (epoch, plan, cumulative target tokens of its batches): the current epoch's
        self._plan_of: tuple[int, Plan | LmPlan, np.ndarray] | None = None
        self._ahead: tuple[int, Future] | None = None  # the next epoch's plan, while training
        self._plan_files: PlanFiles | None = None  # plans kept beside the cache, while training
        self._lengths: dict[int, int] = {}  # global batches of the recent epochs
        self._planner: ThreadPoolExecutor | None = None
        self._plan_lock = threading.Lock()  # plans are made on the batch thread, and read here
        self._batches = 0
        self._rows_read: RowsRead | None = None  # this rank's next few batches, read together
        self._read_count = read_count(max_tokens)
        self.tags: list[int | None] | None = None  # a tag's token id per source, or None
        self.round: tuple[int, int] | None = None
        """For the batch last handed out: the target tokens of its round (the W global batches
        the ranks take together, one each), and the epoch of the round's last batch. Every rank
        plans every rank's batches, so the loop (train/loop.py) needs no collective to learn
        them."""

    # ---- position ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return saved_state(STATE_VERSION, self._fingerprint, self._pos)

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` at the next iter(); refuses a state made for other settings
        (the cache's content is in the fingerprint)."""
        self._pos = saved_position(state, STATE_VERSION, self._fingerprint, "the token cache")
        self.epoch = self._pos["epoch"]
        self._resume_pending = True

    def stats(self) -> dict[str, int]:
        """What the cache read and dropped, and the batches this rank took since it was built."""
        c = self.cache.counts()
        return {
            "examples_read": c["records_read"],
            "dropped_too_long": self._too_long,
            "dropped_empty": c["dropped_empty"],
            "batches": self._batches,
            "invalid_utf8_skipped": c["invalid_utf8_skipped"],
        }

    def mixture_scalars(self) -> dict[str, float]:
        """One source: nothing to say per source (mixed_cache_loader.py says it for a mixture)."""
        return {}

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if not self.train and not self._resume_pending:
            self._pos = {"epoch": 0, "done": 0}
        self._resume_pending = False
        # Made ahead in a thread; the position moves only when the loop takes a batch, so a
        # checkpoint never counts the batches still waiting in the queue.
        ahead = prefetch(self._rank_batches(self._pos), AHEAD, BATCH_THREAD)
        try:
            for batch, pos, epoch, round_ in ahead:
                self._pos, self.epoch, self.round = pos, epoch, round_
                self._batches += 1
                yield batch
        finally:
            ahead.close()
        if not self.train:
            self._pos = {"epoch": 0, "done": 0}

    def _rank_batches(self, pos: dict) -> Iterator[tuple[Batch, dict, int, tuple[int, int]]]:
        """This rank's batches from `pos` on, each with the position after it, its epoch, and
        its round's target tokens and last epoch (`round`). A round is W consecutive global
        batches of the stream of epochs, one for each rank; this rank makes only its own, and
        a round's total comes from the epochs' cumulative sums: per round, work that does not
        grow with W."""
        W, epoch, i = self.world_size, *self._settle(pos["epoch"], pos["done"])
        while self.train or i < self._length(epoch):
            round_pos = {"epoch": epoch, "done": i + W}  # the group's position after the round
            targets, last_epoch, mine = self._round(epoch, i)
            if mine is None:  # an evaluation pass that ends inside a round, before this rank
                return
            batch, batch_epoch = mine
            batch = batch.pin_memory() if self.pin_memory else batch
            yield batch, round_pos, batch_epoch, (targets, last_epoch)
            epoch, i = self._settle(epoch, i + W)

    def _settle(self, epoch: int, done: int) -> tuple[int, int]:
        """(epoch, index) of global batch `done` of `epoch`, counted on into the next epochs
        when training. Moving past an epoch costs its plan, never a token."""
        while True:
            n = self._length(epoch)
            if n == 0:
                raise self._nothing_left()
            if self.train:
                with self._plan_lock:
                    self._plan_ahead(epoch + 1)
            if done < n or not self.train:
                return epoch, done
            epoch, done = epoch + 1, done - n

    def _round(self, epoch: int, i: int) -> tuple[int, int, tuple[Batch, int] | None]:
        """The round of W global batches from batch i of `epoch`: its target tokens, the epoch
        of its last batch, and this rank's batch with its epoch, None where an evaluation pass
        ends first (a last round may be short then). A round that crosses into the next epoch
        makes this rank's batch while its epoch's plan is the current one."""
        left, targets, mine = self.world_size, 0, None
        while left:
            plan = self.plan(epoch)
            take = min(left, len(plan) - i)
            sums = self._target_sums(epoch)
            targets += int(sums[i + take] - sums[i])
            at = self.rank - (self.world_size - left)  # this rank's offset in this stretch
            if mine is None and 0 <= at < take:
                mine = (self._make_batch(plan, i + at), epoch)
            left -= take
            if left == 0 or not self.train:
                break
            epoch, i = self._settle(epoch + 1, 0)
        return targets, epoch, mine

    def _target_sums(self, epoch: int) -> np.ndarray:
        """Cumulative target tokens of the global batches of `epoch` (Batch.n_tokens), 0 first,
        made with the plan (`_planned`)."""
        with self._plan_lock:
            self._plan_locked(epoch)
            return self._plan_of[2]

    def _plan_targets(self, plan: Plan | LmPlan) -> np.ndarray:
        if isinstance(plan, LmPlan):  # a block's targets are its positions 1.. inside the stream
            starts = plan.offset + np.arange(plan.n_blocks, dtype=np.int64) * plan.size
            per_block = np.clip(plan.total - starts - 1, 0, plan.size - 1)
            blocks = per_block if plan.order is None else per_block[plan.order]
            if not len(blocks):
                return np.zeros(0, np.int64)
            return np.add.reduceat(blocks, np.arange(0, len(blocks), plan.rows))
        rows, starts = plan.rows, plan.bounds[:-1]
        if self.kind == "classifier":  # one target per example
            per_batch = np.diff(plan.bounds)
        else:  # each target side and its eos
            lengths = self._target_lengths(rows) + 1
            per_batch = np.add.reduceat(lengths, starts) if len(rows) else np.zeros(0, np.int64)
        return per_batch if plan.order is None else per_batch[plan.order]

    def _target_lengths(self, rows: np.ndarray) -> np.ndarray:
        """int64 target tokens (eos not counted) of the examples `rows`."""
        c = self.cache
        return c.tgt_lengths[rows].astype(np.int64)

    def _length(self, epoch: int) -> int:
        """Global batches of `epoch`. Kept apart from the plan: after a round that crossed
        into the next epoch, the next round starts from the epoch it left (`_settle`), which
        would otherwise make that epoch's plan again, on every rank, at every epoch."""
        with self._plan_lock:
            if epoch not in self._lengths:
                self._lengths = {e: n for e, n in self._lengths.items() if e >= epoch - 1}
                self._lengths[epoch] = len(self._plan_locked(epoch))
            return self._lengths[epoch]

    def plan(self, epoch: int) -> Plan | LmPlan:
        """The global batches of `epoch` (computed once, kept while it is the current one)."""
        with self._plan_lock:
            return self._plan_locked(epoch)

    def _plan_locked(self, epoch: int) -> Plan | LmPlan:
        if self._plan_of is None or self._plan_of[0] != epoch:
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] == epoch:
                plan, sums = ahead[1].result()
            else:
                plan, sums = self._planned(epoch)
            self._plan_of = (epoch, plan, sums)
        return self._plan_of[1]

    def _plan_ahead(self, epoch: int) -> None:
        """Start making `epoch`'s plan in the background, where this rank makes it: a rank
        that is not the epoch's planner reads the planner's file when the epoch comes."""
        if self._ahead is not None and self._ahead[0] == epoch:
            return
        if self._plan_files is not None and not self._plan_files.plans(epoch):
            return
        self._ahead = (epoch, self._background().submit(self._planned, epoch))

    def _background(self) -> ThreadPoolExecutor:
        """The thread that makes plans ahead and writes them for the node, in that order."""
        if self._planner is None:
            self._planner = ThreadPoolExecutor(1, thread_name_prefix="aiayn-plan")
        return self._planner

    def _planned(self, epoch: int) -> tuple[Plan | LmPlan, np.ndarray]:
        """`epoch`'s plan and the cumulative target tokens of its batches: read from the
        planner's file, or made here (and kept for the node, by its planner: written in the
        background, so that neither the loop nor the plan ahead waits for the disk)."""
        files = self._plan_files
        kept = None if files is None else files.read(epoch)
        if kept is not None:
            return kept
        plan = self._compute_plan(epoch)
        sums = np.concatenate(([0], np.cumsum(self._plan_targets(plan))))
        if files is not None and files.plans(epoch):
            self._background().submit(files.write, epoch, plan, sums)
        return plan, sums

    def _compute_plan(self, epoch: int) -> Plan | LmPlan:
        rng = epoch_rng(self.seed, epoch) if self.train and self.cfg.shuffle_buffer else None
        if self.kind == "lm":
            rows = self.max_tokens // self.cfg.max_len
            return lm_plan(self._doc_len, self.cfg.max_len + 1, rows, rng, self.cfg.lm_order)
        window = self.cfg.shuffle_buffer
        return pair_plan(self._width, self._keep, self.max_tokens, window, rng)

    def largest_batches(self) -> list[Batch]:
        """The batches of the current epoch that need the most memory, to try before training:
        the one of the most padded tokens (rows x width) and the widest, made as the loop would
        make them. The position does not move."""
        plan = self.plan(self.epoch)
        if len(plan) == 0:
            return []
        if self.kind == "lm":  # every batch but the last has `rows` full blocks
            return [self._make_batch(plan, 0)]
        starts = plan.bounds[:-1]
        widest = np.maximum.reduceat(self._width[plan.rows], starts)
        tokens = widest.astype(np.int64) * np.diff(plan.bounds)
        picks = dict.fromkeys((int(np.argmax(tokens)), int(np.argmax(widest))))
        where = np.arange(len(plan)) if plan.order is None else np.argsort(plan.order)
        return [self._make_batch(plan, int(where[j]), count=1) for j in picks]

    def _nothing_left(self) -> DataError:
        s = self.stats()
        return DataError(
            f"token cache {self.cache.root} gives no batches: of {s['examples_read']} examples "
            f"read, {s['dropped_too_long']} are longer than data.max_len={self.cfg.max_len} "
            f"tokens and {s['dropped_empty']} are empty; raise data.max_len or check the corpus"
        )

    # ---- one batch ----------------------------------------------------------------------------

    def _make_batch(self, plan: Plan | LmPlan, k: int, count: int | None = None) -> Batch:
        """Global batch k of the plan, from the rows read with it (pad.py): on a miss,
        this rank's batches k, k + W, ... of the epoch are read, `count` of them (by default
        read_count's)."""
        if self.kind == "lm":
            return lm_batch(self._arrays[0], plan, k, self._specials())
        read = self._rows_read
        if read is None or not read.holds(plan, k):
            read = self._rows_read = self._read(plan, k, count or self._read_count)
        return read.batch(k)

    def _read(self, plan: Plan, k: int, count: int) -> RowsRead:
        """Batches k, k + W, ... of the plan, up to `count` of them within the epoch."""
        step = self.world_size
        ks = np.arange(k, min(len(plan), k + count * step), step)
        js = ks if plan.order is None else plan.order[ks]
        first, sizes = plan.bounds[js], plan.bounds[js + 1] - plan.bounds[js]
        cells, ends = ragged_index(first, sizes)
        which, local = self._row_sources(plan.rows[cells].astype(np.intp))
        row_at = np.concatenate(([0], ends))
        arrays = read_batches(self._arrays, local, row_at, self._specials(), which, self.tags)
        return RowsRead(plan, k, step, len(ks), row_at, **arrays)

    def _row_sources(self, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(source of each row or None for one cache, its row in that source's cache)."""
        return None, rows

    def _specials(self) -> Specials:
        tok = self.tok
        return Specials(tok.pad_id, tok.bos_id, tok.eos_id, self.multiple, self.cfg.max_len + 1)
