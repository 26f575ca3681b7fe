"""Learning-rate schedules as pure functions of the optimizer step (1-based)."""

from __future__ import annotations

from aiayn.config import ScheduleConfig


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """§5.3: lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Rises linearly for `warmup` steps, then decays with the inverse square root of the step.
    """
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def learning_rate(step: int, cfg: ScheduleConfig, d_model: int) -> float:
    """The rate for optimizer step `step` (counted from 1, once per accumulation boundary)."""
    if cfg.kind == "noam":
        return noam_lr(step, d_model, cfg.warmup, cfg.factor)
    return cfg.lr
