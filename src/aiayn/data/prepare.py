"""A run's data made ready before training: a Hub training split copied once to local files
(data/hub_copy.py), the tokenizer (trained by rank 0 from the training stream if missing) and
the training split's token cache (built by all ranks together), or a cache per data.sources
entry. What `aiayn train`, `aiayn tokenizer train` and
`aiayn data prepare` share."""

from __future__ import annotations

import logging
from pathlib import Path

from aiayn.config import Config
from aiayn.data import TokenCache, ensure_cache, sample_sentences
from aiayn.data.cache import MANIFEST, cache_dir
from aiayn.data.hub_copy import local_parts, materialise
from aiayn.data.mixture import as_train, cache_folder, tag_ids, tokenizer_sample
from aiayn.distributed.env import DistEnv
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger("aiayn")

LARGE_WORLD = 16
"""From this many ranks (two nodes of 8 GPUs) a start that prepares its own data says so, and
how to prepare it first. Below it a job is one node, and preparing at the first start is the
convenience the demos and tests rely on; from it, every minute a start spends training a
tokenizer on rank 0 or building a cache (or copying a Hub split) idles 15 or more GPUs on
several nodes, while a CPU job does the same work on CPUs
(slurm/prepare.sbatch)."""

PREPARE_FIRST = (
    "prepare the data in a step of its own before the GPUs start: `aiayn data prepare --config "
    "FILE` (the tokenizer and the token cache; `aiayn tokenizer train --config FILE` for the "
    "tokenizer alone), under Slurm as a CPU job (slurm/prepare.sbatch CONFIG, then train.sbatch "
    "with --dependency=afterok); docs/data.md"
)


def prepare_tokenizer(cfg: Config, retrain: bool = False) -> Tokenizer:
    """Load the run's tokenizer, training it first from the training stream if it is missing
    (from a Hub split's local copy where there is one)."""
    path = cfg.tokenizer_path
    if path.is_file() and not retrain:
        return Tokenizer(path)
    n = cfg.tokenizer.sample_sentences
    log.info(
        "training a %s tokenizer (vocab %d) on up to %d sentences of %s -> %s",
        cfg.tokenizer.type,
        cfg.tokenizer.vocab_size,
        n,
        cfg.data.train or ", ".join(s.name for s in cfg.data.sources),
        path,
    )
    if not cfg.data.sources:
        sentences = sample_sentences(
            cfg.data, cfg.model.kind, n, cfg.tokenizer.seed, local=local_parts(cfg)
        )
        return train_tokenizer(cfg.tokenizer, sentences, path)
    return train_tokenizer(*tokenizer_sample(cfg, n), path)


def prepare_data(
    cfg: Config, env: DistEnv, rebuild: bool = False
) -> tuple[Tokenizer, TokenCache | list[TokenCache] | None]:
    """The tokenizer (trained by rank 0 if missing) and, with data.cache, the training split's
    token cache (built by all ranks together if missing), or a list of each data.sources
    entry's cache. Every rank calls it.

    A Hub training split is first copied to local files by the ranks together (each node's
    ranks, for a node-local cache), once: the tokenizer, the cache and a stream read the copy."""
    shared = cfg.data.cache_scope == "shared"
    # A node-local cache: each node's copy, built by its ranks together, verified by its first.
    rank, world, sync = (
        (env.rank, env.world_size, env.gather)
        if shared
        else (env.local_rank, env.local_world_size, env.node_gather)
    )
    # The Hub is copied only where something reads it: a restart, whose tokenizer and cache
    # exist, reads neither the Hub nor the copy. Decided as rank 0 sees it, for all.
    missing = [rebuild or not (root / MANIFEST).is_file() for root in _cache_roots(cfg)]
    reads = not cfg.data.cache or not cfg.tokenizer_path.is_file() or any(missing)
    missing, reads = sync((missing, reads))[0]
    local = materialise(cfg, rank, world, sync) if reads else None
    if env.is_main:  # one writer: the others wait, then load what it trained
        tok = prepare_tokenizer(cfg)
    env.barrier()
    if not env.is_main:
        tok = Tokenizer(cfg.tokenizer_path)
    tag_ids(cfg.data, tok)  # a tag the tokenizer splits: refused before any cache is built
    if not cfg.data.cache:
        if env.distributed and env.is_main:
            log.warning(
                "data.cache=false on %d ranks: every rank reads and tokenises the whole training "
                "stream and keeps 1/%d of it, so each rank gets 1/%d of one process's input rate. "
                "Set data.cache=true to tokenise once, shared by the ranks",
                env.world_size,
                env.world_size,
                env.world_size,
            )
        return tok, None

    def build(train: Config, **where) -> TokenCache:
        return ensure_cache(
            train, "train", tok, rank=rank, world_size=world, sync=sync, rebuild=rebuild, **where
        )

    if cfg.data.sources:  # a mixture: a cache per source, each keyed by its own corpus
        caches = []
        for source, copy in zip(cfg.data.sources, sync(missing)[0], strict=True):
            train = as_train(cfg, source)
            local_copy = materialise(train, rank, world, sync) if copy else None
            caches.append(build(train, folder=cache_folder(source), local=local_copy))
    else:
        caches = [build(cfg, local=local)]
    if not shared:
        for cache in caches:
            _same_tokens_on_every_node(env, cache)
    return tok, caches if cfg.data.sources else caches[0]


def warn_serial_start(cfg: Config, world_size: int) -> list[str]:
    """At LARGE_WORLD ranks or more, warn of what this start prepares while the GPUs wait: a
    tokenizer that rank 0 trains, a token cache to build (on the GPUs' time), a Hub split
    that every rank reads whole. Called by a training start on rank 0 (one line, not W), not by
    `aiayn data prepare`, which is the way out; returns the warnings."""
    if world_size < LARGE_WORLD:
        return []
    out = []
    if not cfg.tokenizer_path.is_file():
        out.append(
            f"the tokenizer {cfg.tokenizer_path} does not exist: rank 0 trains it now, from up "
            f"to {cfg.tokenizer.sample_sentences} sentences, while the other {world_size - 1} "
            "ranks wait"
        )
    hub = [c for c in _train_configs(cfg) if c.data.format == "hub"]
    if not cfg.data.cache and hub:
        out.append(
            f"data.cache=false with a Hub dataset on {world_size} ranks: the split is copied "
            "from the Hub once, then every rank reads and tokenises the whole copy at every "
            f"start and keeps 1/{world_size} of it. Set data.cache=true"
        )
    missing = [root for root in _cache_roots(cfg) if not (root / MANIFEST).is_file()]
    if cfg.data.cache and missing:
        streamed = (
            " (a Hub split is first copied from the Hub, each of its data files by one rank, "
            "while the others wait)"
        )
        out.append(
            f"the token cache {', '.join(map(str, missing))} does not exist: the {world_size} "
            "ranks build it now, while training waits" + (streamed if hub else "")
        )
    for problem in out:
        log.warning("%s. Next time, %s", problem, PREPARE_FIRST)
    return out


def _train_configs(cfg: Config) -> list[Config]:
    """The config of each training corpus: the split's, or each data.sources entry's."""
    return [as_train(cfg, s) for s in cfg.data.sources] if cfg.data.sources else [cfg]


def _cache_roots(cfg: Config) -> list[Path]:
    """Where prepare_data's ensure_cache calls find (or build) the training caches."""
    if cfg.data.sources:
        return [cache_dir(as_train(cfg, s), cache_folder(s)) for s in cfg.data.sources]
    return [cache_dir(cfg, "train")]


def _same_tokens_on_every_node(env: DistEnv, cache: TokenCache) -> None:
    """Every node trains on what rank 0's copy holds: one broadcast, one sum."""
    ours = env.broadcast(cache.digest)
    differ = env.sum([float(cache.digest != ours)])[0]
    if differ:
        raise DataError(
            f"data.cache_scope=node: {int(differ)} rank(s) hold a token cache in {cache.root} "
            "with other tokens than rank 0's copy: the nodes built theirs from different "
            "corpus files or settings. Remove the copies (aiayn data prepare --force on each "
            "node rebuilds them) and give every node the same corpus"
        )
