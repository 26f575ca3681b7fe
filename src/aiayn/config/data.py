"""What a run reads: the `data` section (splits, their format and fields, length limits, the
token cache) and its mixture of corpora, `data.sources`, each a SourceConfig."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from aiayn.config.checks import Section, bounded, range_errors

# A source's name becomes part of a directory and of TensorBoard tags (valid_<name>/bleu).
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass
class SourceConfig(Section):
    """One corpus of a mixture (data.sources). The rest of the data section (format,
    languages, fields, max_len) applies to every source."""

    name: str = ""
    """Required. What logs, TensorBoard (data/<name>/..., valid_<name>/...) and the token cache
    (<cache_dir>/train-<name>) call it: letters, digits, _ and -."""
    path: str = ""
    """Required. What data.train takes: a file prefix (parallel), a path or glob, or a hub split
    name (of data.hub_name)."""
    weight: float | None = bounded(None, low=0, low_open=True)
    """Its share of the epoch's examples is weight / sum of the weights (rounded by largest
    remainder). Give every source a weight, or data.temperature instead."""
    tag: str | None = None
    """A token put before each of its training examples' source sentence (e.g. <BT> for
    back-translated data). It must be one piece of the tokenizer: a tokenizer trained by the
    run adds every tag to its user_defined_symbols. Counts towards max_len and the token
    budget; validation, test and inference inputs are never tagged."""
    valid: str | None = None
    """Its own dev set (same form as path), scored at each validation as valid_<name>/...;
    data.valid stays the one checkpoint.best_metric ranks by."""

    def validate(self) -> list[str]:
        errs = []
        if not SOURCE_NAME.fullmatch(self.name):
            errs.append(
                f"name {self.name!r} must be letters, digits, _ and - (it names a directory and "
                "TensorBoard tags)"
            )
        if not self.path:
            errs.append("path is required (what data.train takes)")
        if self.tag is not None and (not self.tag or any(c.isspace() for c in self.tag)):
            errs.append(f"tag {self.tag!r} must be one token: no spaces, not empty")
        return errs


@dataclass
class DataConfig(Section):
    format: Literal["parallel", "tsv", "jsonl", "parquet", "text", "hub"] = "parallel"
    """parallel: PREFIX.SRC + PREFIX.TGT line-aligned files (gzip allowed); tsv/jsonl/parquet:
    one file (or glob) per split; text: one document per line (lm); hub: a hub dataset name."""
    train: str | None = None
    """Training split: a file prefix (parallel), a path or glob, or a hub split name."""
    valid: str | None = None
    """Validation split, same form as train."""
    test: str | None = None
    """Test split, same form as train."""
    src_lang: str = "de"
    """Source language: the file suffix (parallel) and the default source field."""
    tgt_lang: str = "en"
    """Target language: the file suffix (parallel) and the default target field."""
    src_field: str | None = None
    """Field holding the source text (dots reach into nested records: translation.de)."""
    tgt_field: str | None = None
    """Field holding the target text."""
    text_field: str = "text"
    """Field holding the text (lm, classifier)."""
    label_field: str = "label"
    """Field holding the integer class (classifier)."""
    hub_name: str | None = None
    """Hub dataset name for format hub, e.g. bentrevett/multi30k or wmt/wmt14."""
    hub_config: str | None = None
    """Hub dataset configuration, e.g. de-en."""
    hub_revision: str | None = None
    """Hub dataset revision (a commit, tag or branch) for format hub. Unset, the first start
    records the commit the Hub serves (run_dir/data/hub_revision.json) and every later start
    reads that one, so a restart reads the same records after the dataset changed."""
    max_len: int = bounded(256, low=2)
    """Examples with more tokens than this on either side are dropped and counted."""
    shuffle_buffer: int = bounded(10_000, low=0)
    """The window of the batch plan (data/plan.py): examples sorted by width together, then cut
    into token-budget batches. The token cache permutes the epoch whole before cutting it into
    windows; a stream reads one window at a time (its chunk) and permutes within it. 0: no
    sorting, the order kept."""
    on_invalid_utf8: Literal["skip", "error"] = "skip"
    """A line that is not valid UTF-8 is skipped and counted, or stops the run."""
    cache: bool = True
    """true: the training split is tokenised once (`aiayn data prepare`, or at the start of
    `aiayn train` if missing) into memory-mapped arrays; every rank plans the epoch's batches
    from their lengths and reads only its own, and the epoch is shuffled whole, bucketed in
    windows of shuffle_buffer. false: stream and tokenise while training (nothing written to
    disk; every rank reads and tokenises the whole stream)."""
    lm_order: Literal["documents", "stream"] = "documents"
    """How an lm reads its training split (token cache only). documents: one document per line,
    empty lines dropped, documents shuffled each epoch. stream: the lines in corpus order form
    one running text (eos marks each line break, empty lines included), cut into blocks at a
    random offset each epoch, blocks shuffled: for books and articles, whose lines continue
    each other."""
    unit: Literal["tokens", "characters", "words"] = "tokens"
    """What an lm's evaluation counts besides tokens, so that models with different tokenizers
    compare: characters gives bits per character, words word-level perplexity (whitespace-
    separated words, plus one per line for its end)."""
    cache_dir: str | None = None
    """Where token caches live, one folder per split; default <run_dir>/data_cache. Point runs
    on the same data and tokenizer at one directory to tokenise once for all of them.
    Environment variables are expanded on each node ($SLURM_TMPDIR/aiayn_cache)."""
    cache_scope: Literal["shared", "node"] = "shared"
    """shared: cache_dir is storage every node sees; the ranks build the cache together and
    verify it together, each its share. node: cache_dir is each node's own disk; each node
    builds (its ranks sharing the reading) or opens its own copy, its ranks verify it, each its
    share, and every node's copy must hold the same tokens as rank 0's."""
    pad_to_multiple: int | None = bounded(None, low=1)
    """A batch's source and target widths are rounded up to a multiple of this (never past
    max_len + 1), and the token budget counts the rounding. Fewer distinct shapes mean fewer
    torch.compile graphs, and tensor cores want multiples of 8. None (auto): 8 on CUDA, 1 (no
    rounding) on CPU; the run's config.yaml records the value used. lm blocks are max_len wide
    whatever it is."""

    sources: list[SourceConfig] = field(default_factory=list)
    """Train on a mixture of corpora instead of data.train: a list of {name, path, weight or
    (with temperature) none, tag, valid} (SourceConfig), for model.kind seq2seq or classifier.
    Each source has its own token cache (or, with data.cache false, its own stream: then
    data.epoch is not tokens); every epoch takes a fixed count of each source's
    examples, a function of (train.seed, the sources, their weights, the epoch) alone, so the
    batches are the same at any world size and a resume is exact (docs/data.md#mixtures)."""
    temperature: float | None = bounded(None, low=0, low_open=True)
    """Instead of weights: source s's share is N_s^(1/T) / sum, N_s its examples (T = 1: by
    size; larger T: flatter, up-sampling small sources)."""
    epoch: Literal["sum", "largest", "source", "examples", "tokens"] = "sum"
    """What one epoch of a mixture is. sum: as many examples as all sources hold; largest: one
    pass over the largest source; source: one pass over data.epoch_source; examples: epoch_size
    examples; tokens: about epoch_size target tokens (epoch_size / the mixture's mean target
    tokens per example, eos included). The start-up log says how many examples that is."""
    epoch_source: str | None = None
    """The source whose one pass is an epoch (data.epoch source)."""
    epoch_size: int | None = bounded(None, low=1)
    """Examples (data.epoch examples) or target tokens (data.epoch tokens) of an epoch."""

    def validate(self) -> list[str]:
        errs = self._validate_sources() if self.sources else self._validate_no_sources()
        if self.train is None and not self.sources:
            errs.append(
                "data.train is required (a file prefix, path, or hub split name), or "
                "data.sources for a mixture"
            )
        if self.format == "hub" and not self.hub_name:
            errs.append("data.hub_name is required when data.format is hub")
        if self.cache_scope == "node" and not self.cache_dir:
            errs.append(
                "data.cache_scope=node keeps a copy of the token cache on each node's own disk: "
                "set data.cache_dir to a directory there (e.g. $SLURM_TMPDIR/aiayn_cache)"
            )
        if self.lm_order == "stream" and not self.cache:
            errs.append(
                "data.lm_order=stream plans the whole text's blocks and needs the token cache: "
                "set data.cache=true (or data.lm_order=documents)"
            )
        return errs

    def _validate_no_sources(self) -> list[str]:
        used = [
            f"data.{k}"
            for k, default in (("temperature", None), ("epoch", "sum"), ("epoch_source", None))
            if getattr(self, k) != default
        ] + (["data.epoch_size"] if self.epoch_size is not None else [])
        if used:
            return [f"{', '.join(used)} describe a mixture: set data.sources (or remove them)"]
        return []

    def _validate_sources(self) -> list[str]:
        errs = []
        for i, source in enumerate(self.sources):
            where = f"data.sources[{i}]"
            errs += range_errors(source, where)
            errs += [f"{where}.{e}" for e in source.validate()]
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            errs.append(f"data.sources: each name once; {', '.join(twice)} given twice")
        if self.train is not None:
            errs.append(
                "data.train and data.sources are both set: one source is data.train, a mixture "
                "is data.sources (move data.train into it as a source)"
            )
        weighted = [s.name for s in self.sources if s.weight is not None]
        if self.temperature is not None and weighted:
            errs.append(
                f"data.temperature sets every source's share: remove the weights of "
                f"{', '.join(weighted)} (or data.temperature)"
            )
        if self.temperature is None and len(weighted) != len(self.sources):
            missing = [s.name for s in self.sources if s.weight is None]
            errs.append(
                f"data.sources {', '.join(missing)} have no weight: give every source a "
                "weight, or set data.temperature"
            )
        errs += self._validate_epoch(names)
        if not self.cache and self.epoch == "tokens":
            errs.append(
                "data.epoch=tokens needs the sources' mean lengths, which a stream does not "
                "have before it is tokenised whole: with data.cache=false, give the epoch in "
                "examples (data.epoch=examples) or by the sources' sizes (sum, largest, "
                "source), or set data.cache=true"
            )
        return errs

    def _validate_epoch(self, names: list[str]) -> list[str]:
        errs = []
        if self.epoch == "source" and self.epoch_source not in names:
            errs.append(
                f"data.epoch=source counts one pass over data.epoch_source, which must name a "
                f"source ({', '.join(names)}); got {self.epoch_source!r}"
            )
        if self.epoch != "source" and self.epoch_source is not None:
            errs.append("data.epoch_source is for data.epoch=source")
        sized = self.epoch in ("examples", "tokens")
        if sized and self.epoch_size is None:
            errs.append(f"data.epoch={self.epoch} needs data.epoch_size ({self.epoch} per epoch)")
        if not sized and self.epoch_size is not None:
            errs.append("data.epoch_size is for data.epoch=examples or tokens")
        return errs
