"""`aiayn evaluate`: a checkpoint, or a CTranslate2 export, scored on a split of its run's data:
BLEU, chrF and TER with their signatures (translation), the whole split's loss and perplexity
(lm), accuracy (classifier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiayn.checkpoint import CHECKPOINTS_DIR
from aiayn.checkpoint.format import EMA, ema_of
from aiayn.config import Config
from aiayn.data import make_loader, open_split
from aiayn.data.split_copies import copied_split
from aiayn.errors import ConfigError, ExportError
from aiayn.eval.scores import score_lines, split_lines, translation_scores, validation_metrics
from aiayn.export.ct2_runtime import Ct2Model, translate_ct2
from aiayn.infer.ensemble import load_ensemble
from aiayn.infer.translate import n_best_lines, translate_n_best


def evaluate(
    checkpoint: str | Path | list[str],
    split: str = "test",
    overrides: list[str] = (),
    device: str = "auto",
) -> dict:
    """Score a checkpoint on a data split: BLEU (seq2seq), perplexity (lm), accuracy.
    `device`: auto, cpu or cuda (`aiayn evaluate --device`). Several translation checkpoints
    are scored as an ensemble (infer/ensemble.py), with the first one's run and config."""
    several = [checkpoint] if isinstance(checkpoint, str | Path) else list(checkpoint)
    cfg, model, tok, found = load_ensemble(several, overrides, device)
    ckpt = found[0]
    # RUN/ema: the checkpoint's train.ema weights, named and written apart from its own
    ema = len(found) == 1 and ema_of(several[0]) is not None
    name = f"{ckpt.name}.{EMA}" if ema else ckpt.name
    device = next(model.parameters()).device
    # A training run's checkpoint (or its averaged model, RUN/averaged): the run may hold a
    # copy of the split.
    run_dir = ckpt.parent.parent if ckpt.parent.name == CHECKPOINTS_DIR else ckpt.parent
    if (run_dir / CHECKPOINTS_DIR).is_dir():
        cfg = copied_split(cfg, split, run_dir) or cfg
    spec = _split_spec(cfg, split)
    kind = cfg.model.kind
    if kind == "seq2seq":
        result = _translated(
            cfg,
            spec,
            lambda srcs: translate_n_best(model, tok, srcs, cfg.decode, device),
            Path(cfg.run_dir) / "eval" / f"{split}.{name}.hyp",
        )
    elif kind == "lm":
        result = score_lines(model, tok, split_lines(cfg, spec), cfg, device)
        result["window"] = cfg.data.max_len
        result["stride"] = cfg.train.eval_stride or cfg.data.max_len
    else:
        loader = make_loader(cfg, spec, tok, train=False)
        result = validation_metrics(model, list(loader), kind, tok.pad_id, device)
    one = str(ckpt / EMA) if ema else str(ckpt)
    result["checkpoint"] = one if len(found) == 1 else [str(c) for c in found]
    result["split"] = split
    return result


def evaluate_ct2(
    model_dir: str | Path,
    split: str = "test",
    overrides: list[str] = (),
    *,
    device: str = "auto",
    threads: int | None = None,
) -> dict[str, Any]:
    """evaluate's BLEU of a translation export on a split of the run's data (the hypotheses
    written to run_dir/eval/SPLIT.DIRNAME.ct2.hyp). An lm's perplexity is scored from its
    checkpoint (--engine torch)."""
    model = Ct2Model(model_dir, overrides, device, threads)
    if model.kind != "seq2seq":
        raise ExportError(
            f"{model.path} is an {model.kind} export: evaluate --engine ctranslate2 measures "
            "BLEU of translation models; score an lm's perplexity from its checkpoint "
            "(--engine torch)"
        )
    cfg = model.cfg
    result = _translated(
        cfg,
        _split_spec(cfg, split),
        lambda srcs: translate_ct2(model, srcs, n_best=True),
        Path(cfg.run_dir) / "eval" / f"{split}.{model.path.name}.ct2.hyp",
    )
    result["checkpoint"] = str(model.path)
    result["split"] = split
    return result


def _split_spec(cfg: Config, split: str) -> str:
    spec = getattr(cfg.data, split, None)
    if spec is None:
        raise ConfigError(f"data.{split} is not set in the run's config; pass data.{split}=...")
    return spec


def _translated(cfg: Config, spec: str, translate_lines, out: Path) -> dict[str, Any]:
    """The split's sources translated by `translate_lines` (to n-best lists), the best of each
    scored against its references, a few samples, and every hypothesis written to `out`, the
    references beside it (.ref), line by line, for other scorers (`aiayn score`); with
    decode.n_best above 1 the lists too (.nbest, `INDEX ||| TEXT ||| SCORE`)."""
    pairs = list(open_split(cfg.data, spec, "seq2seq"))
    srcs, refs = [p["src"] for p in pairs], [p["tgt"] for p in pairs]
    lists = translate_lines(srcs)
    hyps = [h[0][0] for h in lists]
    result: dict[str, Any] = translation_scores(hyps, refs, cfg.decode.bleu_tokenize)
    result["samples"] = list(zip(srcs[:5], refs[:5], hyps[:5], strict=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, lines in ((out, hyps), (out.with_suffix(".ref"), refs)):
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result["hypotheses_file"] = str(out)
    result["references_file"] = str(out.with_suffix(".ref"))
    if cfg.decode.n_best > 1:
        nbest = out.with_suffix(".nbest")
        nbest.write_text("".join(line + "\n" for line in n_best_lines(lists)), encoding="utf-8")
        result["n_best_file"] = str(nbest)
    return result
