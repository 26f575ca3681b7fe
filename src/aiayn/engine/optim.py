"""The optimizer and the schedule: Adam as the paper sets it, the warmup schedule as a LambdaLR,
gradient clipping, and restoring both from a topology-independent (`Portable`) state."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from aiayn.config import Config
from aiayn.engine.schedule import learning_rate
from aiayn.engine.state import MOMENTS, Portable


def build_optimizer(
    params: list[nn.Parameter], cfg: Config, device: torch.device
) -> torch.optim.Optimizer:
    """Adam with the paper's beta_2 = 0.98 and epsilon = 1e-9 (§5.3) unless configured."""
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[cfg.optim.name]
    # The fused kernel reads and writes each parameter, gradient and moment once per step; on
    # CPU, foreach falls back to one kernel per tensor and operation (benchmarks/README.md).
    # Same update up to float rounding.
    fused = device.type in ("cpu", "cuda")
    # lr=1.0 so the LambdaLR factor *is* the learning rate.
    return cls(
        params,
        lr=1.0,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def paper_schedule(optimizer: torch.optim.Optimizer, cfg: Config) -> LambdaLR:
    """The warmup schedule of §5.3 as a factor on lr=1.0, stepped once per optimizer step."""
    sched, d_model, max_steps = cfg.schedule, cfg.model.d_model, cfg.train.max_steps
    # LambdaLR's counter starts at 0 and the paper counts steps from 1.
    return LambdaLR(optimizer, lambda k: learning_rate(k + 1, sched, d_model, max_steps))


def clip_gradients(params, clip_norm: float) -> torch.Tensor:
    """Clip to `clip_norm` (0 turns clipping off) and return the norm from before clipping."""
    return nn.utils.clip_grad_norm_(params, clip_norm if clip_norm > 0 else float("inf"))


def load_torch_adam(optimizer: torch.optim.Optimizer, params, state: Portable) -> None:
    """A torch Adam's state from `state`, indexed by position as its state_dict is."""
    saved = optimizer.state_dict()
    step = torch.tensor(float(state.step))  # torch's Adam keeps the step as a float tensor
    saved["state"] = {
        i: {"step": step.clone(), **{k: state.whole(name, k) for k in MOMENTS}}
        for i, (name, _) in enumerate(params)
        if state.has_moments(name)
    }
    optimizer.load_state_dict(saved)  # casts to each parameter's device and dtype


def load_schedule(scheduler: LambdaLR, saved: dict) -> None:
    """The schedule's position (a LambdaLR state dict), and the learning rate it had set at the
    checkpoint's step (LambdaLR.load_state_dict restores the counter, not the optimizer's lr)."""
    scheduler.load_state_dict(saved)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
