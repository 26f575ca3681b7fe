"""Early stopping (train.patience): a run stops when its ranking metric has not improved by more
than train.patience_delta in that many validations.

Its counters (the best value, its step, the validations since) live in the run's `Progress`,
which every checkpoint holds, so a resumed run counts on where it stopped.
"""

from __future__ import annotations

import logging
import math

from aiayn.checkpoint import Progress
from aiayn.config import Config
from aiayn.metric_names import PREFIX

log = logging.getLogger("aiayn")


class EarlyStopping:
    def __init__(self, cfg: Config):
        self.metric, self.delta = cfg.checkpoint.best_metric, cfg.train.patience_delta
        self.higher_is_better = cfg.checkpoint.higher_is_better
        self.patience = cfg.train.patience

    def should_stop(self, progress: Progress, valid: dict[str, float]) -> bool:
        """Count this validation (in `progress`); True when the run should stop. Every rank
        decides alike: it sees the same scores (summed over the ranks, or rank 0's broadcast)."""
        value = valid.get(self.metric.removeprefix(f"{PREFIX}/"), float("nan"))
        best = progress.best_value
        if math.isfinite(value) and (best is None or self._gain(value, best) > self.delta):
            progress.best_value, progress.best_step, progress.since_best = value, progress.step, 0
            return False
        progress.since_best += 1
        if not self.patience or progress.since_best < self.patience:
            return False
        log.info(
            "early stop at step %d: %s has not improved by more than %g in %d validations; its "
            "last improvement was to %.6g at step %d",
            progress.step,
            self.metric,
            self.delta,
            progress.since_best,
            best if best is not None else float("nan"),
            progress.best_step,
        )
        return True

    def _gain(self, value: float, best: float) -> float:
        return value - best if self.higher_is_better else best - value
