"""Which loader a run config describes: one split's token cache, a mixture's caches, or a
stream (one split's, or a mixture's sources). Above the loaders, so that none imports another
to choose."""

from __future__ import annotations

from aiayn.config import Config
from aiayn.data.cache import TokenCache
from aiayn.data.cache_loader import CacheLoader
from aiayn.data.loader_protocol import Loader
from aiayn.data.mixed_cache_loader import MixedCacheLoader
from aiayn.data.mixed_stream_loader import MixedStreamLoader
from aiayn.data.stream_loader import StreamLoader
from aiayn.tokenizer import Tokenizer


def make_loader(
    cfg: Config,
    split: str,
    tokenizer: Tokenizer,
    *,
    train: bool,
    rank: int = 0,
    world_size: int = 1,
    cache: TokenCache | list[TokenCache] | None = None,
    pin_memory: bool = False,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> Loader:
    """The loader of one split as a run config describes it: from its token cache if one is
    given (data/cache/format.py), from the caches of data.sources if a list is (a mixture,
    data/mixed_cache_loader.py), else streamed and tokenised as it goes (a mixture's sources:
    data/mixed_stream_loader.py). pin_memory where the batches go to a GPU; local_rank and
    local_world_size place the rank on its node, where one token cache's loader shares the
    epochs' plans (data/plan_files.py)."""
    common = dict(
        pin_memory=pin_memory,
        kind=cfg.model.kind,
        max_tokens=cfg.train.max_tokens,
        seed=cfg.train.seed,
        train=train,
        rank=rank,
        world_size=world_size,
    )
    if isinstance(cache, list):
        return MixedCacheLoader(cache, cfg.data, tokenizer, **common)
    if cfg.data.sources and train:
        return MixedStreamLoader(cfg, tokenizer, **common)
    if cache is not None:
        node = dict(local_rank=local_rank, local_world_size=local_world_size)
        return CacheLoader(cache, cfg.data, tokenizer, **common, **node)
    return StreamLoader(cfg.data, split, tokenizer, **common)
