"""A mixture of sources: how many examples of each source an epoch takes, and which.

Everything here is a function of (seed, the sources' names and sizes, their shares, the epoch
definition, the epoch), computed with numpy on every rank alike, so the mixture needs no
communication and no state of its own: the loader's position (epoch, batches done) says where
in it a run is.

- Counts. Source s's share p_s is weight_s / sum (or N_s^(1/T) / sum with a temperature, N_s
  its examples); the epoch's E examples are shared out by largest remainder (Hamilton's method:
  floor(p_s E) each, the rest one by one to the largest fractions, ties to the earlier source),
  so the counts are integers summing to E that differ from p_s E by less than one.
- Which examples. Source s's examples are read in passes, pass q a permutation of its N_s
  examples seeded from (seed, s's name, q). Epoch e takes the count_s examples after the first
  e x count_s of that endless sequence: with the count fixed per epoch, where each epoch starts
  is a pure function of e. So a source down-sampled in one epoch continues where it stopped in
  the next, nothing repeats within a pass, and an up-sampled source (count_s > N_s) makes whole
  passes in each epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from aiayn.config import Config, DataConfig, SourceConfig, TokenizerConfig
from aiayn.data.splits import sample_sentences
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Keeps the pass permutations' seeds apart from the plan's (plan.epoch_rng(seed, epoch)).
_STREAM = 0x6D6978  # "mix"


def as_train(cfg: Config, source: SourceConfig) -> Config:
    """`cfg` reading `source` as its data.train: how a source's token cache is built and
    keyed (by its own corpus, like any training split), and how its records are read."""
    data = dataclasses.replace(cfg.data, train=source.path, valid=source.valid, sources=[])
    return dataclasses.replace(cfg, data=data)


def cache_folder(source: SourceConfig) -> str:
    """The folder of a source's token cache in data.cache_dir (beside data.train's, train)."""
    return f"train-{source.name}"


def tokenizer_sample(cfg: Config, n: int) -> tuple[TokenizerConfig, list[str]]:
    """What a run's tokenizer is trained with for a mixture: tokenizer config with every tag
    among its user_defined_symbols (so that a tag is one piece), and about n sentences, each
    source's by its weight's share (equal shares under a temperature: the sizes are not known
    before the caches are built)."""
    sources = cfg.data.sources
    weights = None if cfg.data.temperature is not None else [s.weight for s in sources]
    p = shares(np.ones(len(sources)), weights, 1.0)
    sentences = []
    for source, k in zip(sources, largest_remainder(p, n), strict=True):
        data = as_train(cfg, source).data
        sentences += sample_sentences(data, cfg.model.kind, max(int(k), 1), cfg.tokenizer.seed)
    tags = [s.tag for s in sources if s.tag and s.tag not in cfg.tokenizer.user_symbols]
    symbols = list(cfg.tokenizer.user_symbols) + list(dict.fromkeys(tags))
    return dataclasses.replace(cfg.tokenizer, user_symbols=symbols), sentences


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


def mixture_fingerprint(cfg: DataConfig, key: str, data: list) -> dict:
    """What names a mixture in a saved position: each source's data (under `key`: its token
    cache's digest, or its stream's identity), weight and tag, and the epoch's definition. A
    weight of 2 and one of 2.0 are the same."""

    def number(value: float | None) -> float | None:
        return None if value is None else float(value)

    sources = [
        {"name": s.name, key: d, "weight": number(s.weight), "tag": s.tag}
        for s, d in zip(cfg.sources, data, strict=True)
    ]
    return {
        "sources": sources,
        "temperature": number(cfg.temperature),
        "epoch": cfg.epoch,
        "epoch_source": cfg.epoch_source,
        "epoch_size": cfg.epoch_size,
    }


def shares(sizes: np.ndarray, weights: list[float] | None, temperature: float | None) -> np.ndarray:
    """p_s: the weights normalised, or N_s^(1/T) normalised."""
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64)
    else:
        w = np.asarray(sizes, dtype=np.float64) ** (1.0 / float(temperature))
    if w.sum() <= 0:
        raise ValueError("the sources' shares sum to 0: every source is empty")
    return w / w.sum()


def largest_remainder(p: np.ndarray, total: int) -> np.ndarray:
    """Integers summing to `total`, each within one of p_s x total (Hamilton's method)."""
    exact = np.asarray(p, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    left = int(total - counts.sum())
    # Stable sort on the fractions, largest first: a tie goes to the earlier source.
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:left]] += 1
    return counts


def epoch_counts(
    sizes: np.ndarray,
    p: np.ndarray,
    definition: str,
    *,
    names: list[str],
    source: str | None = None,
    size: int | None = None,
    mean_tokens: np.ndarray | None = None,
) -> np.ndarray:
    """Examples of each source in one epoch, for data.epoch = `definition`.

    sum: E = sum N_s. largest / source: one pass over that source, which then takes exactly
    its N_s examples and the others share E - N_s by their shares, E = N_s / p_s.
    examples: E = size. tokens: E = size / sum_s p_s x mean_tokens_s.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if definition == "sum":
        return largest_remainder(p, int(sizes.sum()))
    if definition in ("largest", "source"):
        s = int(np.argmax(sizes)) if definition == "largest" else names.index(source)
        return _one_pass_of(s, sizes, p)
    if definition == "examples":
        return largest_remainder(p, int(size))
    if definition == "tokens":
        per_example = float(np.dot(p, mean_tokens))
        return largest_remainder(p, max(1, round(size / max(per_example, 1e-9))))
    raise ValueError(f"unknown epoch definition {definition!r}")


def _one_pass_of(s: int, sizes: np.ndarray, p: np.ndarray) -> np.ndarray:
    total = round(sizes[s] / p[s])
    others = np.delete(p, s)
    counts = np.zeros(len(sizes), dtype=np.int64)
    if others.sum() > 0:
        rest = largest_remainder(others / others.sum(), max(total - int(sizes[s]), 0))
        counts[np.arange(len(sizes)) != s] = rest
    counts[s] = sizes[s]
    return counts


def name_key(name: str) -> int:
    """A source's seed component: from its name, so that reordering data.sources or adding a
    source leaves the others' passes as they were."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def pass_order(seed: int, name: str, n: int, q: int) -> np.ndarray:
    """Pass q over a source of n examples: a permutation of 0..n-1."""
    return np.random.default_rng([seed, _STREAM, name_key(name), q]).permutation(n)


def take(seed: int, name: str, n: int, start: int, count: int, ordered: bool = True) -> np.ndarray:
    """Items start .. start + count - 1 of the source's endless sequence of passes (indices
    0..n-1): the examples one epoch takes, from position start = epoch x count on.

    ordered=False gives the same examples, a whole pass in index order (no permutation to
    make: the plan permutes the epoch anyway); a part of a pass still needs its permutation,
    which says which examples it holds."""
    if n == 0 or count == 0:
        return np.zeros(0, dtype=np.int64)
    out, pos, end = [], start, start + count
    while pos < end:
        q, within = divmod(pos, n)
        step = min(n - within, end - pos)
        if step == n and not ordered:
            out.append(np.arange(n, dtype=np.int64))
        else:
            out.append(pass_order(seed, name, n, q)[within : within + step])
        pos += step
    return np.concatenate(out)


@dataclass(frozen=True)
class Mixture:
    """The mixture of one run: each source's name, size (examples kept after data.max_len),
    share and count per epoch."""

    seed: int
    names: list[str]
    sizes: np.ndarray
    p: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, cfg: DataConfig, seed: int, sizes, mean_tokens) -> Mixture:
        names = [s.name for s in cfg.sources]
        sizes = np.asarray(sizes, dtype=np.int64)
        weights = None if cfg.temperature is not None else [s.weight for s in cfg.sources]
        p = shares(sizes, weights, cfg.temperature)
        counts = epoch_counts(
            sizes,
            p,
            cfg.epoch,
            names=names,
            source=cfg.epoch_source,
            size=cfg.epoch_size,
            mean_tokens=np.asarray(mean_tokens, dtype=np.float64),
        )
        # A source that has no example left cannot give any: refuse rather than loop.
        empty = [n for n, size, c in zip(names, sizes, counts, strict=True) if c and not size]
        if empty:
            raise ValueError(f"source(s) {', '.join(empty)} have no example within data.max_len")
        return cls(seed, names, sizes, p, counts)

    @property
    def epoch_size(self) -> int:
        return int(self.counts.sum())

    def epoch_rows(self, epoch: int) -> list[np.ndarray]:
        """Per source, the indices (0..N_s - 1, into its kept examples) epoch `epoch` takes,
        as a set: whole passes in index order (the plan permutes the epoch)."""
        return [
            take(self.seed, name, int(n), epoch * int(c), int(c), ordered=False)
            for name, n, c in zip(self.names, self.sizes, self.counts, strict=True)
        ]

    def log(self, cfg: DataConfig, sizes_known: bool = True) -> None:
        """The mixture as a start logs it: the epoch, and a line per source (sizes_known=False:
        streams whose sizes were not counted)."""
        what = {
            "largest": f"one pass of {self.names[int(np.argmax(self.sizes))]}",
            "source": f"one pass of {cfg.epoch_source}",
            "tokens": f"about {cfg.epoch_size or 0:,} target tokens",
        }
        log.info(
            "mixture of %d sources, an epoch (data.epoch %s%s) is %s examples",
            len(self.names),
            cfg.epoch,
            f": {what[cfg.epoch]}" if cfg.epoch in what else "",
            f"{self.epoch_size:,}",
        )
        for s, source in enumerate(cfg.sources):
            weight = f"weight {source.weight:g}, " if source.weight is not None else ""
            count, size = f"{int(self.counts[s]):,} per epoch", int(self.sizes[s])
            of = f"{size:,} examples, {count} ({self.counts[s] / max(size, 1):.3g} passes)"
            log.info(
                "  source %s: %sshare %.1f%%, %s, tag %s",
                source.name,
                weight,
                100 * self.p[s],
                of if sizes_known else f"{count} (size unknown: streamed)",
                source.tag or "none",
            )

    def passes(self, epoch: int, taken: np.ndarray | None = None) -> np.ndarray:
        """Passes made over each source by the start of `epoch` plus `taken` of its examples."""
        done = epoch * self.counts + (0 if taken is None else taken)
        return done / np.maximum(self.sizes, 1)
