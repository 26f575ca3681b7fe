"""Translating sentences with a torch model (or an ensemble): encoding and cutting the sources,
batching them by length, decoding each batch (beam or greedy search, or sampling), and the texts
back in input order, each with its n-best list and its noise where the config asks. What
`aiayn translate`, `aiayn evaluate` and validation decode with, and how a dev set's batches are
shared between ranks so that the hypotheses are one process's at any world size."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch
from torch import nn

from aiayn.config import DecodeConfig
from aiayn.infer.beam import beam_search_n_best
from aiayn.infer.decode import Hypothesis, scored_greedy_search
from aiayn.infer.sampling import noised, sample_search, sentence_generator
from aiayn.tokenizer import Tokenizer

log = logging.getLogger("aiayn")


def translate(
    model: nn.Module,
    tok: Tokenizer,
    lines: list[str],
    cfg: DecodeConfig,
    device: torch.device,
    chunk: int = 0,
    first: int = 0,
) -> list[str]:
    """Each line's best translation, in input order (greedy search leaves its score unmade)."""
    hyps = _translated(model, tok, lines, cfg, device, chunk, first, scored=False)
    return [h[0][0] for h in hyps]


def translate_n_best(
    model: nn.Module,
    tok: Tokenizer,
    lines: list[str],
    cfg: DecodeConfig,
    device: torch.device,
    chunk: int = 0,
    first: int = 0,
) -> list[list[tuple[str, float]]]:
    """Each line's decode.n_best (text, score) hypotheses, best first, in input order. `chunk`
    (a file's chunk, translate_file) and a line's index in `lines` after `first` (the lines of
    a stream before these) seed its samples and noise."""
    return _translated(model, tok, lines, cfg, device, chunk, first, scored=True)


def _translated(model, tok, lines, cfg, device, chunk, first, scored):
    decode = decoder(model, tok, cfg, device, chunk, first, scored=scored)
    max_len, noise = model.cfg.max_len, noiser(cfg, chunk, first)
    return translate_batches(tok, lines, max_len, cfg.batch_size, decode, noise)


Decode = Callable[[list[list[int]], list[int]], list[list[Hypothesis]]]
"""A batch's source token ids (no eos) and the sentences' indices -> their n-best lists."""


def decoder(
    model: nn.Module,
    tok: Tokenizer,
    cfg: DecodeConfig,
    device: torch.device,
    chunk: int = 0,
    first: int = 0,
    scored: bool = True,
) -> Decode:
    """A batch's source token ids (no eos) and the sentences' indices in their input -> each
    one's decode.n_best hypotheses: beam search (or greedy search with decode.beam 1), or
    samples with decode.sampling.enabled (sentence i's seeded from (chunk, first + i)). Not
    `scored`: greedy search leaves its scores 0 (it needs no log-softmax for its argmax)."""
    special = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)
    lengths = dict(max_len_b=cfg.max_len_b, min_len=cfg.min_len)
    sampling = cfg.sampling

    def decode(batch: list[list[int]], index: list[int]) -> list[list[Hypothesis]]:
        rows = [ids + [tok.eos_id] for ids in batch]
        src = torch.full((len(rows), max(map(len, rows))), tok.pad_id, dtype=torch.long)
        for r, ids in enumerate(rows):
            src[r, : len(ids)] = torch.tensor(ids)
        src = src.to(device)
        if sampling.enabled:
            return sample_search(
                model,
                src,
                [(chunk, first + i) for i in index],
                seed=sampling.seed,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                n=cfg.n_best,
                alpha=cfg.alpha,
                **lengths,
                **special,
            )
        if cfg.beam == 1:
            hyps = scored_greedy_search(
                model, src, alpha=cfg.alpha, scored=scored, **lengths, **special
            )
            return [[h] for h in hyps]
        return beam_search_n_best(
            model, src, beam=cfg.beam, alpha=cfg.alpha, n_best=cfg.n_best, **lengths, **special
        )

    return decode


def noiser(cfg: DecodeConfig, chunk: int = 0, first: int = 0) -> Callable[[int, str], str] | None:
    """decode.noise as (sentence index, text) -> noised text, or None where it is off."""
    noise = cfg.noise
    if not (noise.drop or noise.blank or noise.swap):
        return None

    def apply(i: int, text: str) -> str:
        g = sentence_generator(cfg.sampling.seed, (chunk, first + i, 1))  # apart from the samples'
        return " ".join(noised(text.split(), g, noise.drop, noise.blank, noise.swap, noise.filler))

    return apply


def translate_batches(
    tok: Tokenizer,
    lines: list[str],
    max_len: int,
    batch_size: int,
    decode: Decode,
    noise: Callable[[int, str], str] | None = None,
) -> list[list[tuple[str, float]]]:
    """What every engine's translation shares: each line encoded and cut to max_len - 1 tokens
    (room for eos) with a warning, batches of batch_size lines of similar length, and the
    (text, score) n-best list of each line in input order, each text through `noise` if given.
    decode maps a batch's token ids (no eos) and line indices to its n-best lists. A line of
    no tokens is translated as one empty hypothesis of score 0, not decoded (decode.min_len
    would make it say something)."""
    encoded = encode_sources(tok, lines, max_len)
    out: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in lines]
    for idx in length_batches(encoded, batch_size):
        idx = [i for i in idx if encoded[i]]
        if not idx:
            continue
        for i, hyps in zip(idx, decode([encoded[i] for i in idx], idx), strict=True):
            texts = tok.decode([h.ids for h in hyps])
            if noise is not None:
                texts = [noise(i, t) for t in texts]
            out[i] = [(t, h.score) for t, h in zip(texts, hyps, strict=True)]
    return out


def encode_sources(tok: Tokenizer, lines: list[str], max_len: int) -> list[list[int]]:
    """Each line's token ids, cut to max_len - 1 (room for eos), with a warning if any was."""
    max_src = max_len - 1
    encoded = tok.encode(lines)
    too_long = sum(len(ids) > max_src for ids in encoded)
    if too_long:
        log.warning(
            "%d of %d inputs are longer than model.max_len - 1 = %d tokens and were cut to fit",
            too_long,
            len(lines),
            max_src,
        )
        encoded = [ids[:max_src] for ids in encoded]
    return encoded


def length_batches(encoded: list[list[int]], batch_size: int) -> list[list[int]]:
    """The sentences' indices in batches of batch_size, by length: how one process batches
    them, and so what every rank's share is cut from (a sentence's hypothesis can depend on its
    batch's padded shape, in the last bits of a score)."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def rank_shares(batches: list[list[int]], encoded: list[list[int]], world: int) -> list[list[int]]:
    """Which batches each rank decodes (their indices, in order), balanced by cost: each
    batch, costliest first, goes to the rank with the least so far. A batch's cost is its
    rows times its longest source, which the decoding steps follow."""
    cost = [len(b) * (1 + max(len(encoded[i]) for i in b)) for b in batches]
    load, shares = [0] * world, [[] for _ in range(world)]
    for j in sorted(range(len(batches)), key=lambda j: (-cost[j], j)):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += cost[j]
        shares[rank].append(j)
    return [sorted(share) for share in shares]


def n_best_lines(hyps: list[list[tuple[str, float]]], first: int = 0, as_json: bool = False):
    """The output lines of n-best lists, sentence `first` first. Text: a line per hypothesis,
    `INDEX ||| TEXT ||| SCORE` (Moses's and Marian's n-best format, without their feature
    column); JSON: a line per sentence, {"index", "hypotheses": [{"text", "score"}, ...]}."""
    if as_json:
        return [
            json.dumps(
                {"index": first + i, "hypotheses": [{"text": t, "score": s} for t, s in h]},
                ensure_ascii=False,
            )
            for i, h in enumerate(hyps)
        ]
    return [f"{first + i} ||| {t} ||| {s:.6f}" for i, h in enumerate(hyps) for t, s in h]


def renumbered(lines: list[str], first: int, as_json: bool = False) -> tuple[list[str], int]:
    """n_best_lines' lines of sentences numbered from 0 (a chunk of a file, translate_file),
    numbered from sentence `first` instead; and how many sentences they hold. Text: the last
    line's number + 1, since every sentence has at least one hypothesis (an empty line's is
    empty); JSON: a line each."""
    if as_json:
        rows = [json.loads(line) for line in lines]
        for row in rows:
            row["index"] += first
        return [json.dumps(row, ensure_ascii=False) for row in rows], len(rows)
    split = [line.split(" ||| ", 1) for line in lines]  # the number first: a text may hold |||
    held = int(split[-1][0]) + 1 if split else 0
    return [f"{int(i) + first} ||| {rest}" for i, rest in split], held
