import math

import pytest
import torch

from aiayn.config import config_from_dict
from aiayn.distributed.engine import LocalEngine
from aiayn.errors import ConfigError
from aiayn.schedule import learning_rate, noam_lr


def test_noam_matches_the_paper_formula():
    d, w = 512, 4000
    for step in (1, 10, 3999, 4000, 4001, 100_000):
        expected = d**-0.5 * min(step**-0.5, step * w**-1.5)
        assert math.isclose(noam_lr(step, d, w), expected, rel_tol=1e-12)


def test_noam_rises_linearly_then_decays_as_inverse_sqrt():
    d, w = 512, 4000
    assert math.isclose(noam_lr(200, d, w) / noam_lr(100, d, w), 2.0)
    peak = noam_lr(w, d, w)
    assert peak > noam_lr(w - 1, d, w) and peak > noam_lr(w + 1, d, w)
    assert math.isclose(noam_lr(4 * w, d, w) / noam_lr(w, d, w), 0.5)


def test_schedule_steps_once_per_optimizer_step_not_per_micro_batch():
    cfg = config_from_dict(
        {
            "data": {"train": "x"},
            "model": {"d_model": 16, "h": 2},
            "train": {"grad_accum": 4},
            "schedule": {"warmup": 10},
        }
    )
    model = torch.nn.Linear(4, 1)
    engine = LocalEngine(model, cfg, torch.device("cpu"))
    for step in range(1, 4):
        assert math.isclose(engine.lr, learning_rate(step, cfg.schedule, 16, cfg.train.max_steps))
        for _ in range(cfg.train.grad_accum):
            engine.backward(model(torch.randn(2, 4)).sum())
        engine.step()
    assert math.isclose(engine.lr, learning_rate(4, cfg.schedule, 16, cfg.train.max_steps))
    assert engine.scheduler.last_epoch == 3


def cooldown_config(cooldown: int, max_steps: int = 100, warmup: int = 10):
    return config_from_dict(
        {
            "data": {"train": "x"},
            "model": {"d_model": 16, "h": 2},
            "train": {"max_steps": max_steps},
            "schedule": {"warmup": warmup, "cooldown": cooldown},
        }
    )


def test_cooldown_leaves_the_rate_until_its_steps_then_falls_linearly_to_zero():
    cfg, plain = cooldown_config(20), cooldown_config(0)
    rate = [learning_rate(s, cfg.schedule, 16, 100) for s in range(1, 101)]
    paper = [learning_rate(s, plain.schedule, 16, 100) for s in range(1, 101)]
    assert rate[:80] == paper[:80]  # steps 1..80: the paper's schedule
    # Steps 81..100 scale the paper's rate by 20/20, 19/20, ..., 1/20.
    for step in range(81, 101):
        assert math.isclose(rate[step - 1], paper[step - 1] * (101 - step) / 20, rel_tol=1e-12)
    assert math.isclose(rate[-1], paper[-1] / 20)
    assert learning_rate(101, cfg.schedule, 16, 100) == 0.0


def test_the_engine_steps_along_the_cooldown():
    cfg = cooldown_config(4, max_steps=6, warmup=1)
    model = torch.nn.Linear(4, 1)
    engine = LocalEngine(model, cfg, torch.device("cpu"))
    seen = []
    for _ in range(6):
        seen.append(engine.lr)
        engine.backward(model(torch.randn(2, 4)).sum())
        engine.step()
    expected = [learning_rate(s, cfg.schedule, 16, 6) for s in range(1, 7)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[2] > seen[3] > seen[4] > seen[5] > 0  # steps 3..6 fall


def test_a_cooldown_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match=r"schedule.cooldown \(101\) must be at most"):
        cooldown_config(101, max_steps=100)
