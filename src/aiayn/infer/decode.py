"""Greedy search and LM sampling, with cached keys and values, and what every search shares
(beam search, beam.py, and sampled translations, sampling.py, use these helpers).

Each new token costs one decoder step: the decoder is fed only the newest token, and the keys
and values of earlier positions (and of the encoder output) come from a DecoderState.
Returned ids exclude bos and eos. A hypothesis's score is log P(Y | X) / lp(Y), eos counted.

The searches see a model through encode, decode, cfg and parameters only: an ensemble
(infer/ensemble.py) is one such model, whose `decode` returns log-probabilities already
(`log_probs = True`) and whose decoder state it makes itself (`new_state`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from aiayn.engine.loss import grad_free
from aiayn.model import DecoderOnlyLM, DecoderState, Seq2SeqTransformer


class Hypothesis(NamedTuple):
    """One output of a search: its score, log P(Y | X) / lp(Y) with eos counted, and its
    token ids (no bos, no eos)."""

    score: float
    ids: list[int]


def new_state(model) -> DecoderState:
    """The decoder state a search carries: an ensemble's holds one per member."""
    make = getattr(model, "new_state", None)
    return make() if make is not None else DecoderState()


def log_probs(model, logits: torch.Tensor) -> torch.Tensor:
    """(rows, V) log-probabilities of a step's output: an ensemble's decode gives them."""
    if getattr(model, "log_probs", False):
        return logits.float()
    return torch.log_softmax(logits.float(), dim=-1)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd while decoding; the caller's mode comes back.
    A model that says it is `partitioned` (evaluate.Lockstep) gets loss.grad_free's no_grad."""
    was_training = model.training
    model.eval()
    try:
        with grad_free(getattr(model, "partitioned", False)):
            yield
    finally:
        model.train(was_training)


def length_penalty(length: int | torch.Tensor, alpha: float):
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (§6.1); |Y| counts the eos token."""
    return ((5 + length) / 6) ** alpha


def max_lengths(model: Seq2SeqTransformer, src: torch.Tensor, pad_id: int, max_len_b: int):
    """(B,) most output tokens per sentence: its source length + max_len_b (§6.1), capped so
    that bos + outputs fit the model's positions."""
    src_len = (src != pad_id).sum(dim=1)
    return (src_len + max_len_b).clamp(max=model.cfg.max_len - 1)


def min_lengths(src: torch.Tensor, pad_id: int, min_len: int) -> torch.Tensor:
    """(B,) fewest output tokens per sentence before eos: min_len, but none for an empty
    source (eos alone), whose translation may well be empty."""
    return torch.where((src != pad_id).sum(dim=1) > 1, min_len, 0)


def no_early_eos(logp: torch.Tensor, step: int, minimums: torch.Tensor, eos_id: int):
    """Scores (rows, V) with eos impossible in the rows whose hypotheses are still shorter
    than their minimum (one per row). Callers skip it from step min_len on; no host sync."""
    early = step < minimums  # (rows,)
    logp[:, eos_id] = torch.where(early, float("-inf"), logp[:, eos_id])
    return logp


def greedy_search(
    model: Seq2SeqTransformer,
    src: torch.Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len_b: int = 50,
    min_len: int = 0,
) -> list[list[int]]:
    """The most probable next token at every step, for each sentence of src (B, S), eos not
    before min_len tokens (but for an empty source). A sentence leaves the batch when it
    ends, so later steps decode only the sentences still running."""
    special = dict(bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    hyps = scored_greedy_search(model, src, max_len_b=max_len_b, min_len=min_len, **special)
    return [h.ids for h in hyps]


def scored_greedy_search(
    model: Seq2SeqTransformer,
    src: torch.Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len_b: int = 50,
    min_len: int = 0,
    alpha: float = 0.0,
    scored: bool = False,
) -> list[Hypothesis]:
    """greedy_search's hypotheses with their scores (log P / lp(Y) with `alpha`, as beam
    search scores them) when `scored`, else 0.0. The argmax is of the logits, scored or not
    (the log-softmax only reads the chosen tokens' log P): the same output either way."""
    out: list[list[int]] = [[] for _ in range(src.size(0))]
    total = [0.0] * src.size(0)  # log P of each sentence's hypothesis so far
    with eval_mode(model):
        memory, src_mask = model.encode(src)  # (B, S, D), (B, 1, 1, S)
        limits = max_lengths(model, src, pad_id, max_len_b)  # (B,)
        minimums = min_lengths(src, pad_id, min_len)  # (B,)
        live = list(range(src.size(0)))  # the sentence of each row still decoded
        state = new_state(model)
        last = src.new_full((src.size(0), 1), bos_id)  # (B', 1)
        for step in range(int(limits.max())):
            logits = model.decode(last, memory, src_mask, state)[:, -1]  # (B', V)
            logp = log_probs(model, logits) if scored else None
            logits = ban_pad_and_bos(logits, pad_id, bos_id, eos_id)
            if step < min_len:
                logits = no_early_eos(logits, step, minimums, eos_id)
            last = logits.argmax(dim=-1, keepdim=True)
            if logp is not None:
                for b, lp in zip(live, logp.gather(1, last)[:, 0].tolist(), strict=True):
                    total[b] += lp
            for b, token in zip(live, last[:, 0].tolist(), strict=True):
                out[b].append(token)
            ended = (last[:, 0] == eos_id) | (step + 1 >= limits)  # (B',)
            if bool(ended.any()):
                keep = (~ended).nonzero()[:, 0]  # (B'',)
                if keep.numel() == 0:
                    break
                live = [live[i] for i in keep.tolist()]
                last, limits, minimums = last[keep], limits[keep], minimums[keep]
                memory, src_mask = memory[keep], src_mask[keep]
                state.reorder(keep)
                state.select_sources(keep)
    # A hypothesis cut at its limit has no eos: its length counts its tokens alone.
    return [
        Hypothesis(t / length_penalty(len(row), alpha) if scored else 0.0, before_eos(row, eos_id))
        for row, t in zip(out, total, strict=True)
    ]


def before_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids


def ban_pad_and_bos(scores: torch.Tensor, pad_id: int, bos_id: int, eos_id: int) -> torch.Tensor:
    """Scores (rows, V) with pad and bos impossible (unless one is also eos, which ends an
    output): neither is ever an output. A trained
    model all but never picks them; an imported Marian model's bos is a copy of its pad row
    (aiayn.tokenizer.marian), which Marian's generate bans too. After the log-softmax, as there,
    so a beam's scores are still log-probabilities of the whole vocabulary."""
    scores[:, [i for i in (pad_id, bos_id) if i != eos_id]] = float("-inf")
    return scores


def generate(
    model: DecoderOnlyLM,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Sample up to max_new_tokens after each prompt; returns the new tokens, without eos
    (eos_id None: eos is an ordinary token and sampling runs to max_new_tokens).

    temperature 0 takes the argmax. Prompts of different lengths are batched without padding:
    all are fed up to the shortest prompt's length, then each row is fed its own prompt tokens
    while the others sample (the forced-prefix trick), one cached step per position.
    """
    if not prompts or min(map(len, prompts)) < 1:
        raise ValueError("generate needs at least one prompt, each of at least one token")
    device = next(model.parameters()).device
    lens = torch.tensor([len(p) for p in prompts], device=device)  # (B,)
    total = int(lens.max()) + max_new_tokens
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)  # (B, total)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    pos = int(lens.min())
    with eval_mode(model):
        state = DecoderState()
        logits = model(tokens[:, :pos], state=state)  # (B, pos, V)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        while pos < total:
            nxt = _sample(logits[:, -1], temperature, top_k, generator)  # (B,)
            in_prompt = pos < lens  # (B,)
            tokens[:, pos] = torch.where(in_prompt, tokens[:, pos], nxt)
            ended = ~in_prompt & (nxt == eos_id) if eos_id is not None else False
            done |= ended | (pos + 1 >= lens + max_new_tokens)
            pos += 1
            if bool(done.all()):
                break
            logits = model(tokens[:, pos - 1 : pos], state=state)  # (B, 1, V)
    rows = tokens.tolist()
    return [
        before_eos(row[n:pos][:max_new_tokens], eos_id)
        if eos_id is not None
        else row[n:pos][:max_new_tokens]
        for row, n in zip(rows, lens.tolist(), strict=True)
    ]


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
