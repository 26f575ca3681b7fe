import pytest
import torch

from aiayn.model.dropout import Dropout


def test_cpu_mask_drops_p_of_the_elements_and_keeps_the_expectation():
    torch.manual_seed(0)
    x = torch.ones(400, 1000)
    y = Dropout(0.1).train()(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.1) < 0.003  # 400k draws: the standard error is 0.0005
    assert abs(y.mean().item() - 1.0) < 0.005
    assert torch.equal(y.unique(), torch.tensor([0.0, 1 / (1 - 6554 / 65536)]))


def test_neighbouring_elements_are_independent():
    # One 64-bit draw makes four 16-bit uniforms: their masks must not move together.
    torch.manual_seed(0)
    keep = Dropout(0.5).train()(torch.ones(200_000)) > 0
    a, b = keep.view(-1, 4)[:, 0].float(), keep.view(-1, 4)[:, 1].float()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02


def test_the_gradient_flows_through_kept_elements_only():
    torch.manual_seed(0)
    x = torch.randn(64, 33, requires_grad=True)
    y = Dropout(0.3).train()(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g == 0, y == 0)
    torch.testing.assert_close(g[y != 0], torch.full_like(g[y != 0], 65536 / (65536 - 19661)))


def test_seeded_masks_repeat_and_eval_mode_is_the_identity():
    drop, x = Dropout(0.2).train(), torch.randn(7, 5)
    torch.manual_seed(3)
    first = drop(x)
    torch.manual_seed(3)
    assert torch.equal(drop(x), first)
    assert drop.eval()(x) is x


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_a_probability_outside_0_1_is_refused(p):
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(p)


def test_a_probability_just_below_1_keeps_a_scaled_few_instead_of_dividing_by_zero():
    torch.manual_seed(0)
    x = torch.ones(1 << 20)
    y = Dropout(1.0 - 1e-7).train()(x)  # rounds to 2^16 - 1 dropped of 2^16
    kept = y[y > 0]
    assert 0 < kept.numel() < 60  # ~16 expected of 2^20
    assert torch.equal(kept, torch.full_like(kept, 65536.0))
