"""Translating sentences with a torch model: encoding and cutting the sources, batching them by
length, decoding each batch (beam or greedy search), and the texts back in input order. What
`aiayn translate`, `aiayn evaluate` and validation decode with, and how a dev set's batches are
shared between ranks so that the hypotheses are one process's at any world size."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from aiayn.config import DecodeConfig
from aiayn.infer.decode import beam_search, greedy_search
from aiayn.tokenizer import Tokenizer

log = logging.getLogger("aiayn")


def translate(
    model: nn.Module, tok: Tokenizer, lines: list[str], cfg: DecodeConfig, device: torch.device
) -> list[str]:
    """Translate `lines` in length-sorted batches; hypotheses come back in input order."""
    decode = decoder(model, tok, cfg, device)
    return translate_batches(tok, lines, model.cfg.max_len, cfg.batch_size, decode)


def decoder(
    model: nn.Module, tok: Tokenizer, cfg: DecodeConfig, device: torch.device
) -> Callable[[list[list[int]]], list[list[int]]]:
    """A batch's source token ids (no eos) -> its hypotheses' token ids, by beam search (or
    greedy search with decode.beam 1)."""
    special = dict(bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)

    def decode(batch: list[list[int]]) -> list[list[int]]:
        rows = [ids + [tok.eos_id] for ids in batch]
        src = torch.full((len(rows), max(map(len, rows))), tok.pad_id, dtype=torch.long)
        for r, ids in enumerate(rows):
            src[r, : len(ids)] = torch.tensor(ids)
        lengths = dict(max_len_b=cfg.max_len_b, min_len=cfg.min_len)
        if cfg.beam == 1:
            return greedy_search(model, src.to(device), **lengths, **special)
        return beam_search(
            model, src.to(device), beam=cfg.beam, alpha=cfg.alpha, **lengths, **special
        )

    return decode


def translate_batches(
    tok: Tokenizer,
    lines: list[str],
    max_len: int,
    batch_size: int,
    decode: Callable[[list[list[int]]], list[list[int]]],
) -> list[str]:
    """What every engine's translation shares: each line encoded and cut to max_len - 1 tokens
    (room for eos) with a warning, batches of batch_size lines of similar length, and the text of
    each hypothesis in input order. decode maps a batch's token ids (no eos) to its hypotheses'.
    A line of no tokens is translated as an empty line, not decoded (decode.min_len would make
    it say something)."""
    encoded = encode_sources(tok, lines, max_len)
    out: list[str] = [""] * len(lines)
    for idx in length_batches(encoded, batch_size):
        idx = [i for i in idx if encoded[i]]
        if not idx:
            continue
        for i, text in zip(idx, tok.decode(decode([encoded[i] for i in idx])), strict=True):
            out[i] = text
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
