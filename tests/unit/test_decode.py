"""Decoding: the cached path equals recomputation, beam search is sound, sampling is right."""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from aiayn.config import ModelConfig
from aiayn.infer.beam import beam_search
from aiayn.infer.decode import generate, greedy_search, length_penalty
from aiayn.model import DecoderState, build_model

from helpers import TWO_LAYER_MODEL  # tests/helpers.py

V, PAD, BOS, EOS = 50, 0, 1, 2


def tiny(kind="seq2seq", seed=0, **overrides):
    cfg = dict(TWO_LAYER_MODEL, dropout=0.1, kind=kind)
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**cfg, **overrides}), V, PAD)  # left in training mode


def pad_rows(rows):
    width = max(len(r) for r in rows)
    return torch.stack([F.pad(r, (0, width - len(r)), value=PAD) for r in rows])


def reversal_batch(g, n):
    """src = x + eos, tgt_in = bos + reversed(x), tgt_out = reversed(x) + eos, right-padded."""
    src, tgt_in, tgt_out = [], [], []
    for _ in range(n):
        x = torch.randint(3, V, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g)
        y = x.flip(0)
        src.append(torch.cat([x, torch.tensor([EOS])]))
        tgt_in.append(torch.cat([torch.tensor([BOS]), y]))
        tgt_out.append(torch.cat([y, torch.tensor([EOS])]))
    return pad_rows(src), pad_rows(tgt_in), pad_rows(tgt_out)


@pytest.fixture(scope="module")
def toy():
    """A seq2seq half-trained to reverse its input: it emits eos, at different lengths, and is
    unsure enough that beam search has something to find. Returned in training mode."""
    model = tiny()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        src, tgt_in, tgt_out = reversal_batch(g, 32)
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def src():
    return reversal_batch(torch.Generator().manual_seed(5), 8)[0]


@contextmanager
def evaluated(model):
    model.eval()
    try:
        yield
    finally:
        model.train()


def greedy_by_recomputation(model, src, max_len_b):
    """Greedy search the slow way: the whole prefix is re-run through the model every step."""
    out = []
    with evaluated(model), torch.no_grad():
        for row in src:
            row = row[row != PAD][None]
            prefix = [BOS]
            for _ in range(row.size(1) + max_len_b):
                nxt = int(model(row, torch.tensor([prefix]))[0, -1].argmax())
                if nxt == EOS:
                    break
                prefix.append(nxt)
            out.append(prefix[1:])
    return out


KW = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len_b=4)


def test_cached_greedy_equals_greedy_by_recomputing_the_prefix(toy, src):
    cached = greedy_search(toy, src, **KW)
    assert cached == greedy_by_recomputation(toy, src, max_len_b=4)
    src_lens = (src != PAD).sum(1).tolist()
    assert any(len(c) < n for c, n in zip(cached, src_lens, strict=True))  # some stopped at eos


def test_decoding_restores_the_training_mode(toy, src):
    assert toy.training
    greedy_search(toy, src, **KW)
    beam_search(toy, src, **KW)
    assert toy.training
    with evaluated(toy):
        beam_search(toy, src, **KW)
        assert not toy.training


def test_hypotheses_that_never_end_stop_at_source_length_plus_max_len_b(toy, src):
    never = dict(KW, eos_id=BOS)  # the toy never predicts bos, so nothing ends by itself
    limits = ((src != PAD).sum(1) + KW["max_len_b"]).tolist()
    for search in (greedy_search, beam_search):
        assert [len(h) for h in search(toy, src, **never)] == limits
        # §6.1's limit is capped so that bos + the output fit the model's 64 positions
        assert [len(h) for h in search(toy, src[:2], **dict(never, max_len_b=100))] == [63, 63]


def test_reordered_decoder_state_equals_recomputing_the_reordered_prefixes(toy, src):
    src = src[:3]
    tgt = torch.randint(3, V, (3, 4))
    with evaluated(toy), torch.no_grad():
        memory, src_mask = toy.encode(src)
        state = DecoderState()
        toy.decode(tgt[:, :3], memory, src_mask, state)  # prefill three positions
        index = torch.tensor([2, 2, 0])
        state.reorder(index)
        state.select_sources(index)
        step = toy.decode(tgt[index, 3:], memory[index], src_mask[index], state)
        full = toy(src[index], tgt[index])
    torch.testing.assert_close(step[:, 0], full[:, 3], atol=1e-5, rtol=1e-5)


def test_rows_of_one_sentence_share_its_cross_attention_keys_and_values(toy, src):
    """Beam search feeds G rows per sentence (row b * G + g belongs to sentence b) against
    one memory row per sentence: the same logits as repeating the memory G times."""
    G, src = 3, src[:4]
    tgt = torch.randint(3, V, (4 * G, 5))
    with evaluated(toy), torch.no_grad():
        memory, src_mask = toy.encode(src)
        shared, repeated = DecoderState(), DecoderState()
        steps = []
        for t in range(tgt.size(1)):
            a = toy.decode(tgt[:, t : t + 1], memory, src_mask, shared)
            b = toy.decode(
                tgt[:, t : t + 1],
                memory.repeat_interleave(G, dim=0),
                src_mask.repeat_interleave(G, dim=0),
                repeated,
            )
            steps.append((a, b))
        assert shared.cross_attn[0].k.size(0) == 4 and repeated.cross_attn[0].k.size(0) == 4 * G
    for a, b in steps:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sentences_leave_the_batch_when_they_stop(toy, src):
    """Beam and greedy search decode fewer rows once sentences stop, with the hypotheses of
    decoding each sentence alone (which never drops a sentence: it stops with the search)."""
    rows = []
    decode = toy.decode

    def counting(tgt, *args, **kwargs):
        rows.append(tgt.size(0))
        return decode(tgt, *args, **kwargs)

    toy.decode = counting
    try:
        for search, extra in ((greedy_search, {}), (beam_search, {"beam": 3})):
            rows.clear()
            batch = search(toy, src, **KW, **extra)
            width = extra.get("beam", 1)
            # the first step decodes one row per sentence (bos), then `width` per sentence
            assert rows[0] == len(src) and rows[1] == len(src) * width
            assert rows[1:] == sorted(rows[1:], reverse=True)
            assert rows[-1] < len(src) * width  # some sentences stopped before the last
            alone = [search(toy, row[row != PAD][None], **KW, **extra)[0] for row in src]
            assert batch == alone
    finally:
        del toy.decode


def test_beam_of_one_equals_greedy(toy, src):
    assert beam_search(toy, src, beam=1, **KW) == greedy_search(toy, src, **KW)


def score(model, src_row, hyp, alpha):
    """log P(hyp + eos | src) / lp, the quantity beam search maximises."""
    src_row = src_row[src_row != PAD][None]
    tgt_in, tgt_out = torch.tensor([[BOS] + hyp]), torch.tensor([hyp + [EOS]])
    with evaluated(model), torch.no_grad():
        logp = model(src_row, tgt_in).log_softmax(-1).gather(-1, tgt_out[..., None]).sum()
    return logp.item() / length_penalty(len(hyp) + 1, alpha)


def test_beam_search_finds_hypotheses_scoring_at_least_as_well_as_greedy(toy, src):
    beams = beam_search(toy, src, beam=4, alpha=0.6, **KW)
    greedy = greedy_search(toy, src, **KW)
    beam_scores = [score(toy, s, h, 0.6) for s, h in zip(src, beams, strict=True)]
    greedy_scores = [score(toy, s, h, 0.6) for s, h in zip(src, greedy, strict=True)]
    assert all(b >= g - 1e-4 for b, g in zip(beam_scores, greedy_scores, strict=True))
    assert any(b > g + 1e-3 for b, g in zip(beam_scores, greedy_scores, strict=True))


def test_a_larger_alpha_favours_longer_hypotheses_that_score_better_under_it(toy, src):
    plain = beam_search(toy, src, alpha=0.0, **KW)
    favoured = beam_search(toy, src, alpha=2.0, **KW)
    assert sum(map(len, favoured)) > sum(map(len, plain))
    for s, f, p in zip(src, favoured, plain, strict=True):
        assert score(toy, s, f, 2.0) >= score(toy, s, p, 2.0) - 1e-4
        assert score(toy, s, p, 0.0) >= score(toy, s, f, 0.0) - 1e-4


def test_decoding_a_batch_equals_decoding_each_sentence_alone(toy, src):
    for search, extra in ((greedy_search, {}), (beam_search, {"beam": 3})):
        batch = search(toy, src, **KW, **extra)
        alone = [search(toy, row[row != PAD][None], **KW, **extra)[0] for row in src]
        assert batch == alone


def lm_argmax_by_recomputation(model, prompt, n):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_generate_at_temperature_zero_equals_argmax_decoding():
    model = tiny("lm")
    prompts = [[5, 6, 7], [8, 9], [9, 10, 11, 12, 13]]  # different lengths, batched together
    out = generate(model, prompts, max_new_tokens=6, temperature=0.0, eos_id=-1)
    model.eval()
    assert out == [lm_argmax_by_recomputation(model, p, 6) for p in prompts]


def test_top_k_one_sampling_equals_greedy_and_eos_stops_a_row():
    model = tiny("lm")
    prompts = [[5, 6, 7], [8, 9]]
    greedy = generate(model, prompts, max_new_tokens=6, temperature=0.0, eos_id=-1)
    g = torch.Generator().manual_seed(0)
    top1 = generate(model, prompts, max_new_tokens=6, top_k=1, eos_id=-1, generator=g)
    assert top1 == greedy
    eos = greedy[0][3]
    stopped = generate(model, prompts, max_new_tokens=6, temperature=0.0, eos_id=eos)
    assert stopped[0] == greedy[0][: greedy[0].index(eos)]


def test_sampling_is_reproducible_with_a_generator_and_varies_without_one():
    model = tiny("lm")
    kw = dict(max_new_tokens=8, temperature=1.0, eos_id=-1)
    a = generate(model, [[5, 6]] * 4, generator=torch.Generator().manual_seed(1), **kw)
    b = generate(model, [[5, 6]] * 4, generator=torch.Generator().manual_seed(1), **kw)
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # four rows of the same prompt sampled differently


class ScriptedModel(torch.nn.Module):
    """A confident stand-in for a trained model: along PATH each next token has p=0.9 and eos
    p=0.06; off the path, eos has p=0.9. Its decoder history lives in the DecoderState so that
    beam search's reorders apply to it like to real key/value caches."""

    PATH = [5, 6, 7, 8, 9]

    class History:
        def __init__(self, rows):
            self.rows = rows

        def reorder(self, index):
            self.rows = self.rows[index]

    def __init__(self):
        super().__init__()
        self.cfg = ModelConfig(max_len=64)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def encode(self, src):
        return torch.zeros(src.size(0), src.size(1), 1), (src != PAD)[:, None, None, :]

    def decode(self, last, memory, src_mask, state):
        if not state.self_attn:
            state.self_attn = [self.History(last.new_zeros((last.size(0), 0)))]
        hist = state.self_attn[0]
        hist.rows = torch.cat([hist.rows, last], dim=1)
        probs = torch.full((last.size(0), V), 0.04 / (V - 2))
        for r, row in enumerate(hist.rows.tolist()):
            prefix = row[1:]  # after bos
            if prefix == self.PATH[: len(prefix)] and len(prefix) < len(self.PATH):
                probs[r, self.PATH[len(prefix)]], probs[r, EOS] = 0.9, 0.06
            elif prefix == self.PATH:
                probs[r, EOS] = 0.96
            else:
                probs[r, EOS] = 0.9
        return probs.log()[:, None, :]


def test_beam_search_does_not_stop_before_its_best_hypothesis_finishes():
    """With fairseq's rule (stop at `beam` finished) the weak beams' eos endings fill the
    finished list after two steps and the search returns a one-token hypothesis."""
    src = torch.tensor([[4, 4, 4, EOS]])
    out = beam_search(ScriptedModel(), src, beam=4, alpha=0.6, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    assert out == [ScriptedModel.PATH]


class EosFirst(torch.nn.Module):
    """A model that all but certainly ends at once: eos first, by 100 nats, as beam search's
    empty hypothesis wins under the length penalty where a model is unsure of a long sentence."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg, self.first = model, model.cfg, True

    def encode(self, src):
        self.first = True
        return self.model.encode(src)

    def decode(self, tgt, memory, src_mask, state=None):
        logits = self.model.decode(tgt, memory, src_mask, state)
        if self.first:
            logits[..., EOS] += 100.0
            self.first = False
        return logits


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_min_len_keeps_eos_back_until_that_many_tokens_but_not_for_an_empty_source(
    toy, src, search
):
    model = EosFirst(toy)
    assert search(model, src, **dict(KW, min_len=0)) == [[]] * len(src)
    with evaluated(toy):
        plain = search(toy, src, **KW)
    assert all(plain)  # the toy itself never ends at once
    held_back = search(model, src, **dict(KW, min_len=1))
    if search is greedy_search:  # its argmax is the toy's: eos held back changes nothing else
        assert held_back == plain
    else:  # the other tokens' log-probabilities all lost the same 100 nats to eos
        assert all(held_back)
    assert min(len(h) for h in search(model, src, **dict(KW, min_len=4))) >= 4
    # an empty source (eos alone) may be translated as nothing
    empty_too = pad_rows([torch.tensor([EOS]), src[0][src[0] != PAD]])
    hyps = search(model, empty_too, **dict(KW, min_len=1))
    assert hyps[0] == [] and hyps[1] == held_back[0]


def test_an_empty_line_is_translated_as_an_empty_line_without_decoding_it(tok):
    from aiayn.infer.decode import Hypothesis
    from aiayn.infer.translate import translate_batches

    seen = []

    def decode(batch, index):
        seen.extend(batch)
        return [[Hypothesis(-1.0, ids[::-1])] for ids in batch]

    out = translate_batches(tok, ["one two", "", "three"], 64, 2, decode)
    assert out[1] == [("", 0.0)] and out[0][0][0] and out[2][0][0]
    assert [] not in seen and len(seen) == 2


# n-best lists, sampling, noise, ensembles (issue 57)


def test_the_n_best_list_starts_with_the_beam_output_and_is_sorted_by_its_scores(toy, src):
    from aiayn.infer.beam import beam_search_n_best

    best = beam_search(toy, src, beam=4, alpha=0.6, **KW)
    lists = beam_search_n_best(toy, src, beam=4, alpha=0.6, n_best=4, **KW)
    assert [hyps[0].ids for hyps in lists] == best
    assert all(len(hyps) == 4 for hyps in lists)
    for s, hyps in zip(src, lists, strict=True):
        scores = [h.score for h in hyps]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(h.ids) for h in hyps}) == 4  # four different hypotheses
        # each score is the hypothesis's log P / lp, as recomputed by a full forward
        assert all(abs(h.score - score(toy, s, h.ids, 0.6)) < 1e-4 for h in hyps)
    with pytest.raises(ValueError, match="widen the beam"):
        beam_search_n_best(toy, src, beam=2, n_best=3, **KW)


def test_a_scored_greedy_search_is_greedy_search_with_its_hypotheses_log_p(toy, src):
    from aiayn.infer.decode import scored_greedy_search

    hyps = scored_greedy_search(toy, src, alpha=0.6, scored=True, **KW)
    assert [h.ids for h in hyps] == greedy_search(toy, src, **KW)
    for s, h in zip(src, hyps, strict=True):
        if len(h.ids) < 4 + (s != PAD).sum():  # ended by eos, not cut at its limit
            assert abs(h.score - score(toy, s, h.ids, 0.6)) < 1e-4


def _sample(model, src, keys, **kw):
    from aiayn.infer.sampling import sample_search

    return sample_search(model, src, keys, **{"seed": 7, **kw}, **KW)


def test_top_k_one_and_a_tiny_top_p_sample_what_greedy_search_finds(toy, src):
    greedy = greedy_search(toy, src, **KW)
    keys = [(0, i) for i in range(len(src))]
    for filters in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=3.0)):
        assert [h[0].ids for h in _sample(toy, src, keys, **filters)] == greedy, filters


def test_a_sentences_sample_depends_on_its_seed_and_key_not_on_its_batch(toy, src):
    keys = [(0, i) for i in range(len(src))]
    batch = [h[0].ids for h in _sample(toy, src, keys, temperature=1.5)]
    # alone, or in another batch in another order: the same samples
    alone = [_sample(toy, row[row != PAD][None], [k], temperature=1.5)[0][0].ids
             for row, k in zip(src, keys, strict=True)]  # fmt: skip
    assert alone == batch
    flipped = [h[0].ids for h in _sample(toy, src.flip(0), keys[::-1], temperature=1.5)]
    assert flipped[::-1] == batch
    # n samples: each sentence's the same alone as in the batch (its draws fixed by its source)
    three = _sample(toy, src, keys, temperature=1.5, n=3)
    row, key = src[5], keys[5]
    alone = _sample(toy, row[row != PAD][None], [key], temperature=1.5, n=3)[0]
    assert [h.ids for h in alone] == [h.ids for h in three[5]]
    # the scores to the last bits that a padded batch moves (translate.length_batches)
    assert all(abs(a.score - b.score) < 1e-5 for a, b in zip(alone, three[5], strict=True))
    assert batch != greedy_search(toy, src, **KW)  # it does sample
    other = [h[0].ids for h in _sample(toy, src, keys, temperature=1.5, seed=8)]
    assert other != batch
    # n samples a sentence: the first of them is the n = 1 sample, the list sorted by score
    many = _sample(toy, src, keys, temperature=1.5, n=3)
    assert all([h.score for h in m] == sorted((h.score for h in m), reverse=True) for m in many)
    assert any(len({tuple(h.ids) for h in m}) > 1 for m in many)


def test_noise_drops_blanks_and_moves_words_at_most_swap_positions():
    from aiayn.infer.sampling import noised, sentence_generator

    words = [f"w{i}" for i in range(40)]

    def g(i=0):
        return sentence_generator(3, (0, i, 1))

    assert noised(words, g(), 0.1, 0.1, 3, "<blank>") == noised(words, g(), 0.1, 0.1, 3, "<blank>")
    assert noised(words, g(), 0.1, 0.1, 3, "<blank>") != noised(words, g(1), 0.1, 0.1, 3, "<blank>")
    assert noised(words, g(), 1.0, 0.0, 0, "_") == []
    assert noised(words, g(), 0.0, 1.0, 0, "_") == ["_"] * 40
    shuffled = noised(words, g(), 0.0, 0.0, 3, "_")
    assert sorted(shuffled) == sorted(words) and shuffled != words
    assert all(abs(words.index(w) - i) <= 3 for i, w in enumerate(shuffled))
    dropped = noised(words, g(), 0.5, 0.0, 0, "_")
    assert 5 < len(dropped) < 35 and dropped == [w for w in words if w in dropped]


def test_an_ensemble_of_one_model_twice_is_that_model_bit_for_bit(toy, src):
    from aiayn.infer.beam import beam_search_n_best
    from aiayn.infer.decode import scored_greedy_search
    from aiayn.infer.ensemble import Ensemble

    twice = Ensemble([toy, toy])
    assert greedy_search(twice, src, **KW) == greedy_search(toy, src, **KW)
    one = scored_greedy_search(toy, src, scored=True, alpha=0.6, **KW)
    assert scored_greedy_search(twice, src, scored=True, alpha=0.6, **KW) == one
    one = beam_search_n_best(toy, src, beam=4, n_best=4, **KW)
    assert beam_search_n_best(twice, src, beam=4, n_best=4, **KW) == one  # scores' bits too
    assert twice.training and toy.training  # the searches gave the mode back


def test_an_ensembles_score_is_the_mean_of_its_members_scores(toy, src):
    from aiayn.infer.beam import beam_search_n_best
    from aiayn.infer.ensemble import Ensemble

    other = tiny(seed=1)  # untrained: it pulls the ensemble elsewhere
    pair = Ensemble([toy, other])
    lists = beam_search_n_best(pair, src, beam=3, n_best=3, alpha=0.6, **KW)
    assert [h[0].ids for h in lists] != beam_search(toy, src, beam=3, alpha=0.6, **KW)
    for s, hyps in zip(src, lists, strict=True):
        for h in hyps:
            mean = (score(toy, s, h.ids, 0.6) + score(other, s, h.ids, 0.6)) / 2
            assert abs(h.score - mean) < 1e-4


def test_an_ensemble_of_models_over_other_vocabularies_is_refused(tok, corpus, tmp_path):
    from aiayn.config import TokenizerConfig
    from aiayn.errors import ConfigError
    from aiayn.infer.ensemble import check_same_vocabulary
    from aiayn.tokenizer import train_tokenizer

    check_same_vocabulary(["a", "b"], [tok, tok])
    sents = (corpus / "train.en").read_text().splitlines()
    other = train_tokenizer(TokenizerConfig(vocab_size=120), sents, tmp_path / "other.model")
    with pytest.raises(ConfigError, match="b has another vocabulary than a .* same tokenizer"):
        check_same_vocabulary(["a", "b"], [tok, other])
