"""The model: masks, attention against a by-hand reference, positions, tying, sizes, training."""

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import MODEL_PRESETS, ModelConfig
from aiayn.model import (
    DecoderOnlyLM,
    EncoderClassifier,
    Seq2SeqTransformer,
    build_model,
    count_parameters,
)
from aiayn.model.attention import CrossAttention, SelfAttention, merge_heads, split_heads
from aiayn.model.masks import causal_mask, self_attention_mask
from aiayn.model.positions import LearnedPositions, SinusoidalPositions

from helpers import TWO_LAYER_MODEL  # tests/helpers.py

V, PAD = 50, 0


def tiny(kind="seq2seq", seed=0, **overrides):
    cfg = dict(TWO_LAYER_MODEL, dropout=0.0, kind=kind)
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**cfg, **overrides}), V, PAD).eval()


def ids(*shape):
    return torch.randint(3, V, shape)  # never pad (0), bos (1) or eos (2)


def padded(*rows):
    width = max(len(r) for r in rows)
    return torch.stack([F.pad(r, (0, width - len(r)), value=PAD) for r in rows])


# --- 1. masked future tokens have no influence --------------------------------------------


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_future_target_tokens_do_not_change_earlier_seq2seq_logits(norm):
    model = tiny(norm=norm)
    src, tgt = ids(2, 7), ids(2, 8)
    t = 3
    changed = tgt.clone()
    changed[:, t + 1 :] = ids(2, 8 - t - 1)
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the change itself is visible


def test_future_tokens_do_not_change_earlier_lm_logits():
    model = tiny("lm")
    tokens = ids(2, 10)
    t = 4
    changed = tokens.clone()
    changed[:, t + 1 :] = ids(2, 10 - t - 1)
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


# --- 2. padding has no influence -----------------------------------------------------------


def test_padding_does_not_change_encoder_output_or_seq2seq_logits():
    model = tiny()
    short_src, long_src = ids(5), ids(9)
    short_tgt, long_tgt = ids(4), ids(7)
    alone_memory, _ = model.encode(short_src[None])
    batch_memory, _ = model.encode(padded(short_src, long_src))
    torch.testing.assert_close(batch_memory[0, :5], alone_memory[0], atol=1e-5, rtol=1e-5)

    alone = model(short_src[None], short_tgt[None])
    batch = model(padded(short_src, long_src), padded(short_tgt, long_tgt))
    torch.testing.assert_close(batch[0, :4], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_padding_does_not_change_classifier_logits(pooling):
    model = tiny("classifier", pooling=pooling, num_classes=3)
    short, long = ids(4), ids(11)
    alone = model(short[None])
    batch = model(padded(short, long))
    assert batch.shape == (2, 3)
    torch.testing.assert_close(batch[0], alone[0], atol=1e-5, rtol=1e-5)


def test_right_padded_targets_use_the_fused_causal_kernel_and_left_padded_get_a_full_mask():
    right = torch.tensor([[5, 6, 7], [5, PAD, PAD]])
    assert self_attention_mask(right, PAD) == (None, True)  # causality already hides the pads
    left = torch.tensor([[PAD, PAD, 7], [5, 6, 7]])
    mask, is_causal = self_attention_mask(left, PAD, right_padded=False)
    assert not is_causal
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert mask[1, 0].equal(causal_mask(3))
    assert tiny("lm")(left, right_padded=False).isfinite().all()  # no query sees nothing


def test_right_padded_and_fully_masked_decoders_agree_on_right_padded_targets():
    model, src = tiny(), ids(2, 6)
    tgt = padded(ids(5), ids(3))
    fused, masked = model(src, tgt), model(src, tgt, right_padded=False)
    real = tgt != PAD
    torch.testing.assert_close(fused[real], masked[real], atol=1e-5, rtol=1e-5)


def test_causal_mask_with_an_offset_lets_new_queries_see_the_cache():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


# --- 3-5. attention ------------------------------------------------------------------------


def test_split_heads_and_merge_heads_round_trip():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    torch.testing.assert_close(heads[:, 1], x[..., 4:8])  # head i holds features i*d_k ...
    assert merge_heads(heads).equal(x)


def naive_attention(x, kv, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, h, mask=None):
    """softmax(Q K^T / sqrt(d_k)) V per head, concatenated, then W^O (§3.2), by hand."""
    q, k, v = x @ w_q.T + b_q, kv @ w_k.T + b_k, kv @ w_v.T + b_v
    d_k = q.size(-1) // h
    heads = []
    for i in range(h):
        cols = slice(i * d_k, (i + 1) * d_k)
        scores = q[..., cols] @ k[..., cols].transpose(-1, -2) / math.sqrt(d_k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v[..., cols])
    return torch.cat(heads, dim=-1) @ w_o.T + b_o


def randomise(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


def test_self_attention_equals_naive_reference_with_and_without_mask():
    attn = randomise(SelfAttention(16, 4)).eval()
    x = torch.randn(2, 5, 16)
    w_q, w_k, w_v = attn.qkv.weight.chunk(3)
    no_bias = torch.zeros(16)  # the paper's projections have none (§3.2.2)
    args = (w_q, no_bias, w_k, no_bias, w_v, no_bias, attn.out.weight, no_bias, 4)
    torch.testing.assert_close(attn(x), naive_attention(x, x, *args))
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])[:, None, None, :]
    torch.testing.assert_close(attn(x, mask=keep), naive_attention(x, x, *args, mask=keep[:, 0]))
    causal = naive_attention(x, x, *args, mask=causal_mask(5))
    torch.testing.assert_close(attn(x, is_causal=True), causal)


def test_cross_attention_takes_keys_and_values_from_memory():
    attn = randomise(CrossAttention(16, 4)).eval()
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 6, 16)
    w_k, w_v = attn.kv.weight.chunk(2)
    no_bias = torch.zeros(16)
    args = (attn.q.weight, no_bias, w_k, no_bias, w_v, no_bias, attn.out.weight, no_bias, 4)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
    out = attn(x, memory, mask=keep)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, naive_attention(x, memory, *args, mask=keep[:, 0]))
    assert not torch.allclose(attn(x, memory + 1.0, mask=keep), out)  # same queries, new memory


# --- 6. it learns --------------------------------------------------------------------------


def test_tiny_seq2seq_overfits_one_batch_to_near_zero_loss():
    model = tiny().train()
    src, tgt = ids(4, 8), ids(4, 9)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert loss.item() < 0.05


# --- 7. sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, paper", [("transformer_base", 65e6), ("transformer_big", 213e6)])
def test_preset_parameter_counts_match_the_paper(preset, paper):
    cfg = ModelConfig(**MODEL_PRESETS[preset], share_embeddings="all")
    with torch.device("meta"):  # sizes only: no memory, no init cost
        model = build_model(cfg, vocab_size=37_000, pad_id=PAD)
    n = count_parameters(model)
    assert abs(n - paper) / paper < 0.04, n


def test_count_parameters_counts_a_tied_matrix_once():
    shared, separate = tiny(share_embeddings="all"), tiny(share_embeddings="none")
    assert count_parameters(separate) - count_parameters(shared) == 2 * V * 32


# --- 8. positions and norms ----------------------------------------------------------------


def test_sinusoidal_encoding_matches_the_formula():
    d = 16
    pe = SinusoidalPositions(d, max_len=50)(T=50)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)
    assert SinusoidalPositions(d, 50)(T=3, start=7).equal(pe[7:10])
    assert "pe" not in SinusoidalPositions(d, 50).state_dict()  # rebuilt, never loaded


def test_learned_positions_are_selectable_and_trained():
    model = tiny(positions="learned")
    assert isinstance(model.src_embed.positions, LearnedPositions)
    assert count_parameters(model) - count_parameters(tiny()) == 2 * 64 * 32  # src + tgt tables
    model(ids(2, 5), ids(2, 4)).sum().backward()
    assert model.src_embed.positions.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["seq2seq", "lm", "classifier"])
def test_pre_and_post_layer_norm_both_run_and_differ(kind):
    inputs = (ids(2, 6), ids(2, 5)) if kind == "seq2seq" else (ids(2, 6),)
    post, pre = tiny(kind, norm="post"), tiny(kind, norm="pre")
    a, b = post(*inputs), pre(*inputs)
    assert a.shape == b.shape and a.isfinite().all() and b.isfinite().all()
    assert not torch.allclose(a, b)


# --- 9. tying ------------------------------------------------------------------------------


def test_share_all_ties_source_target_and_output_matrices():
    model = tiny(share_embeddings="all")
    assert model.src_embed.token.weight is model.tgt_embed.token.weight
    assert model.tgt_embed.token.weight is model.out.weight


def test_share_decoder_ties_target_and_output_only():
    model = tiny(share_embeddings="decoder")
    assert model.tgt_embed.token.weight is model.out.weight
    assert model.src_embed.token.weight is not model.tgt_embed.token.weight


def test_share_none_keeps_three_distinct_matrices():
    model = tiny(share_embeddings="none")
    mats = [model.src_embed.token.weight, model.tgt_embed.token.weight, model.out.weight]
    assert len({id(m) for m in mats}) == 3


def test_lm_ties_unless_none_and_builds_the_right_classes():
    assert isinstance(tiny(), Seq2SeqTransformer)
    assert isinstance(tiny("classifier"), EncoderClassifier)
    lm = tiny("lm", share_embeddings="all")
    assert isinstance(lm, DecoderOnlyLM)
    assert lm.embed.token.weight is lm.out.weight
    assert tiny("lm", share_embeddings="none").out.weight is not lm.embed.token.weight


def test_init_gives_unit_scale_embedded_inputs_and_zero_biases():
    model = tiny(d_model=64, h=4)
    scaled = model.src_embed.token.weight * math.sqrt(64)
    assert scaled.std().item() == pytest.approx(1.0, rel=0.1)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.bias is None or not m.bias.any() for m in linears)
    # a fused QKV projection is initialised as three (D, D) matrices, not one (3D, D)
    bound = math.sqrt(6 / (64 + 64))
    qkv = model.encoder.layers[0].self_attn.qkv.weight
    assert qkv.abs().max().item() == pytest.approx(bound, rel=0.05)


# --- 11. too long --------------------------------------------------------------------------


def test_sequence_longer_than_max_len_raises_a_clear_error():
    model = tiny(max_len=16)
    with pytest.raises(ValueError, match=r"17 tokens.*max_len \(16\)"):
        model(ids(1, 17), ids(1, 4))
    with pytest.raises(ValueError, match=r"20 tokens.*max_len \(16\)"):
        model(ids(1, 4), ids(1, 20))
    with pytest.raises(ValueError, match=r"17 tokens.*max_len \(16\)"):
        tiny("lm", max_len=16)(ids(1, 17))


@pytest.mark.parametrize("kind", ["seq2seq", "lm", "classifier"])
def test_a_model_with_half_parameters_and_fp32_buffers_runs_in_half(kind):
    """DeepSpeed's fp16 casts the parameters to half and keeps buffers (the sinusoids) in
    fp32: each layer must still see half inputs (found on a GPU: 'expected mat1 and mat2 to
    have the same dtype, but got: float != c10::Half')."""
    model = tiny(kind)
    for p in model.parameters():
        p.data = p.data.half()
    assert any(b.dtype == torch.float32 for b in model.buffers())
    tokens = ids(2, 6)
    out = model(tokens, ids(2, 5)) if kind == "seq2seq" else model(tokens)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_the_concat_sinusoid_is_the_interleaved_one_with_its_dimensions_regrouped():
    ours, concat = SinusoidalPositions(32, 50).pe, SinusoidalPositions(32, 50, concat=True).pe
    assert torch.equal(concat[:, :16], ours[:, 0::2]) and torch.equal(concat[:, 16:], ours[:, 1::2])


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_marians_options_add_biases_and_swish_and_leave_the_defaults_as_they_were(kind):
    plain, marian = (
        tiny(kind),
        tiny(kind, activation="swish", attention_bias=True, output_bias=True),
    )
    names = {n for n, _ in plain.named_parameters()}
    extra = {n for n, _ in marian.named_parameters()} - names
    assert extra and all(n.endswith(".bias") for n in extra)
    assert "out.bias" in extra and any("qkv.bias" in n for n in extra)
    assert all(p.abs().max() == 0 for n, p in marian.named_parameters() if n in extra)  # zeros
    # Same weights, the biases still zero: only the activation differs, so do the logits.
    marian.load_state_dict(plain.state_dict(), strict=False)
    x = ids(2, 7)
    same = tiny(kind, attention_bias=True, output_bias=True)
    same.load_state_dict(plain.state_dict(), strict=False)
    args = (x, x) if kind == "seq2seq" else (x,)
    assert torch.allclose(same(*args), plain(*args), atol=1e-6)
    assert not torch.allclose(marian(*args), plain(*args), atol=1e-3)
