import math

import torch

from aiayn.config import config_from_dict
from aiayn.distributed.engine import LocalEngine
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
        assert math.isclose(engine.lr, learning_rate(step, cfg.schedule, 16))
        for _ in range(cfg.train.grad_accum):
            engine.backward(model(torch.randn(2, 4)).sum())
        engine.step()
    assert math.isclose(engine.lr, learning_rate(4, cfg.schedule, 16))
    assert engine.scheduler.last_epoch == 3
