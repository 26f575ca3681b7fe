"""Which row source a run config describes: one split's token cache, a mixture's caches, or a
stream (one split's, or a mixture's sources); and the one Loader over it (loader.py)."""

from __future__ import annotations

from aiayn.config import Config
from aiayn.data.cache import TokenCache
from aiayn.data.cache_rows import CacheRows
from aiayn.data.hub_copy import local_parts
from aiayn.data.loader import Loader
from aiayn.data.position import Settings
from aiayn.data.stream_rows import StreamRows
from aiayn.tokenizer import Tokenizer


def make_loader(
    cfg: Config,
    split: str | None,
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
    given (data/cache/format.py), from the caches of data.sources if a list is (a mixture),
    else streamed and tokenised as it goes (a mixture's sources where data.sources is set).
    pin_memory where the batches go to a GPU; local_rank and local_world_size place the rank
    on its node, where a token cache's loader shares the epochs' plans (data/plan_files.py)."""
    # Training plans in units (train.unit_tokens, else max_tokens); a pass plans in forwards.
    budget = cfg.train.unit() if train else cfg.train.max_tokens
    settings = Settings(cfg.data, tokenizer, cfg.model.kind, budget, cfg.train.seed, train, rank)
    if cache is not None:
        caches = cache if isinstance(cache, list) else [cache]
        node = (
            rank if local_rank is None else local_rank,
            world_size if local_world_size is None else local_world_size,
        )
        rows = CacheRows(caches, settings, *node)
    else:
        # A Hub training split is streamed from its local copy where prepare_data made one.
        local = local_parts(cfg) if train and split == cfg.data.train else None
        rows = StreamRows(settings, split, local, cfg)
    # Training: a round is an optimizer step's units, shared out among the ranks, and fused
    # into forwards of up to max_tokens where one holds several.
    per_round = cfg.train.step_units(world_size) if train else None
    fuse_to = cfg.train.max_tokens if train and cfg.train.fuses() else None
    return Loader(rows, cfg.train.max_tokens, rank, world_size, pin_memory, per_round, fuse_to)
