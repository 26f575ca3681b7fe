"""The engine: backward, clipping, optimizer and schedule, once per accumulation boundary.

The training loop only calls `backward`, `step`, `autocast` and the state methods, so a DDP or
DeepSpeed engine can take this one's place without the loop changing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aiayn.config import Config
from aiayn.dist.env import DistEnv
from aiayn.errors import ConfigError
from aiayn.schedule import learning_rate


def build_optimizer(model: nn.Module, cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """Adam with the paper's beta_2 = 0.98 and epsilon = 1e-9 (§5.3) unless configured."""
    cls = torch.optim.AdamW if cfg.optim.name == "adamw" else torch.optim.Adam
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    # lr=1.0 so the LambdaLR factor *is* the learning rate.
    return cls(
        params,
        lr=1.0,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        foreach=True,
    )


class LocalEngine:
    """One process, one device."""

    def __init__(self, model: nn.Module, cfg: Config, device: torch.device):
        self.module = model.to(device)
        self.model = self.module  # what the loop calls; a wrapper (DDP) in other engines
        self.device = device
        self.clip_norm = cfg.train.clip_norm
        self.precision = cfg.train.precision
        self.optimizer = build_optimizer(self.module, cfg, device)
        sched, d_model = cfg.schedule, cfg.model.d_model
        # LambdaLR's counter starts at 0 and the paper counts steps from 1.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: learning_rate(k + 1, sched, d_model)
        )

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    # fp32 and bf16 need no loss scaling: the scale is 1 and no step is skipped. An fp16
    # engine reports its scaler's values here.
    loss_scale: float = 1.0
    skipped_steps: int = 0

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def accumulating(self, last: bool):
        """Context for one micro-batch's forward and backward; `last` ends the step."""
        return contextlib.nullcontext()

    def replicas_differ(self, env: DistEnv) -> bool:
        """True if parameters differ between data-parallel ranks (a sanity check, nanotron's
        named-point style): one all-reduce of per-tensor sums, compared as min and max."""
        if not env.distributed:
            return False
        sums = torch.stack([p.detach().double().sum() for p in self.module.parameters()])
        low, high = sums.clone(), sums.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return not torch.equal(low, high)

    def step(self) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, clear gradients; return the grad norm.

        The norm stays a tensor so the caller decides when to pay for a host sync.
        """
        max_norm = self.clip_norm if self.clip_norm > 0 else float("inf")
        grad_norm = nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class DDPEngine(LocalEngine):
    """PyTorch DistributedDataParallel: gradients all-reduced (averaged) in the backward pass."""

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv):
        super().__init__(model, cfg, env.device)
        ids = [env.device.index] if env.device.type == "cuda" else None
        self.model = DDP(self.module, device_ids=ids)  # broadcasts rank 0's parameters
        self.world_size = env.world_size

    def backward(self, loss: torch.Tensor) -> None:
        # The loop divides by the tokens of all ranks; DDP then averages over ranks, which
        # would divide a second time by the world size.
        (loss * self.world_size).backward()

    def accumulating(self, last: bool):
        # Gradients are all-reduced once per optimizer step, on its last micro-batch.
        return contextlib.nullcontext() if last else self.model.no_sync()


def build_engine(model: nn.Module, cfg: Config, env: DistEnv) -> LocalEngine:
    """DDP across processes, or the plain engine on one."""
    if cfg.distributed.backend == "deepspeed":
        raise ConfigError(
            "distributed.backend=deepspeed is not available in this version yet; use "
            "distributed.backend=ddp (the default)"
        )
    if env.distributed:
        return DDPEngine(model, cfg, env)
    return LocalEngine(model, cfg, env.device)
