import torch
import torch.nn.functional as F

from aiayn.loss import smoothed_cross_entropy

PAD = 0


def test_without_smoothing_it_is_the_summed_cross_entropy():
    logits, target = torch.randn(3, 5, 11), torch.randint(1, 11, (3, 5))
    loss, n = smoothed_cross_entropy(logits, target, 0.0, ignore_index=PAD)
    assert n == 15
    torch.testing.assert_close(
        loss, F.cross_entropy(logits.view(-1, 11), target.view(-1), reduction="sum")
    )


def test_smoothing_mixes_nll_with_the_uniform_distribution():
    eps, V = 0.1, 7
    logits, target = torch.randn(4, V), torch.tensor([1, 2, 3, 4])
    loss, _ = smoothed_cross_entropy(logits, target, eps, ignore_index=PAD)
    logp = logits.log_softmax(-1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    expected = ((1 - eps) * nll + eps * -logp.mean(-1)).sum()
    torch.testing.assert_close(loss, expected)


def test_pad_targets_do_not_count():
    logits, target = torch.randn(2, 6, 9), torch.randint(1, 9, (2, 6))
    target[0, 4:] = PAD
    loss, n = smoothed_cross_entropy(logits, target, 0.1, ignore_index=PAD)
    assert n == 10
    logits2 = logits.clone()
    logits2[0, 4:] = torch.randn(2, 9) * 100  # whatever the model says at pads
    loss2, _ = smoothed_cross_entropy(logits2, target, 0.1, ignore_index=PAD)
    torch.testing.assert_close(loss, loss2)


def test_accumulated_micro_batches_give_the_full_batch_gradient():
    torch.manual_seed(0)
    w = torch.randn(8, 13, requires_grad=True)
    x, target = torch.randn(6, 8), torch.randint(1, 13, (6,))
    target[[1, 4]] = PAD  # micro-batches with different token counts
    full, n = smoothed_cross_entropy(x @ w, target, 0.1, ignore_index=PAD)
    (g_full,) = torch.autograd.grad(full / n, w)
    g_acc = torch.zeros_like(w)
    for part in (slice(0, 2), slice(2, 6)):
        loss, _ = smoothed_cross_entropy(x[part] @ w, target[part], 0.1, ignore_index=PAD)
        (g,) = torch.autograd.grad(loss / n, w)  # divided by the step's tokens
        g_acc += g
    torch.testing.assert_close(g_acc, g_full)
