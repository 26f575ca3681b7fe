"""Sampled translations (decode.sampling) and Edunov et al.'s noised ones (decode.noise), for
back-translation: "Understanding Back-Translation at Scale" (2018) found both train better
models than beam output on large data.

Reproducible at any number of ranks: every random number a sentence uses comes from its own
generator, seeded from (decode.sampling.seed, the sentence's key), where the key is where the
sentence is in its input (its line, and its chunk of a file) and never which rank or batch
decodes it. The draws are made up front, one uniform per step and sample, so that a step
samples the whole batch at once by inverse CDF.
"""

from __future__ import annotations

import numpy as np
import torch

from aiayn.infer.decode import (
    Hypothesis,
    ban_pad_and_bos,
    before_eos,
    eval_mode,
    length_penalty,
    log_probs,
    max_lengths,
    min_lengths,
    new_state,
    no_early_eos,
)


def sentence_generator(seed: int, key: tuple[int, ...]) -> torch.Generator:
    """A generator of its own for the sentence at `key`: numpy's SeedSequence mixes (seed, *key)
    into a 63-bit seed, so that nearby keys do not give related streams."""
    mixed = np.random.SeedSequence([seed, *key]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(mixed) >> 1)


def filtered_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """(rows, V) logits / temperature, with what top-k (0: all) and top-p (nucleus, Holtzman
    et al. 2020; 1.0: all) leave out set to -inf. The most probable token always stays."""
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (rows, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (rows, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(1, order, before >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_search(
    model,
    src: torch.Tensor,
    keys: list[tuple[int, ...]],
    *,
    seed: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    n: int = 1,
    alpha: float = 0.0,
    max_len_b: int = 50,
    min_len: int = 0,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> list[list[Hypothesis]]:
    """n samples of each sentence of src (B, S), sentence b's from sentence_generator(seed,
    keys[b]), best score first. A score is the model's own log P(Y | X) / lp(Y) (temperature
    and filters do not enter it), as beam search's. eos not before min_len tokens, and the
    length limits of beam search. top_k 1 is greedy search."""
    B = src.size(0)
    limits = max_lengths(model, src, pad_id, max_len_b)  # (B,)
    steps = int(limits.max())
    # (B * n, steps): sample j of sentence b is row b * n + j; its u[t] picks token t. Each
    # sentence draws (n, its own limit), which its source fixes, whatever the batch: the
    # columns past it are never read.
    uniforms = torch.ones(B * n, steps)
    for b, (key, limit) in enumerate(zip(keys, limits.tolist(), strict=True)):
        drawn = torch.rand(n, limit, generator=sentence_generator(seed, key))
        uniforms[b * n : (b + 1) * n, :limit] = drawn
    uniforms = uniforms.to(src.device)
    src = src.repeat_interleave(n, dim=0)  # (B * n, S)
    out: list[list[int]] = [[] for _ in range(B * n)]
    total = [0.0] * (B * n)
    with eval_mode(model):
        memory, src_mask = model.encode(src)
        limits = limits.repeat_interleave(n)  # (B * n,)
        minimums = min_lengths(src, pad_id, min_len)
        live = list(range(B * n))
        state = new_state(model)
        last = src.new_full((B * n, 1), bos_id)
        for step in range(steps):
            logits = model.decode(last, memory, src_mask, state)[:, -1]  # (rows, V)
            # As beam search: log-probabilities of the whole vocabulary, then the bans.
            logp = ban_pad_and_bos(log_probs(model, logits), pad_id, bos_id, eos_id)
            if step < min_len:
                logp = no_early_eos(logp, step, minimums, eos_id)
            probs = torch.softmax(filtered_logits(logp, temperature, top_k, top_p), dim=-1)
            cdf = probs.cumsum(dim=-1)  # (rows, V)
            u = uniforms[:, step : step + 1] * cdf[:, -1:]  # (rows, 1): cdf's end may be < 1
            last = torch.searchsorted(cdf, u, right=True).clamp(max=cdf.size(-1) - 1)
            chosen = logp.gather(1, last)[:, 0]  # (rows,) the model's log P
            for b, token, lp in zip(live, last[:, 0].tolist(), chosen.tolist(), strict=True):
                out[b].append(token)
                total[b] += lp
            ended = (last[:, 0] == eos_id) | (step + 1 >= limits)
            if bool(ended.any()):
                keep = (~ended).nonzero()[:, 0]
                if keep.numel() == 0:
                    break
                live = [live[i] for i in keep.tolist()]
                last, limits, minimums = last[keep], limits[keep], minimums[keep]
                uniforms, memory, src_mask = uniforms[keep], memory[keep], src_mask[keep]
                state.reorder(keep)
                state.select_sources(keep)
    hyps = [
        Hypothesis(t / length_penalty(len(row), alpha), before_eos(row, eos_id))
        for row, t in zip(out, total, strict=True)
    ]
    return [sorted(hyps[b * n : (b + 1) * n], key=lambda h: -h.score) for b in range(B)]


def noised(
    words: list[str], generator: torch.Generator, drop: float, blank: float, swap: int, filler: str
) -> list[str]:
    """Edunov et al. (2018) §3's noise on a sentence's words: each dropped with probability
    `drop`, each other one replaced by `filler` with probability `blank`, then the words
    shuffled so that none moves more than `swap` positions (Lample et al. 2018's local shuffle:
    sort by position + U(0, swap + 1)); 0 turns each off."""
    kept = []
    for w in words:
        u_drop, u_blank = torch.rand(2, generator=generator).tolist()
        if u_drop < drop:
            continue
        kept.append(filler if u_blank < blank else w)
    if swap and len(kept) > 1:
        shift = torch.rand(len(kept), generator=generator) * (swap + 1)
        order = (torch.arange(len(kept)) + shift).argsort(stable=True).tolist()
        kept = [kept[i] for i in order]
    return kept
