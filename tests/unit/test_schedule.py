import copy
import math

import pytest
import torch

from aiayn.config import config_from_dict
from aiayn.distributed.env import DistEnv
from aiayn.engine.registry import build_engine
from aiayn.engine.schedule import learning_rate, noam_lr
from aiayn.errors import ConfigError


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
    engine = build_engine(model, cfg, DistEnv(0, 1, torch.device("cpu")))
    for step in range(1, 4):
        assert math.isclose(engine.lr, learning_rate(step, cfg.schedule, 16, cfg.train.max_steps))
        for _ in range(cfg.train.grad_accum):
            engine.backward(model(torch.randn(2, 4)).sum())
        engine.step()
    assert math.isclose(engine.lr, learning_rate(4, cfg.schedule, 16, cfg.train.max_steps))
    assert engine.scheduler.last_epoch == 3


def cooldown_config(cooldown: int | None, max_steps: int = 100, warmup: int = 10, fraction=None):
    schedule = {"warmup": warmup, "cooldown": cooldown}
    if fraction is not None:
        schedule["cooldown_fraction"] = fraction
    return config_from_dict(
        {
            "data": {"train": "x"},
            "model": {"d_model": 16, "h": 2},
            "train": {"max_steps": max_steps},
            "schedule": schedule,
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
    engine = build_engine(model, cfg, DistEnv(0, 1, torch.device("cpu")))
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


@pytest.mark.parametrize(
    "fraction, max_steps, steps",
    [
        (0.2, 1900, 380),  # 0.2 * 1900 is 380.00000000000006 in floats: not 381
        (0.2, 1600, 320),
        (0.2, 30, 6),
        (0.25, 10, 3),  # half up, not to the even 2
        (0.01, 30, 1),  # a fraction asks for a cooldown: at least one step
        (1.0, 30, 30),  # the whole run
    ],
)
def test_a_cooldown_fraction_is_that_share_of_max_steps_rounded(fraction, max_steps, steps):
    cfg = cooldown_config(None, max_steps=max_steps, fraction=fraction)
    assert cfg.schedule.cooldown_steps(max_steps) == steps
    resolved = cfg.schedule.in_steps(max_steps)
    assert (resolved.cooldown, resolved.cooldown_fraction) == (steps, None)


def test_a_fraction_cooldown_gives_the_rates_of_the_same_cooldown_in_steps():
    fraction, steps = cooldown_config(None, fraction=0.2), cooldown_config(20)
    rates = [
        [learning_rate(s, cfg.schedule, 16, 100) for s in range(1, 102)]
        for cfg in (fraction, steps)
    ]
    assert rates[0] == rates[1]
    assert rates[0][79] > rates[0][80] and rates[0][-1] == 0.0  # falls from step 81, 0 at 101


def rates_along(engine, model, steps: int) -> tuple[list[float], float]:
    """The rate of each of the engine's next `steps` optimizer steps, and the rate after them."""
    seen = []
    for _ in range(steps):
        seen.append(engine.lr)
        engine.backward(model(torch.randn(2, 4)).sum())
        engine.step()
    return seen, engine.lr


def engine_rates(cfg, steps: int) -> tuple[list[float], float]:
    model = torch.nn.Linear(4, 1)
    return rates_along(build_engine(model, cfg, DistEnv(0, 1, torch.device("cpu"))), model, steps)


def test_a_short_run_with_a_fraction_cooldown_ends_at_rate_zero_as_the_step_form_does():
    # A smoke test's max_steps=30 with the recipes' fraction: its last 6 steps fall.
    fraction = cooldown_config(None, max_steps=30, warmup=5, fraction=0.2)
    seen, after = engine_rates(fraction, 30)
    by_steps, after_steps = engine_rates(cooldown_config(6, max_steps=30, warmup=5), 30)
    assert seen == by_steps and after == after_steps == 0.0
    plain, _ = engine_rates(cooldown_config(0, max_steps=30, warmup=5), 30)
    assert seen[:24] == plain[:24]
    assert seen[24:] == pytest.approx([p * (6 - i) / 6 for i, p in enumerate(plain[24:])])
    assert seen[-1] == pytest.approx(plain[-1] / 6)


@pytest.mark.parametrize("resumed_with", ["steps", "fraction"])
def test_a_checkpoint_saved_with_a_step_cooldown_resumes_to_the_same_rate(resumed_with, tmp_path):
    # Saved by a run whose config gave the cooldown in steps (the recipes before fractions:
    # 20 of 100 here, as 380 of 1900), stopped inside the cooldown; resumed with that config,
    # or with the recipe as it now is (a fraction 0.2 of the same max_steps).
    saved_cfg = cooldown_config(20)
    model = torch.nn.Linear(4, 1)
    engine = build_engine(model, saved_cfg, DistEnv(0, 1, torch.device("cpu")))
    rates_along(engine, model, 85)
    state, lr_at_save = copy.deepcopy(engine.state_dict()), engine.lr
    uninterrupted, _ = rates_along(engine, model, 15)

    cfg = saved_cfg if resumed_with == "steps" else cooldown_config(None, fraction=0.2)
    model = torch.nn.Linear(4, 1)
    resumed = build_engine(model, cfg, DistEnv(0, 1, torch.device("cpu")))
    resumed.load_state_dict(state, tmp_path)
    assert resumed.lr == lr_at_save == learning_rate(86, saved_cfg.schedule, 16, 100)
    assert 0 < lr_at_save < learning_rate(86, cooldown_config(0).schedule, 16, 100)
    assert rates_along(resumed, model, 15) == (uninterrupted, 0.0)
