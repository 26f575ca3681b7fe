"""The engine interface: backward, clipping, optimizer and schedule, once per accumulation
boundary.

The training loop talks to an `Engine` and nothing else, so one process, DDP
(engine/ddp_engine.py), DeepSpeed (engine/deepspeed_engine.py) and FSDP2
(engine/fsdp_engine.py) take each other's place without the loop changing;
engine/registry.py builds the one a config names and hands it the `Recipe` (engine/recipe.py:
the optimizer, schedule, clipping, precision and EMA every engine trains with). The engines
import what they share from below them (precision.autocast, engine/replicas.py), never this
module or each other.
"""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from aiayn.distributed.env import DistEnv
from aiayn.engine.ema import EMA
from aiayn.engine.state import Portable, Weights


class Engine(Protocol):
    """What the training loop, validation and the checkpoint code call."""

    model: nn.Module  # what the loop calls forward on: the module, or a DDP/DeepSpeed wrapper
    module: nn.Module  # the bare model (ZeRO-3: this rank's partition of it)
    device: torch.device
    optimizer: Any
    loads_weights: bool  # True: model.safetensors is loaded into `module` before the state
    partitioned: bool  # True: `module`'s forward is a collective (ZeRO-3 gathers each layer)
    ema: EMA | None  # train.ema: this rank's share of the weights' moving average, or None

    @property
    def lr(self) -> float: ...

    @property
    def loss_scale(self) -> float: ...

    @property
    def skipped_steps(self) -> int: ...

    def autocast(self) -> ContextManager: ...

    def accumulating(self, last: bool) -> ContextManager:
        """Context for one micro-batch's forward and backward; `last` ends the step."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, clear gradients; return the grad norm."""

    def train(self, mode: bool = True) -> None: ...

    def full_module(self) -> ContextManager[nn.Module]:
        """The whole model with all its weights, on every rank (a collective where parameters
        are partitioned): for validation, decoding and writing model.safetensors."""

    def weights(self) -> ContextManager[Weights]:
        """What a save writes into model.safetensors, each rank its byte range of it: without
        the whole model on any rank where parameters are partitioned (a collective there)."""

    def ema_weights(self) -> ContextManager[Weights | None]:
        """What a save writes into ema.safetensors (train.ema; None when off): `weights()`
        with the EMA's values, gathered one tensor at a time where it is partitioned."""

    def ema_applied(self) -> ContextManager[None]:
        """The EMA's values in the model while the `with` lasts, then the weights back bit
        for bit (train.ema_validate)."""

    def replicas_differ(self, env: DistEnv) -> bool: ...

    def save_shards(self, directory: Path) -> list[Path]:
        """Write this rank's share of the state into `directory` (a collective); return the
        files this rank wrote (it hashes them: no other rank reads them back to)."""

    def state_dict(self) -> dict[str, Any]:
        """What rank 0's trainer state holds for this engine."""

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        """Restore from `state` (rank 0's trainer state) and this rank's shards in
        `checkpoint`, saved by an engine of the same topology."""

    def load_portable(self, state: Portable) -> None:
        """Restore from a checkpoint written on another topology (checkpoint/reshard.py)."""
