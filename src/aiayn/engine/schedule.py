"""Learning-rate schedules as pure functions of the optimizer step (1-based)."""

from __future__ import annotations

from aiayn.config import ScheduleConfig


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """§5.3: lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

    Rises linearly for `warmup` steps, then decays with the inverse square root of the step.
    """
    step = max(step, 1)
    return factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cooldown_scale(step: int, max_steps: int, cooldown: int) -> float:
    """1 until the last `cooldown` steps before `max_steps`, then falling linearly: 1/cooldown
    at step max_steps, 0 after it (the "decay" of warmup-stable-decay schedules)."""
    if cooldown <= 0:
        return 1.0
    return min(1.0, max(max_steps - step + 1, 0) / cooldown)


def learning_rate(step: int, cfg: ScheduleConfig, d_model: int, max_steps: int) -> float:
    """The rate for optimizer step `step` (counted from 1, once per accumulation boundary) of a
    run of `max_steps` steps."""
    rate = noam_lr(step, d_model, cfg.warmup, cfg.factor) if cfg.kind == "noam" else cfg.lr
    return rate * cooldown_scale(step, max_steps, cfg.cooldown_steps(max_steps))
