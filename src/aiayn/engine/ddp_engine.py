"""The PyTorch engines of distributed.backend=ddp: one process on one device (`LocalEngine`), or
DistributedDataParallel across processes (`DDPEngine`), behind the `Engine` interface
(engine/interface.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiayn.config import Config
from aiayn.distributed.env import DistEnv
from aiayn.engine.ema import saved_weights, whole_pieces
from aiayn.engine.kind import Kind
from aiayn.engine.optim import clip_gradients, load_schedule, load_torch_adam
from aiayn.engine.precision import autocast
from aiayn.engine.recipe import Recipe
from aiayn.engine.replicas import replicas_differ
from aiayn.engine.state import WEIGHT, Portable, Weights, trainable

KIND = Kind(
    name="ddp",
    title="DDP",
    build="aiayn.engine.ddp_engine:build",
    any_world=True,  # a torch optimizer's state is the same whole copy on any number of ranks
)


def build(model: nn.Module, cfg: Config, env: DistEnv, recipe: Recipe, rebuild=None) -> LocalEngine:
    """DDP across processes, or the plain engine in one."""
    if env.distributed:
        return DDPEngine(model, recipe, env)
    return LocalEngine(model, recipe, env.device)


class LocalEngine:
    """One process, one device."""

    loads_weights = True  # model.safetensors holds the whole model
    partitioned = False  # every rank holds the whole model

    def __init__(self, model: nn.Module, recipe: Recipe, device: torch.device):
        self.module = model.to(device)
        self.model = self.module  # what the loop calls; a wrapper (DDP) in other engines
        self.device = device
        self.clip_norm = recipe.clip_norm
        self.precision = recipe.precision
        named = trainable(self.module)
        params = [p for _, p in named]
        self.optimizer = recipe.optimizer(params)
        self.scheduler = recipe.schedule(self.optimizer)
        # fp16 needs loss scaling; fp32 and bf16 do not, and a disabled scaler is a no-op.
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=recipe.loss_scale_init, enabled=self.precision == "fp16"
        )
        self.skipped_steps = 0
        self.ema = None  # train.ema: every rank holds the whole weights, and their whole EMA
        if recipe.ema_decay is not None:
            self.ema = recipe.ema(whole_pieces(self.module, named), lambda: params)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def autocast(self):
        return autocast(self.device, self.precision)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def accumulating(self, last: bool):
        return contextlib.nullcontext()

    def replicas_differ(self, env: DistEnv) -> bool:
        return replicas_differ(self.module, env)

    def step(self) -> torch.Tensor:
        if self.ema is not None:
            self.ema.begin()  # before the first update: the average includes the start
        # The norm stays a tensor so the caller decides when to pay for a host sync.
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.module.parameters(), self.clip_norm)
        skipped = self.skipped_steps
        if self.scaler.is_enabled():
            # An overflowing fp16 step is skipped, schedule included, as DeepSpeed does: the
            # schedule counts applied updates. The scale's drop is the only public sign of it.
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:
                self.skipped_steps += 1
            else:
                self.scheduler.step()
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and self.skipped_steps == skipped:  # not after a skipped step
            self.ema.update()
        return grad_norm.detach()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @contextlib.contextmanager
    def full_module(self):
        yield self.module

    @contextlib.contextmanager
    def weights(self):
        yield Weights.of(self.module)

    def ema_weights(self):
        return saved_weights(self)

    def ema_applied(self):
        return self.ema.applied([p for _, p in trainable(self.module)])

    def save_shards(self, directory: Path) -> list[Path]:
        return []  # the ranks' byte ranges of the checkpoint's tensor files hold all of it

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any], checkpoint: Path) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)

    def load_portable(self, state: Portable) -> None:
        params = trainable(self.module)
        with torch.no_grad():
            for name, p in params:
                p.copy_(state.whole(name, WEIGHT))
        load_torch_adam(self.optimizer, params, state)
        load_schedule(self.scheduler, state.scheduler)
        self.skipped_steps = state.skipped_steps


class DDPEngine(LocalEngine):
    """PyTorch DistributedDataParallel: gradients all-reduced (averaged) in the backward pass."""

    def __init__(self, model: nn.Module, recipe: Recipe, env: DistEnv):
        super().__init__(model, recipe, env.device)
        ids = [env.device.index] if env.device.type == "cuda" else None
        self.model = DDP(self.module, device_ids=ids)  # broadcasts rank 0's state once
        # ... and by default its buffers again before every forward. The model's only buffers
        # are constant tables (positions.py's sinusoids): one broadcast at start is enough.
        # Set after construction, where every torch version reads it (2.13 renamed the
        # argument, and its old name now also skips the broadcast at start).
        self.model.broadcast_buffers = False
        self.world_size = env.world_size

    def backward(self, loss: torch.Tensor) -> None:
        # The loop divides by the tokens of all ranks; DDP then averages over ranks, which
        # would divide a second time by the world size. The fp16 loss scaling stays
        # LocalEngine's: step() unscales what backward() scaled.
        super().backward(loss * self.world_size)

    def accumulating(self, last: bool):
        # Gradients are all-reduced once per optimizer step, on its last micro-batch.
        return contextlib.nullcontext() if last else self.model.no_sync()
