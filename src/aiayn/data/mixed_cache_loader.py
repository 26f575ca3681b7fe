"""Training batches from a mixture of sources (data.sources), each with its own token cache.

The examples of the sources are numbered one after another (source s's example i is global row
base_s + i), so that the mixture is one more step before the plan: each epoch, mixture.py says
which examples of each source it takes, and those global rows go to the same planner as a
single cache's (plan.pair_plan: permuted whole, bucketed by width, batched by token budget,
batches shuffled). Everything else, the position, rounds, resume at another world size and the
plan ahead, is CacheLoader's: the position (epoch, batches done) says where in the mixture a
run is. A batch's rows are read from their own source's arrays, a rank's next few batches
together, one gather per source (data/pad.py).

A source's tag is put before each source sentence as its rows are read: it counts in the width
that data.max_len and the token budget see, and the cache stays the same with or without it.
"""

from __future__ import annotations

import logging

import numpy as np

from aiayn.config import DataConfig
from aiayn.data.batch import round_width
from aiayn.data.cache import TokenCache
from aiayn.data.cache_loader import STATE_VERSION, CacheLoader
from aiayn.data.mixture import Mixture
from aiayn.data.pad import cache_arrays
from aiayn.data.plan import Plan, epoch_rng, pair_plan
from aiayn.data.position import fingerprint, recorded_number, saved_position
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def tag_ids(cfg: DataConfig, tok: Tokenizer) -> list[int | None]:
    """Each source's tag as one token id (None: untagged); a tag that is not one piece of the
    tokenizer is an error naming it and the fix."""
    out = []
    for source in cfg.sources:
        if source.tag is None:
            out.append(None)
            continue
        i = tok.piece_to_id(source.tag)
        if i in (tok.unk_id, tok.pad_id, tok.bos_id, tok.eos_id):
            raise DataError(
                f"data.sources {source.name}: tag {source.tag!r} is not a piece of the tokenizer "
                f"{tok.path}, so it would be split or unknown. Add it to tokenizer.user_symbols "
                "and train a new tokenizer (a tokenizer the run trains adds every tag), or "
                "remove the tag"
            )
        out.append(i)
    return out


class MixedCacheLoader(CacheLoader):
    """A Loader (data/loader_protocol.py) over the token caches of data.sources, in training
    only: CacheLoader's, with `mixture_scalars()` saying what the group has taken of each
    source (TensorBoard)."""

    def __init__(
        self,
        caches: list[TokenCache],
        data_cfg: DataConfig,
        tokenizer: Tokenizer,
        *,
        kind: str,
        max_tokens: int,
        seed: int,
        train: bool = True,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
    ):
        if not train or kind == "lm":
            raise ValueError("a mixture of sources is for training seq2seq or classifier models")
        for c in caches:
            if c.kind != kind:
                raise DataError(
                    f"token cache {c.root} holds {c.kind} data, this model is {kind}; "
                    "set data.cache_dir to another directory"
                )
        self._setup(data_cfg, tokenizer, kind, max_tokens, seed, train, rank, world_size)
        self.caches, self.cache, self.pin_memory = caches, caches[0], pin_memory
        self._arrays = [cache_arrays(c) for c in caches]
        self.names = [s.name for s in data_cfg.sources]
        self.tags = tag_ids(data_cfg, tokenizer)
        self._index()
        self._tallies: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._fingerprint = self._mixture_fingerprint()
        if rank == 0:
            self._log_sources()

    def _index(self) -> None:
        """Global widths and target lengths, each source's kept examples, and the mixture."""
        widths, tgt_lens, self._kept, mean_tokens = [], [], [], []
        self._too_long = 0
        for c, tag in zip(self.caches, self.tags, strict=True):
            longest = c.lengths("src") + np.int32(tag is not None)  # a new array
            tgt_len = c.lengths("tgt")
            if tgt_len is not None:
                np.maximum(longest, tgt_len, out=longest)
            kept = np.flatnonzero(longest <= self.cfg.max_len).astype(np.int32)
            self._kept.append(kept)
            self._too_long += len(longest) - len(kept)
            widths.append(round_width(longest + 1, self.multiple, self.cfg.max_len + 1))
            tgt_lens.append(tgt_len if tgt_len is not None else np.zeros(len(c), np.int32))
            # Target tokens per example as Batch.n_tokens counts them: eos included; 1 for a label.
            mean_tokens.append(float(tgt_lens[-1][kept].mean()) + 1 if len(kept) else 1.0)
        if self.kind == "classifier":
            mean_tokens = [1.0] * len(self.caches)
        self._width = np.concatenate(widths).astype(np.int32)
        self._tgt_len = np.concatenate(tgt_lens)
        self._base = np.cumsum([0] + [len(c) for c in self.caches]).astype(np.int64)
        # A plan's rows are per-rank memory, as the single cache's: int32 where they fit.
        self._row_type = np.int32 if self._base[-1] < 2**31 else np.int64
        sizes = np.diff(self._base)
        small = np.int8 if len(sizes) < 128 else np.int16
        self._source_index = np.repeat(np.arange(len(sizes), dtype=small), sizes)
        sizes = [len(k) for k in self._kept]
        try:
            self.mixture = Mixture.of(self.cfg, self.seed, sizes, mean_tokens)
        except ValueError as exc:
            raise DataError(
                f"data.sources: {exc}; raise data.max_len or check the corpus"
            ) from None

    def _mixture_fingerprint(self) -> dict:
        """What a saved position means: the loader's settings and the whole mixture."""
        cfg = self.cfg
        sources = [
            {"name": s.name, "cache": c.digest, "weight": recorded_number(s.weight), "tag": s.tag}
            for s, c in zip(cfg.sources, self.caches, strict=True)
        ]
        mixture = {
            "sources": sources,
            "temperature": recorded_number(cfg.temperature),
            "epoch": cfg.epoch,
        }
        mixture.update(epoch_source=cfg.epoch_source, epoch_size=cfg.epoch_size)
        return fingerprint(self, "cache", {"mixture": mixture})

    def _log_sources(self) -> None:
        m, cfg = self.mixture, self.cfg
        what = {
            "largest": f"one pass of {m.names[int(np.argmax(m.sizes))]}",
            "source": f"one pass of {cfg.epoch_source}",
            "tokens": f"about {cfg.epoch_size or 0:,} target tokens",
        }
        log.info(
            "mixture of %d sources, an epoch (data.epoch %s%s) is %s examples",
            len(m.names),
            cfg.epoch,
            f": {what[cfg.epoch]}" if cfg.epoch in what else "",
            f"{m.epoch_size:,}",
        )
        for s, source in enumerate(cfg.sources):
            weight = f"weight {source.weight:g}, " if source.weight is not None else ""
            log.info(
                "  source %s: %sshare %.1f%%, %s examples, %s per epoch (%.3g passes), tag %s",
                source.name,
                weight,
                100 * m.p[s],
                f"{int(m.sizes[s]):,}",
                f"{int(m.counts[s]):,}",
                m.counts[s] / max(int(m.sizes[s]), 1),
                source.tag or "none",
            )

    # ---- position and counts ------------------------------------------------------------------

    def load_state_dict(self, state: dict) -> None:
        what = "the sources' token caches"
        self._pos = saved_position(state, STATE_VERSION, self._fingerprint, what)
        self.epoch = self._pos["epoch"]
        self._resume_pending = True

    def stats(self) -> dict[str, int]:
        counts = [c.counts() for c in self.caches]
        return {
            "examples_read": sum(c["records_read"] for c in counts),
            "dropped_too_long": self._too_long,
            "dropped_empty": sum(c["dropped_empty"] for c in counts),
            "batches": self._batches,
            "invalid_utf8_skipped": sum(c["invalid_utf8_skipped"] for c in counts),
        }

    def mixture_scalars(self) -> dict[str, float]:
        """What the whole group has taken of each source up to the position (the same on every
        rank, from the plans alone): examples since the run began, passes made over it, and
        its share of the current epoch's target tokens so far (of the epoch's plan, before its
        first batch)."""
        epoch, done = self._pos["epoch"], self._pos["done"]
        examples, tokens = self._tally(epoch)
        while done >= len(examples) > 0:  # a position may count past its epoch's end
            epoch, done = epoch + 1, done - len(examples)
            examples, tokens = self._tally(epoch)
        taken = examples[:done].sum(axis=0)
        share = tokens[:done].sum(axis=0) if done else tokens.sum(axis=0)
        share = share / max(share.sum(), 1)
        passes = self.mixture.passes(epoch, taken)
        out = {}
        for s, name in enumerate(self.names):
            out[f"{name}/examples"] = float(epoch * self.mixture.counts[s] + taken[s])
            out[f"{name}/passes"] = float(passes[s])
            out[f"{name}/token_share"] = float(share[s])
        return out

    def _tally(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """At log time, not when planning: the plan is the batch thread's current one, or made
        again (pure), leaving the batch thread's plans as they are."""
        if epoch not in self._tallies:
            current = self._plan_of
            plan = current[1] if current and current[0] == epoch else self._compute_plan(epoch)
            self._tallies = {e: t for e, t in self._tallies.items() if e >= epoch - 1}
            self._tallies[epoch] = self._plan_tally(plan)
        return self._tallies[epoch]

    def _nothing_left(self) -> DataError:
        return DataError(
            f"the sources give no batches: {self._too_long} examples are longer than "
            f"data.max_len={self.cfg.max_len}; raise data.max_len or check the corpora"
        )

    # ---- plans --------------------------------------------------------------------------------

    def _source_of(self, rows: np.ndarray) -> np.ndarray:
        """Each global row's source: int8 (int16 past 127 sources), by a table lookup, which
        is one memory read a row where a search in the sources' bounds is several."""
        return self._source_index[rows]

    def _row_sources(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        which = self._source_of(rows)
        return which, rows - self._base[which]

    def _target_lengths(self, rows: np.ndarray) -> np.ndarray:
        return self._tgt_len[rows].astype(np.int64)

    def _compute_plan(self, epoch: int) -> Plan:
        picks = self.mixture.epoch_rows(epoch)
        rows = np.concatenate([self._base[s] + self._kept[s][p] for s, p in enumerate(picks)])
        rows = rows.astype(self._row_type)
        rng = epoch_rng(self.seed, epoch)
        if not self.cfg.shuffle_buffer:  # no bucketing, but the sources still interleave
            rows, rng = rows[rng.permutation(len(rows))], None
        return pair_plan(self._width, rows, self.max_tokens, self.cfg.shuffle_buffer, rng)

    def _plan_tally(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """(batches, sources) arrays of examples and target tokens, in the epoch's order."""
        n, S = len(plan), len(self.caches)
        batch = np.repeat(np.arange(n), np.diff(plan.bounds))
        cell = batch * S + self._source_of(plan.rows)
        examples = np.bincount(cell, minlength=n * S).reshape(n, S)
        if self.kind == "classifier":
            tokens = examples
        else:
            weights = self._tgt_len[plan.rows].astype(np.float64) + 1
            tokens = np.bincount(cell, weights=weights, minlength=n * S).reshape(n, S)
        if plan.order is not None:
            examples, tokens = examples[plan.order], tokens[plan.order]
        return examples, tokens
