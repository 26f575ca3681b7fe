"""A run's data made ready before training: the tokenizer (trained by rank 0 from the training
stream if missing) and the training split's token cache (built by all ranks together), or a
cache per data.sources entry. What `aiayn train`, `aiayn tokenizer train` and
`aiayn data prepare` share."""

from __future__ import annotations

import logging

from aiayn.config import Config
from aiayn.data import TokenCache, ensure_cache, sample_sentences
from aiayn.data.mixed_cache_loader import tag_ids
from aiayn.data.mixture import as_train, cache_folder, tokenizer_sample
from aiayn.distributed.env import DistEnv
from aiayn.errors import DataError
from aiayn.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger("aiayn")


def prepare_tokenizer(cfg: Config, retrain: bool = False) -> Tokenizer:
    """Load the run's tokenizer, training it first from the training stream if it is missing."""
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
        sentences = sample_sentences(cfg.data, cfg.model.kind, n, cfg.tokenizer.seed)
        return train_tokenizer(cfg.tokenizer, sentences, path)
    return train_tokenizer(*tokenizer_sample(cfg, n), path)


def prepare_data(
    cfg: Config, env: DistEnv, rebuild: bool = False
) -> tuple[Tokenizer, TokenCache | list[TokenCache] | None]:
    """The tokenizer (trained by rank 0 if missing) and, with data.cache, the training split's
    token cache (built by all ranks together if missing), or a list of each data.sources
    entry's cache. Every rank calls it."""
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
    shared = cfg.data.cache_scope == "shared"
    # A node-local cache: each node's copy, built by its ranks together, verified by its first.
    rank, world, sync = (
        (env.rank, env.world_size, env.gather)
        if shared
        else (env.local_rank, env.local_world_size, env.node_gather)
    )
    if cfg.data.sources:  # a mixture: a cache per source, each keyed by its own corpus
        caches = [
            ensure_cache(
                as_train(cfg, source),
                "train",
                tok,
                rank=rank,
                world_size=world,
                sync=sync,
                rebuild=rebuild,
                folder=cache_folder(source),
            )
            for source in cfg.data.sources
        ]
    else:
        caches = [
            ensure_cache(cfg, "train", tok, rank=rank, world_size=world, sync=sync, rebuild=rebuild)
        ]
    if not shared:
        for cache in caches:
            _same_tokens_on_every_node(env, cache)
    return tok, caches if cfg.data.sources else caches[0]


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
