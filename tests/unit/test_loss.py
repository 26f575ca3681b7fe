import pytest
import torch
import torch.nn.functional as F

from aiayn.config import ModelConfig
from aiayn.engine.loss import batch_loss, smoothed_cross_entropy
from aiayn.model import build_model

from batches import PAD, padded_batch
from helpers import TWO_LAYER_MODEL  # tests/helpers.py


def reference(logits, target, eps, ignore_index=-100):
    """torch's own label-smoothed cross-entropy, summed."""
    V = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, V),
        target.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=eps,
        reduction="sum",
    )


def test_without_smoothing_it_is_the_summed_cross_entropy_and_marks_argmax_hits():
    torch.manual_seed(0)
    logits, target = torch.randn(40, 11), torch.randint(0, 11, (40,))
    target[:5] = logits[:5].argmax(-1)  # some rows right, most wrong
    loss, correct = smoothed_cross_entropy(logits, target, 0.0)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, reduction="sum"))
    assert torch.equal(correct, logits.argmax(-1) == target)
    assert 5 <= int(correct.sum()) < 40


def test_smoothing_mixes_nll_with_the_uniform_distribution():
    eps, V = 0.1, 7
    logits, target = torch.randn(4, V), torch.tensor([1, 2, 3, 4])
    loss, _ = smoothed_cross_entropy(logits, target, eps)
    logp = logits.log_softmax(-1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    expected = ((1 - eps) * nll + eps * -logp.mean(-1)).sum()
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_hand_written_backward_matches_autograd_through_torchs_loss(eps):
    torch.manual_seed(0)
    logits = (torch.randn(37, 101, dtype=torch.float64) * 4).requires_grad_()
    target = torch.randint(0, 101, (37,))
    loss, correct = smoothed_cross_entropy(logits, target, eps)
    assert torch.equal(correct, logits.argmax(-1) == target)
    torch.testing.assert_close(loss, reference(logits, target, eps))
    (grad,) = torch.autograd.grad(loss * 0.7, logits)  # a non-unit upstream gradient
    (expected,) = torch.autograd.grad(reference(logits, target, eps) * 0.7, logits)
    torch.testing.assert_close(grad, expected)
    small = logits[:5, :9].detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: smoothed_cross_entropy(x, target[:5] % 9, eps)[0], small
    )


def test_a_second_backward_through_the_graph_gives_the_same_gradient():
    logits = torch.randn(6, 9, requires_grad=True)
    loss, _ = smoothed_cross_entropy(logits, torch.arange(6), 0.1)
    (first,) = torch.autograd.grad(loss * 2.0, logits, retain_graph=True)
    (second,) = torch.autograd.grad(loss * 2.0, logits)
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(
        first, 2.0 * torch.autograd.grad(reference(logits, torch.arange(6), 0.1), logits)[0]
    )


def test_nan_logits_give_a_nan_loss_for_the_trainer_to_catch():
    logits = torch.randn(3, 5)
    logits[1, 2] = float("nan")
    loss, _ = smoothed_cross_entropy(logits, torch.tensor([0, 1, 2]), 0.1)
    assert torch.isnan(loss)


def test_large_logits_do_not_overflow():
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 88.0, 90.0]])
    target = torch.tensor([0, 2])
    loss, _ = smoothed_cross_entropy(logits, target, 0.1)
    torch.testing.assert_close(loss, reference(logits, target, 0.1))


def test_accumulated_micro_batches_give_the_full_batch_gradient():
    torch.manual_seed(0)
    w = torch.randn(8, 13, requires_grad=True)
    x, target = torch.randn(6, 8), torch.randint(1, 13, (6,))
    full, _ = smoothed_cross_entropy(x @ w, target, 0.1)
    (g_full,) = torch.autograd.grad(full / 6, w)
    g_acc = torch.zeros_like(w)
    for part in (slice(0, 2), slice(2, 6)):
        loss, _ = smoothed_cross_entropy(x[part] @ w, target[part], 0.1)
        (g,) = torch.autograd.grad(loss / 6, w)  # divided by the step's tokens
        g_acc += g
    torch.testing.assert_close(g_acc, g_full)


# --- batch_loss: logits only at non-pad targets ----------------------------------------------


def tiny(kind: str):
    cfg = ModelConfig(**TWO_LAYER_MODEL, dropout=0.0, kind=kind)
    torch.manual_seed(0)
    return build_model(cfg, 50, PAD)


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_batch_loss_equals_the_padded_loss_with_pads_ignored_in_value_and_gradient(kind):
    model, batch = tiny(kind), padded_batch(kind)
    loss, correct = batch_loss(model, batch, kind, 0.1, PAD)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    args = (batch.src, batch.tgt_in) if kind == "seq2seq" else (batch.tgt_in,)
    logits = model(*args)  # (B, T, V): every position, pads included
    expected = reference(logits, batch.tgt_out, 0.1, ignore_index=PAD)
    expected_grads = torch.autograd.grad(expected, list(model.parameters()))
    torch.testing.assert_close(loss, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)
    real = batch.tgt_out != PAD
    assert int(correct) == int(((logits.argmax(-1) == batch.tgt_out) & real).sum())
    assert int(real.sum()) < batch.tgt_out.numel()  # the batch does have padding to skip
