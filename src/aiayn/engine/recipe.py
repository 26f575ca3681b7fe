"""How every engine trains, built once from the run config by engine/registry.py's
`build_engine` and handed to the engine: Adam and the paper's schedule (as factories over the
parameters the engine holds: whole tensors, or FSDP2's DTensors), clipping, precision and the
EMA's settings. An engine owns where the parameters and their state live, not how they are
updated; DeepSpeed builds its own Adam from the same settings (deepspeed_config.py) and takes
the schedule from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from aiayn.config import Config
from aiayn.engine.ema import EMA, Gather, Piece, Sources
from aiayn.engine.optim import build_optimizer, paper_schedule


@dataclass(frozen=True)
class Recipe:
    precision: str  # train.precision
    clip_norm: float  # 0: not clipped
    loss_scale_init: float  # fp16's first loss scale
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    schedule: Callable[[torch.optim.Optimizer], LambdaLR]  # stepped once per optimizer step
    ema_decay: float | None  # train.ema; None: no EMA
    ema_warmup: bool

    def ema(self, pieces: list[Piece], sources: Sources, gather: Gather | None = None) -> EMA:
        """The EMA of the share of the weights an engine keeps (`pieces`, read by `sources`)."""
        return EMA(self.ema_decay, pieces, sources, gather, self.ema_warmup)


def recipe(cfg: Config, device: torch.device) -> Recipe:
    train = cfg.train
    return Recipe(
        precision=train.precision,
        clip_norm=train.clip_norm,
        loss_scale_init=train.loss_scale_init,
        optimizer=lambda params: build_optimizer(params, cfg, device),
        schedule=lambda optimizer: paper_schedule(optimizer, cfg),
        ema_decay=train.ema,
        ema_warmup=train.ema_warmup,
    )
