"""The engine: backward, clipping, optimizer and schedule, once per accumulation boundary.

The training loop only calls `backward`, `step`, `autocast` and the state methods, so a DDP or
DeepSpeed engine can take this one's place without the loop changing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from aiayn.config import Config
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

    def autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

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
