"""Which checkpoints a run keeps, and which one is its best.

After every save the writer (rank 0), in a background thread off the save's critical path,
keeps the newest `keep_last`, every step that is a multiple of
`keep_every`, the `keep_best` with the best `best_metric`, the one `latest` names and the one
`best` names, and deletes the rest. `checkpoints/best` names the checkpoint with the best
`best_metric` recorded in the manifests (the later one on a tie), so it survives restarts and
needs no state of its own: it is recomputed from the manifests at every save.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from aiayn.checkpoint.format import BEST, LATEST, MANIFEST_FILE, step_of
from aiayn.runtime.durable import write_atomic


@dataclass
class Retention:
    keep_last: int
    keep_every: int = 0
    keep_best: int = 0
    best_metric: str = "valid/loss"
    higher_is_better: bool = False

    def ranked(self, ckpts: list[Path]) -> list[Path]:
        """The checkpoints that recorded `best_metric` with a finite value, best first (the
        later one on a tie)."""
        scored = []
        for ckpt in ckpts:
            try:
                value = json.loads((ckpt / MANIFEST_FILE).read_text())["metrics"][self.best_metric]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # saved without a validation at its step, or incomplete
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            scored.append((value if self.higher_is_better else -value, step_of(ckpt), ckpt))
        return [ckpt for _, _, ckpt in sorted(scored, reverse=True)]

    def after_save(self, root: Path, ckpts: list[Path]) -> None:
        """Point `best` at the best checkpoint (if any recorded the metric), then delete what
        no rule keeps. `ckpts`: the complete checkpoints, oldest first."""
        # Left by a crash during an earlier save, or during an earlier deletion.
        for stale in [*root.glob(".tmp-*"), *root.glob(".trash-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        ranked = self.ranked(ckpts)
        if ranked:
            write_atomic(root / BEST, ranked[0].name + "\n")
        keep = set(ckpts[-self.keep_last :]) | {pointed(root, LATEST), pointed(root, BEST)}
        if self.keep_every:
            keep |= {c for c in ckpts if step_of(c) % self.keep_every == 0}
        keep |= set(ranked[: self.keep_best])
        for old in ckpts:
            if old not in keep:
                # Out of the step_* names first, in one rename: a crash while the files go
                # leaves a .trash- folder (removed at the next save), never a half-deleted
                # checkpoint that a resume would look at.
                trash = root / f".trash-{old.name}"
                try:
                    os.replace(old, trash)
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)


def pointed(root: Path, name: str) -> Path | None:
    """The step directory the pointer file `root/name` names (None without one)."""
    try:
        return root / (root / name).read_text().strip()
    except OSError:
        return None
