"""The scores a validation and `aiayn evaluate` report: sacreBLEU's BLEU, chrF and TER of
translations, loss, perplexity and accuracy of batches, and a language model's scores of a
whole text (lm_scores.py) with the run's window and unit; and `aiayn score`'s, of a
hypotheses file against a references file, the paper's BLEU among them (paper_bleu.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from torch import nn

from aiayn.config import Config
from aiayn.data import open_split
from aiayn.data.batch import Batch
from aiayn.engine.loss import batch_loss, grad_free
from aiayn.errors import DataError
from aiayn.eval.lm_scores import lm_scores
from aiayn.eval.paper_bleu import compound_split_bleu
from aiayn.metric_names import ACCURACY, BLEU, BLEU_LC, CHRF, LOSS, PPL, TER
from aiayn.tokenizer import Tokenizer


def translation_scores(hyps: list[str], refs: list[str], tokenize: str = "13a") -> dict[str, Any]:
    """Corpus sacreBLEU: BLEU cased and lowercased, chrF (chrF2, sacreBLEU's default) and TER,
    each with its signature, and the share of exact matches."""
    metrics = {
        BLEU: sacrebleu.metrics.BLEU(tokenize=tokenize),
        BLEU_LC: sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=True),
        CHRF: sacrebleu.metrics.CHRF(),
        TER: sacrebleu.metrics.TER(),
    }
    out: dict[str, Any] = {}
    for name, metric in metrics.items():
        out[name] = metric.corpus_score(hyps, [refs]).score
        out[f"{name}_signature"] = str(metric.get_signature())
    out["exact_match"] = sum(h.strip() == r.strip() for h, r in zip(hyps, refs, strict=True)) / max(
        len(refs), 1
    )
    return out


def file_scores(
    hyp: str | Path, ref: str | Path, tokenize: str = "13a", compound_split: str | None = None
) -> dict[str, Any]:
    """`aiayn score`: the hypotheses file against the references file, line by line, as
    translation_scores scores them; with compound_split=LANG also the paper's tokenized,
    compound-split BLEU (paper_bleu.py) with Moses' rules for LANG, the target language."""
    hyps, refs = _lines(hyp), _lines(ref)
    if len(hyps) != len(refs):
        raise DataError(f"{hyp} has {len(hyps)} lines and {ref} {len(refs)}: they must pair up")
    result = translation_scores(hyps, refs, tokenize)
    if compound_split:
        result.update(compound_split_bleu(hyps, refs, compound_split))
    result["lines"] = len(refs)
    return result


def _lines(path: str | Path) -> list[str]:
    """The file's lines, split at line feeds only (a sentence may hold another Unicode line
    break), empty ones included: line i of one file pairs with line i of the other."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def validation_metrics(
    model: nn.Module,
    batches: list[Batch],
    kind: str,
    pad_id: int,
    device: torch.device,
    reduce: Callable[[list[float]], list[float]] = lambda sums: sums,
    lockstep: tuple[int, Batch] | None = None,
) -> dict[str, float]:
    """Loss without label smoothing (so perplexity is the model's own), and accuracy.

    `reduce` sums the counts over data-parallel ranks, each of which holds a shard of batches.
    `lockstep` (rounds, filler), for a model whose forward is a collective (ZeRO-3's
    partitioned one): every rank runs `rounds` forwards, a rank with fewer batches the filler
    batch, whose result it drops.
    """
    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0.0, 0
    rounds, filler = lockstep or (len(batches), None)
    with grad_free(lockstep is not None):
        for i in range(rounds):
            batch = (batches[i] if i < len(batches) else filler).to(device)
            loss, right = batch_loss(model, batch, kind, 0.0, pad_id)
            if i < len(batches):
                loss_sum += float(loss)
                correct += float(right)
                n += batch.n_tokens
    model.train(was_training)
    loss_sum, correct, n = reduce([loss_sum, correct, n])
    loss = loss_sum / max(n, 1)
    result = {LOSS: loss, ACCURACY: correct / max(n, 1)}
    if kind != "classifier":
        result[PPL] = math.exp(min(loss, 50.0))
    return result


def split_lines(cfg: Config, spec: str) -> list[str]:
    """Every line of an lm's split, empty ones included: the text that is scored."""
    return [rec["text"] for rec in open_split(cfg.data, spec, "lm")]


def score_lines(
    model: nn.Module,
    tok: Tokenizer,
    lines: list[str],
    cfg: Config,
    device,
    env=None,
    max_batches: int | None = None,
    lockstep: bool = False,
) -> dict[str, float]:
    """lm_scores.py's scores of `lines` with the run's window, stride, unit and batch size; with
    a DistEnv, each rank scores its share of the windows and the sums are combined (`lockstep`:
    every rank runs as many forwards as the busiest, for ZeRO-3's partitioned model)."""
    window = cfg.data.max_len
    rows = max(1, cfg.train.max_tokens // window)
    return lm_scores(
        model,
        tok,
        lines,
        window=window,
        stride=cfg.train.eval_stride,
        unit=cfg.data.unit,
        device=device,
        rows=rows,
        rank=env.rank if env else 0,
        world_size=env.world_size if env else 1,
        reduce=env.sum if env else lambda sums: sums,
        max_windows=None if max_batches is None else max_batches * rows,
        rounds=(lambda n: int(env.max([float(n)])[0])) if lockstep else None,
    )
