"""train.deterministic on a CPU: the run trains, and repeats itself bit for bit across a resume,
as a run without it does on one machine (on CPU the kernels already are deterministic)."""

import pytest
import torch
import torch._inductor.config as inductor

from aiayn.config import load_config
from aiayn.train import train

import tiny  # tests/e2e/tiny.py, beside this file
from helpers import weights_at  # tests/helpers.py


@pytest.fixture
def restore_determinism():
    """The setting is process-wide: the tests after this one run without it."""
    saved = (torch.are_deterministic_algorithms_enabled(), inductor.deterministic)
    sdp, cudnn = torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cudnn.deterministic
    yield
    torch.use_deterministic_algorithms(saved[0])
    inductor.deterministic = saved[1]
    torch.backends.cuda.enable_cudnn_sdp(sdp)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn, False


def test_a_deterministic_run_trains_and_resumes_bitwise(tmp_path, numbers, restore_determinism):
    def run(name, steps):
        extra = ("model.dropout=0.1", "train.eval_every=0", "checkpoint.every_steps=4")
        cfg = load_config(
            None,
            tiny.overrides(
                tmp_path / name,
                numbers,
                "train.deterministic=true",
                f"train.max_steps={steps}",
                "logging.every_steps=1",
                *extra,
            ),
        )
        train(cfg)
        assert torch.are_deterministic_algorithms_enabled()

    run("straight", 8)
    run("stopped", 5)
    run("stopped", 8)
    a, b = weights_at(tmp_path / "straight", 8), weights_at(tmp_path / "stopped", 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    first = weights_at(tmp_path / "straight", 4)
    assert any(not torch.equal(a[k], first[k]) for k in a)  # it trained
