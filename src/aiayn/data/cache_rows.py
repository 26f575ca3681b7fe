"""Token caches as a row source (data/loader.py): each epoch is one segment, planned from the
caches' lengths alone (plan.py) and read from their memory maps.

One split's cache, or the caches of a mixture's sources (data.sources), whose rows are numbered
one after another (source s's example i is row base_s + i), so that the mixture is one more
step before the plan: each epoch, mixture.py says which examples of each source it takes, and
those rows go to the same planner. A source's tag is put before each source sentence as its
rows are padded (pad.py): it counts in the width that data.max_len and the token budget see,
and the cache stays the same with or without it.

A plan costs a few passes over the lengths, under a second for millions of examples but O(N)
all the same: while training, one rank per node makes the next epoch's plan in a background
thread and keeps it beside the cache (plan_files.py), and the node's other ranks memory-map it,
so that a rank's work per epoch is its own batches and O(N / batch size); a rank that finds no
file makes the plan itself, the same bits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from aiayn.data.batch import Batch
from aiayn.data.cache import TokenCache
from aiayn.data.forwards import widest_fused
from aiayn.data.mixture import Mixture, mixture_fingerprint, tag_ids
from aiayn.data.pad import cache_arrays
from aiayn.data.plan import LmPlan, Plan, epoch_rng, lm_plan, pair_plan
from aiayn.data.plan_files import PlanFiles, plans_folder
from aiayn.data.position import Settings, fingerprint
from aiayn.data.segment import (
    Segment,
    nothing_left,
    row_targets,
    row_widths,
    specials,
    target_sums,
)
from aiayn.errors import DataError

log = logging.getLogger(__name__)


class CacheRows:
    """The epochs of one token cache (data.train) or of a mixture's (data.sources)."""

    def __init__(
        self,
        caches: list[TokenCache],
        settings: Settings,
        local_rank: int = 0,
        local_world_size: int = 1,
    ):
        s = self.settings = settings
        cfg, kind = s.cfg, s.kind
        for c in caches:
            if c.kind != kind:
                raise DataError(
                    f"token cache {c.root} holds {c.kind} data, this model is {kind}; "
                    "set data.cache_dir to another directory"
                )
        self.caches, self.train = caches, s.train
        self.tables = [cache_arrays(c) for c in caches]
        self.tags = tag_ids(cfg, s.tok) if cfg.sources else [None]
        self._index()
        self.what = "the token cache" if len(caches) == 1 else "the sources' token caches"
        self.fingerprint = fingerprint(s, "cache", self._data_fingerprint())
        self._plan_files: PlanFiles | None = None
        if s.train:  # an evaluation pass plans once, in cache order: nothing to share
            folder = plans_folder(caches[0].root, self.fingerprint)
            self._plan_files = PlanFiles(folder, local_rank, local_world_size)
        self._ahead: tuple[int, Future] | None = None  # the next epoch's plan, while training
        self._planner: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # plans are made on the batch thread, and read here
        self._current: tuple[int, Plan | LmPlan, np.ndarray] | None = None
        self._tallies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if self.mixture is not None and s.rank == 0:
            self.mixture.log(cfg)

    def _index(self) -> None:
        """Rows' widths and target lengths, each source's kept examples, and the mixture."""
        s, cfg = self.settings, self.settings.cfg
        widths, tgt_lens, kept, self.too_long = [], [], [], 0
        self.base, self._source_of, self.mixture, self._tgt_len = None, None, None, None
        self._width = None
        if s.kind == "lm":  # documents are cut into blocks: none is too long
            return
        for c, tag in zip(self.caches, self.tags, strict=True):
            tgt_len = c.lengths("tgt")
            longest, width = row_widths(s, c.lengths("src"), tgt_len, np.int32(tag is not None))
            kept.append(np.flatnonzero(longest <= cfg.max_len).astype(np.int32))
            self.too_long += len(longest) - len(kept[-1])
            widths.append(width)
            tgt_lens.append(tgt_len)
        self._kept = kept
        if len(self.caches) == 1:  # the cache's own arrays: per-rank memory, memory-mapped
            self._width, self._tgt_len = widths[0], tgt_lens[0]
            return
        self._width = np.concatenate(widths).astype(np.int32)
        self._tgt_len = None if s.kind == "classifier" else np.concatenate(tgt_lens)
        self.base = np.cumsum([0] + [len(c) for c in self.caches]).astype(np.int64)
        # A plan's rows are per-rank memory, as the single cache's: int32 where they fit.
        self._row_type = np.int32 if self.base[-1] < 2**31 else np.int64
        sizes = np.diff(self.base)
        small = np.int8 if len(sizes) < 128 else np.int16
        self._source_of = np.repeat(np.arange(len(sizes), dtype=small), sizes)
        # Target tokens per example as Batch.n_tokens counts them (eos included; 1 a label),
        # for data.epoch tokens: a gather of every kept row, so made for a mixture only.
        mean_tokens = [
            float(t[k].mean()) + 1 if t is not None and len(k) else 1.0
            for t, k in zip(tgt_lens, kept, strict=True)
        ]
        try:
            self.mixture = Mixture.of(cfg, s.seed, [len(k) for k in kept], mean_tokens)
        except ValueError as exc:
            message = f"data.sources: {exc}; raise data.max_len or check the corpus"
            raise DataError(message) from None

    def _data_fingerprint(self) -> dict:
        if not self.settings.cfg.sources:
            return {"cache": self.caches[0].digest}
        digests = [c.digest for c in self.caches]
        return {"mixture": mixture_fingerprint(self.settings.cfg, "cache", digests)}

    # ---- the row source ---------------------------------------------------------------------

    @staticmethod
    def start(epoch: int = 0) -> dict:
        return {"epoch": epoch}

    def stats(self) -> dict[str, int]:
        """What the caches read and dropped."""
        counts = [c.counts() for c in self.caches]
        return {
            "examples_read": sum(c["records_read"] for c in counts),
            "dropped_too_long": self.too_long,
            "dropped_empty": sum(c["dropped_empty"] for c in counts),
            "invalid_utf8_skipped": sum(c["invalid_utf8_skipped"] for c in counts),
        }

    def segments(self, anchor: dict) -> Iterator[Segment]:
        """The epochs from the anchor's on (one, for an evaluation pass); the next epoch's
        plan is made in the background while one is read."""
        epoch = anchor["epoch"]
        while True:
            plan, sums = self.plan(epoch)
            if len(plan) == 0:
                raise self._nothing_left()
            if self.train:
                with self._lock:
                    self._plan_ahead(epoch + 1)
            yield self._segment(epoch, plan, sums)
            if not self.train:
                return
            epoch += 1

    def _segment(self, epoch: int, plan: Plan | LmPlan, sums: np.ndarray) -> Segment:
        return Segment(
            {"epoch": epoch}, epoch, plan, sums, self.tables, specials(self.settings),
            self.tags, self._source_of, self.base, width=self._width,
        )  # fmt: skip

    def _nothing_left(self) -> DataError:
        where = f"token cache {self.caches[0].root}" if len(self.caches) == 1 else "the sources"
        return nothing_left(where, self.stats(), self.settings.cfg.max_len)

    # ---- plans ------------------------------------------------------------------------------

    def plan(self, epoch: int) -> tuple[Plan | LmPlan, np.ndarray]:
        """`epoch`'s plan and the cumulative target tokens of its batches: the current one,
        the one made ahead, the node's planner's file, or made here."""
        current = self._current
        if current is not None and current[0] == epoch:
            return current[1], current[2]
        with self._lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == epoch:
            plan, sums = ahead[1].result()
        else:
            plan, sums = self._planned(epoch)
        self._current = (epoch, plan, sums)
        return plan, sums

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
        """Read from the planner's file, or made here (and kept for the node, by its planner:
        written in the background, so that neither the loop nor the plan ahead waits)."""
        files = self._plan_files
        kept = None if files is None else files.read(epoch)
        if kept is not None:
            return kept
        plan = self.compute_plan(epoch)
        sums = target_sums(plan, self._tgt_len)
        if files is not None and files.plans(epoch):
            self._background().submit(files.write, epoch, plan, sums)
        return plan, sums

    def compute_plan(self, epoch: int) -> Plan | LmPlan:
        """`epoch`'s plan, made from the lengths (pure: the same on every rank)."""
        s, cfg = self.settings, self.settings.cfg
        rng = epoch_rng(s.seed, epoch) if s.train and cfg.shuffle_buffer else None
        if s.kind == "lm":
            rows = s.max_tokens // cfg.max_len
            return lm_plan(self.caches[0].lengths("src"), cfg.max_len + 1, rows, rng, cfg.lm_order)
        if self.mixture is None:
            return pair_plan(self._width, self._kept[0], s.max_tokens, cfg.shuffle_buffer, rng)
        picks = self.mixture.epoch_rows(epoch)
        rows = np.concatenate([self.base[i] + self._kept[i][p] for i, p in enumerate(picks)])
        rows = rows.astype(self._row_type)
        rng = epoch_rng(s.seed, epoch)
        if not cfg.shuffle_buffer:  # no bucketing, but the sources still interleave
            rows, rng = rows[rng.permutation(len(rows))], None
        return pair_plan(self._width, rows, s.max_tokens, cfg.shuffle_buffer, rng)

    # ---- what the loader asks besides -------------------------------------------------------

    def largest_batches(self, anchor: dict, fuse_to: int | None) -> list[Batch]:
        """The batches of the anchor's epoch that need the most memory: the one of the most
        padded tokens (rows x width) and the widest, made as the loop would make them; where a
        rank fuses units into forwards of up to `fuse_to` tokens, the widest units fused."""
        epoch = anchor["epoch"]
        plan, sums = self.plan(epoch)
        segment = self._segment(epoch, plan, sums)
        if len(plan) == 0:
            return []
        if fuse_to is not None:
            return [segment.fused(widest_fused(segment, fuse_to))]
        if self.settings.kind == "lm":  # every batch but the last has `rows` full blocks
            return [segment.lm_batch(0)]
        # Every batch, in the plan's storage order (the first of equals is picked, as always).
        ks = np.arange(len(plan)) if plan.order is None else np.argsort(plan.order)
        rows, widest = segment.shapes(ks)
        tokens = widest.astype(np.int64) * rows
        picks = dict.fromkeys(int(ks[np.argmax(a)]) for a in (tokens, widest))
        return [segment.read(np.array([k])).batch(k) for k in picks]

    def mixture_scalars(self, position: dict) -> dict[str, float]:
        """What the whole group has taken of each source up to the position (the same on every
        rank, from the plans alone): examples since the run began, passes made over it, and
        its share of the current epoch's target tokens so far (of the epoch's plan, before its
        first batch). Empty for one source."""
        if self.mixture is None:
            return {}
        epoch, done = position["epoch"], position["done"]
        examples, tokens = self._tally(epoch)
        while done >= len(examples) > 0:  # a position may count past its epoch's end
            epoch, done = epoch + 1, done - len(examples)
            examples, tokens = self._tally(epoch)
        taken = examples[:done].sum(axis=0)
        share = tokens[:done].sum(axis=0) if done else tokens.sum(axis=0)
        share = share / max(share.sum(), 1)
        passes = self.mixture.passes(epoch, taken)
        out = {}
        for s, name in enumerate(self.mixture.names):
            out[f"{name}/examples"] = float(epoch * self.mixture.counts[s] + taken[s])
            out[f"{name}/passes"] = float(passes[s])
            out[f"{name}/token_share"] = float(share[s])
        return out

    def _tally(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(batches, sources) arrays of examples and target tokens, in the epoch's order. At log
        time, not when planning: the plan is the batch thread's current one, or made again."""
        if epoch not in self._tallies:
            current = self._current
            plan = current[1] if current and current[0] == epoch else self.compute_plan(epoch)
            n, S = len(plan), len(self.caches)
            batch = np.repeat(np.arange(n), np.diff(plan.bounds))
            cell = batch * S + self._source_of[plan.rows]
            examples = np.bincount(cell, minlength=n * S).reshape(n, S)
            weights = row_targets(self._tgt_len, plan.rows).astype(np.float64)
            tokens = np.bincount(cell, weights=weights, minlength=n * S).reshape(n, S)
            if plan.order is not None:
                examples, tokens = examples[plan.order], tokens[plan.order]
            self._tallies = {e: t for e, t in self._tallies.items() if e >= epoch - 1}
            self._tallies[epoch] = (examples, tokens)
        return self._tallies[epoch]
