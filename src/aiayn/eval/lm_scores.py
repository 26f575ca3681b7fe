"""Scoring a language model on a whole text, the way published figures are computed.

The text is one running stream: every line's tokens followed by eos (eos is the line break,
as the lm training stream has it), after one eos that stands for "start of text". Every token
of every line, eos included, is scored exactly once:
- stride None: non-overlapping windows of `window` tokens; a token sees the tokens before it in
  its own window only;
- stride s < window: windows of `window` tokens that advance by s; each scores its last s
  tokens (the first window scores all of its own), so every token after the first window is
  scored with at least window - s tokens of context.

Units turn the summed loss (nats) into figures that compare across tokenizers: characters
(each line's characters plus one for its break) give bits per character; words
(whitespace-separated words plus one per line, as WikiText counts `<eos>`) give word-level
perplexity.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from aiayn.data.batch import Batch
from aiayn.engine.loss import batch_loss, grad_free
from aiayn.metric_names import ACCURACY, BPC, LOSS, PPL, WORD_PPL
from aiayn.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def text_stream(tok: Tokenizer, lines: list[str]) -> torch.Tensor:
    """(N + 1,) int64: eos, then each line's tokens followed by eos."""
    return _joined(tok.encode(lines), tok.eos_id)


def _joined(encoded: list[list[int]], eos_id: int) -> torch.Tensor:
    ids = [eos_id]
    for line in encoded:
        ids.extend(line)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def count_units(lines: list[str], unit: str) -> int:
    """Characters (line breaks included) or words (one more per line) of `lines`."""
    if unit == "characters":
        return sum(len(line) + 1 for line in lines)
    if unit == "words":
        return sum(len(line.split()) + 1 for line in lines)
    raise ValueError(f"unit must be characters or words, got {unit!r}")


def windows(n_targets: int, window: int, stride: int | None) -> list[tuple[int, int, int]]:
    """(begin, end, first) of each window over targets 1..n_targets of a stream: the window
    reads stream[begin:end] and predicts stream[begin + 1 : end + 1]; targets from stream
    position `first` on are scored (first > begin where the previous window scored them)."""
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"the stride must be in [1, {window}], got {stride}")
    out, begin, scored = [], 0, 0  # targets 1..scored are done
    while scored < n_targets:
        end = min(begin + window, n_targets)
        out.append((begin, end, scored + 1))
        scored, begin = end, begin + stride
    return out


def score_stream(
    model: nn.Module,
    stream: torch.Tensor,
    window: int,
    stride: int | None,
    pad_id: int,
    device: torch.device,
    rows: int = 8,
    rank: int = 0,
    world_size: int = 1,
    max_windows: int | None = None,
    rounds: Callable[[int], int] | None = None,
) -> tuple[float, float, int]:
    """(summed NLL in nats, correct argmax predictions, tokens scored) of this rank's share of
    the windows over `stream` (window i belongs to rank i % world_size; sum over ranks for the
    whole text). `rounds` (this rank's batch count -> every rank's), for a model whose forward
    is a collective (ZeRO-3's partitioned one): every rank runs as many forwards as the
    busiest, the extra ones on a batch whose result it drops."""
    every = windows(len(stream) - 1, window, stride)[:max_windows]
    spans = every[rank::world_size]
    batches = [spans[lo : lo + rows] for lo in range(0, len(spans), rows)]
    count_rounds = rounds(len(batches)) if rounds else len(batches)
    filler = batches[0] if batches else every[:rows]
    was_training = model.training
    model.eval()
    nll, correct, n = 0.0, 0.0, 0
    with grad_free(rounds is not None):
        for b in range(count_rounds):
            part = batches[b] if b < len(batches) else filler
            width = max(end - begin for begin, end, _ in part)
            tgt_in = torch.full((len(part), width), pad_id, dtype=torch.long)
            tgt_out = torch.full((len(part), width), pad_id, dtype=torch.long)
            for r, (begin, end, first) in enumerate(part):
                tgt_in[r, : end - begin] = stream[begin:end]
                skip = first - 1 - begin  # targets the previous window already scored
                tgt_out[r, skip : end - begin] = stream[first : end + 1]
            count = int((tgt_out != pad_id).sum())
            batch = Batch(torch.arange(len(part)), count, tgt_in=tgt_in, tgt_out=tgt_out)
            loss, right = batch_loss(model, batch.to(device), "lm", 0.0, pad_id)
            if b < len(batches):
                nll, correct, n = nll + float(loss), correct + float(right), n + count
    model.train(was_training)
    return nll, correct, n


def lm_scores(
    model: nn.Module,
    tok: Tokenizer,
    lines: list[str],
    *,
    window: int,
    stride: int | None,
    unit: str,
    device: torch.device,
    rows: int = 8,
    rank: int = 0,
    world_size: int = 1,
    reduce: Callable[[list[float]], list[float]] = lambda sums: sums,
    max_windows: int | None = None,
    rounds: Callable[[int], int] | None = None,
) -> dict[str, float]:
    """Loss per token, perplexity and, for unit characters or words, bits per character or
    word-level perplexity of the whole text `lines`. `reduce` sums over data-parallel ranks.
    max_windows scores only the first windows: loss and perplexity only, of a part. `rounds`:
    see score_stream."""
    encoded = tok.encode(lines)  # once: the stream and the round-trip check share it
    stream = _joined(encoded, tok.eos_id)
    sums = score_stream(
        model,
        stream,
        window,
        stride,
        tok.pad_id,
        device,
        rows,
        rank,
        world_size,
        max_windows,
        rounds,
    )
    nll, correct, n = reduce(list(sums))
    loss = nll / max(n, 1)
    out = {LOSS: loss, ACCURACY: correct / max(n, 1), PPL: math.exp(min(loss, 50.0))}
    out["tokens"] = int(n)
    if unit != "tokens" and max_windows is None:
        units = count_units(lines, unit)
        out[unit] = units
        out["tokens_per_" + unit[:-1]] = (len(stream) - 1) / max(units, 1)
        if unit == "characters":
            out[BPC] = nll / (max(units, 1) * math.log(2))
        else:
            out[WORD_PPL] = math.exp(min(nll / max(units, 1), 50.0))
    lossy = sum(a != b for a, b in zip(tok.decode(encoded), lines, strict=True))
    if lossy and unit != "tokens":
        log.warning(
            "%d of %d lines do not decode back to themselves: the tokenizer normalises the text, "
            "so the score per %s is of a slightly different text. Train the tokenizer with "
            "tokenizer.normalization=identity and tokenizer.remove_extra_whitespaces=false",
            lossy,
            len(lines),
            unit[:-1],
        )
    return out
