"""A finished run leaves a finished model: the last (or best) K checkpoints averaged into
RUN/averaged, scored on the dev and test sets, with a summary beside it.

`aiayn finish RUN --last K` (or `--best K`), or `train.finish: K` at the end of a run (rank 0,
on CPU-sized work: averaging reads model.safetensors files, one tensor at a time). The average
is a checkpoint directory like any other: `aiayn evaluate --checkpoint RUN/averaged`, `aiayn
export RUN/averaged`. A second finish replaces it. A run with train.ema has the average of
its checkpoints' EMAs scored too (RUN/averaged/ema, `ema_scores` in the summary).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from aiayn.checkpoint import CHECKPOINTS_DIR, checkpoints_in, read_manifest
from aiayn.checkpoint.average import average
from aiayn.checkpoint.format import EMA, EMA_FILE
from aiayn.checkpoint.retention import Retention
from aiayn.config import config_from_dict
from aiayn.errors import CheckpointError
from aiayn.runtime.durable import write_atomic

log = logging.getLogger("aiayn")
AVERAGED, SUMMARY = "averaged", "summary.json"
SCORES = ("bleu", "bleu_lc", "chrf", "ter", "exact_match", "loss", "ppl", "accuracy", "bpc")


def chosen(run_dir: Path, k: int, select: str) -> list[Path]:
    """The K checkpoints to average: the newest, or the best by the run's best_metric."""
    if not run_dir.is_dir():
        raise CheckpointError(
            f"no run directory {run_dir}: give the run_dir a training run wrote (its "
            "config's run_dir)"
        )
    ckpts = checkpoints_in(run_dir / CHECKPOINTS_DIR)
    if not ckpts:  # the best's rule is read from the newest checkpoint: there is none
        raise CheckpointError(
            f"{run_dir} has no checkpoints ({run_dir / CHECKPOINTS_DIR} holds no step_N): "
            "train it first (checkpoint.every_steps saves them), or give another run_dir"
        )
    if select == "best":
        cfg = config_from_dict(read_manifest(ckpts[-1], verify=False)["config"]).checkpoint
        rule = Retention(
            cfg.keep_last, best_metric=cfg.best_metric, higher_is_better=cfg.higher_is_better
        )
        ckpts = sorted(rule.ranked(ckpts)[:k])
        what = f"recorded {cfg.best_metric}"
    else:
        ckpts, what = ckpts[-k:], "valid checkpoints"
    if len(ckpts) < k:
        raise CheckpointError(
            f"finish needs {k} checkpoints ({select}) in {run_dir}, and {len(ckpts)} have "
            f"{what}: keep more (checkpoint.keep_last, keep_best) or average fewer"
        )
    return ckpts


def finish(run_dir: str | Path, k: int, select: str = "last") -> dict[str, Any]:
    """Average, score, summarise; return the summary (also in RUN/averaged/summary.json)."""
    from aiayn.eval.evaluate import evaluate  # torch models: imported when a run is finished

    run_dir = Path(run_dir)
    ckpts = chosen(run_dir, k, select)
    out, tmp = run_dir / AVERAGED, run_dir / f".{AVERAGED}-new"
    shutil.rmtree(tmp, ignore_errors=True)
    average(ckpts, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    manifest = read_manifest(out, verify=False)
    summary: dict[str, Any] = {
        "select": select,
        "checkpoints": [c.name for c in ckpts],
        "model": str(out),
        "scores": {},
    }
    # With train.ema, the average of the checkpoints' EMAs too (OUTPUT/ema): "EMA averaged".
    models = {"scores": out}
    if EMA_FILE in manifest["files"]:
        models["ema_scores"] = out / EMA
        summary["ema_scores"] = {}
    for split in ("valid", "test"):
        if not manifest["config"]["data"].get(split):
            continue
        for key, model in models.items():
            result = evaluate(model, split)
            summary[key][split] = {
                k: v
                for k, v in result.items()
                if k in SCORES
                or k.endswith("_signature")
                or k in ("hypotheses_file", "references_file")
            }
            shown = ", ".join(f"{k} {result[k]:.4g}" for k in SCORES if k in result)
            log.info(
                "finish: the average of %s%s on %s: %s",
                "the EMAs of " if key == "ema_scores" else "",
                ", ".join(summary["checkpoints"]),
                split,
                shown,
            )
    write_atomic(out / SUMMARY, json.dumps(summary, indent=1) + "\n")
    return summary
