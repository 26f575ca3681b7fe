"""launch/lm_recipe.py's validation curve: minutes of training, across a resumed run."""

import sys
import time
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))
import lm_recipe  # noqa: E402


def test_the_curve_does_not_count_the_time_between_a_run_and_its_resume(tmp_path, monkeypatch):
    clock = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    def process(points: list[tuple[float, int, float]]) -> None:
        """A training process: opens its writer now, logs (seconds later, step, value)."""
        start = clock[0]
        with SummaryWriter(tmp_path / "tb") as writer:
            for after, step, value in points:
                writer.add_scalar("valid/word_ppl", value, step, walltime=start + after)
                writer.add_scalar("train/loss", 1.0, step, walltime=start + after)
            clock[0] = start + points[-1][0]

    process([(60.0, 300, 500.0), (120.0, 600, 300.0)])
    clock[0] += 3600.0  # an hour stopped before the resume
    process([(90.0, 900, 250.0)])
    curve = lm_recipe.validation_curve(tmp_path, "word_ppl")
    assert [(step, value) for _, step, value in curve] == [(300, 500.0), (600, 300.0), (900, 250.0)]
    assert [minutes for minutes, _, _ in curve] == pytest.approx([1.0, 2.0, 3.5])
